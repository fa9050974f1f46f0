"""Draw docs/architecture.png: the server's processes, the sockets between them, and the folder
of src/engine/ that holds each process's code.

    python scripts/draw_architecture.py [--output docs/architecture.png]

The picture is drawn from the tables below; when a process or a socket changes, change them and
run the script again (docs/architecture.md shows the image).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import List, Tuple

import matplotlib

matplotlib.use("Agg")  # no display needed

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "architecture.png")

WIDTH, HEIGHT = 16.0, 10.6  # the drawing's coordinates, in inches at the figure's size


@dataclass(frozen=True)
class Box:
    key: str
    x: float
    y: float
    w: float
    h: float
    title: str
    lines: Tuple[str, ...]
    code: str  # where its code lives
    color: str
    dashed: bool = False

    def anchor(self, side: str, frac: float = 0.5) -> Tuple[float, float]:
        """A point on one side of the box; `frac` runs left to right or bottom to top."""
        if side == "left":
            return self.x, self.y + frac * self.h
        if side == "right":
            return self.x + self.w, self.y + frac * self.h
        if side == "top":
            return self.x + frac * self.w, self.y + self.h
        return self.x + frac * self.w, self.y


BOXES = [
    Box("client", 0.2, 6.2, 1.9, 1.6, "client", ("curl, openai,", "a router"), "", "#eeeeee"),
    Box("main", 3.1, 5.4, 4.6, 3.2, "main process (engine::main)",
        ("uvicorn + FastAPI routes", "TokenizerManager (asyncio): tokenize, validate,",
         "fan out n > 1, per-request state, metrics", "--tokenizer-worker-num N: N such HTTP workers"),
        "entrypoints/  tokenizer/  parsers/", "#dbe9f6"),
    Box("sched0", 11.0, 5.4, 4.8, 3.2, "scheduler TP0 (engine::scheduler_TP0)",
        ("continuous batching: waiting queue, running set,", "prefill builder, KV manager (radix cache, pool),",
         "grammars, overlap of CPU and forward", "TpModelWorker -> ModelRunner -> model, sampler"),
        "scheduler/  mem_cache/  constrained/  model_executor/\nlayers/  models/  kernels/  sampling/",
        "#dff0d8"),
    Box("schedN", 11.0, 1.2, 4.8, 2.2, "scheduler TP1 .. TP(N-1)",
        ("the same loop on the requests rank 0", "broadcasts; its shard of the weights and KV"),
        "scheduler/ (process.py)", "#dff0d8"),
    Box("detok", 3.1, 1.2, 4.6, 2.2, "detokenizer (engine::detokenizer)",
        ("incremental decoding of new token ids,", "stop strings trimmed, never half a UTF-8 char"),
        "detokenizer/", "#fcf3d9"),
    Box("dp", 7.55, 9.0, 3.6, 1.2, "DP controller (--dp-size > 1)",
        ("one scheduler group per replica",), "dp_controller/", "#f2f2f2", dashed=True),
]


@dataclass(frozen=True)
class Arrow:
    start: Tuple[str, str, float]  # box key, side, fraction
    end: Tuple[str, str, float]
    label: str
    label_xy: Tuple[float, float]
    style: str = "-|>"
    rad: float = 0.0
    dotted: bool = False


ARROWS = [
    Arrow(("client", "right", 0.65), ("main", "left", 0.7), "HTTP\nrequest", (2.6, 7.95)),
    Arrow(("main", "left", 0.45), ("client", "right", 0.3), "JSON /\nSSE", (2.6, 6.0)),
    Arrow(("main", "right", 0.85), ("sched0", "left", 0.85),
          "ZMQ ipc 'scheduler' (PUSH -> PULL)\nTokenizedGenerateReqInput,\nTokenizedEmbeddingReqInput, AbortReq,\n"
          "control requests", (9.35, 7.3)),
    Arrow(("sched0", "left", 0.2), ("main", "right", 0.2),
          "ZMQ ipc 'tokenizer'\ncontrol replies, BatchEmbeddingOutput", (9.35, 5.6)),
    Arrow(("sched0", "bottom", 0.5), ("schedN", "top", 0.5),
          "torch.distributed:\nrank 0 broadcasts the inputs (gloo);\nthe forward's collectives (NCCL / gloo)",
          (13.4, 4.4), style="<|-|>"),
    Arrow(("sched0", "bottom", 0.12), ("detok", "right", 0.75),
          "ZMQ ipc 'detokenizer'\nBatchTokenIDOutput\n(new token ids, one per iteration)", (9.35, 3.6), rad=-0.15),
    Arrow(("detok", "top", 0.5), ("main", "bottom", 0.5),
          "ZMQ ipc 'tokenizer'\nBatchStrOutput", (5.4, 4.4)),
]


def draw_box(ax: Axes, box: Box) -> None:
    ax.add_patch(FancyBboxPatch((box.x, box.y), box.w, box.h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                facecolor=box.color, edgecolor="#444444", linewidth=1.2,
                                linestyle="--" if box.dashed else "-"))
    top = box.y + box.h
    ax.text(box.x + box.w / 2, top - 0.28, box.title, ha="center", va="center", fontsize=11, fontweight="bold")
    for i, line in enumerate(box.lines):
        ax.text(box.x + box.w / 2, top - 0.7 - 0.36 * i, line, ha="center", va="center", fontsize=9)
    if box.code:
        ax.text(box.x + box.w / 2, box.y + 0.12, box.code, ha="center", va="bottom", fontsize=8.5,
                family="monospace", color="#1f4e79")


def draw_arrow(ax: Axes, arrow: Arrow, boxes: dict) -> None:
    start = boxes[arrow.start[0]].anchor(arrow.start[1], arrow.start[2])
    end = boxes[arrow.end[0]].anchor(arrow.end[1], arrow.end[2])
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=arrow.style, mutation_scale=16, linewidth=1.4,
                                 color="#333333", connectionstyle=f"arc3,rad={arrow.rad}",
                                 linestyle=":" if arrow.dotted else "-"))
    ax.text(arrow.label_xy[0], arrow.label_xy[1], arrow.label, ha="center", va="center", fontsize=8.5,
            bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none", alpha=0.9))


FOOTNOTES: List[str] = [
    "launch/ starts every child with the spawn method and waits for each one's readiness message on a pipe; "
    "children watch their parent and exit when it goes.",
    "Every message is a msgspec struct of one tagged union (io_struct.py), msgpack-encoded; "
    "the ipc:// socket files live in a private temporary directory (PortArgs, port_args.py).",
    "With --dp-size > 1 the DP controller takes the scheduler's sockets and forwards to one TP group per replica; "
    "PD disaggregation adds a bootstrap server and a KV transfer link between servers (disaggregation/).",
]


def draw(output: str) -> None:
    fig = plt.figure(figsize=(WIDTH, HEIGHT))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, WIDTH)
    ax.set_ylim(0, HEIGHT)
    ax.axis("off")
    ax.text(0.3, HEIGHT - 0.3, "engine: processes and the sockets between them", fontsize=15, fontweight="bold",
            va="top")
    boxes = {box.key: box for box in BOXES}
    for box in BOXES:
        draw_box(ax, box)
    for arrow in ARROWS:
        draw_arrow(ax, arrow, boxes)
    for i, note in enumerate(FOOTNOTES):
        ax.text(0.3, 0.85 - 0.3 * i, note, fontsize=8.5, va="center", color="#333333")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    draw(parser.parse_args().output)


if __name__ == "__main__":
    main()
