"""CudaGraphRunner on the CPU: bucketing, padding and slicing, with a fake "graph".

The fake graph keeps the contract of a real one that matters here: what was captured is a function
of the static buffers only, and a replay re-runs it over whatever those buffers hold now, writing
into the same outputs. The attention backend must then read static metadata too; torch_native's
is shaped per batch, so the in-process tests use a graph-capable variant of it over fixed-width
buffers, and the real triton backend (its capture/replay hooks) runs in a subprocess under
TRITON_INTERPRET=1 (see test_triton_backend_graph_hooks_interpreted).

Reference: the same model on a second ModelRunner without graphs, fed the same batches. The
padded replays must give the plain forward's logits and greedy tokens for batch sizes that are
not captured, and must write no K/V outside the padding slot.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Callable, List, Sequence, Tuple

import pytest
import torch

from utils_models import BatchDriver, ExtendReq, build_tiny_model, make_runner  # noqa: E402

from engine.layers.attention.torch_native_backend import TorchNativeAttnBackend, _DecodeMetadata  # noqa: E402
from engine.model_executor.cuda_graph_runner import (  # noqa: E402
    CudaGraphRunner,
    get_batch_sizes_to_capture,
    maybe_create_cuda_graph_runner,
    padded_batch_size,
)
from engine.model_executor.model_runner import RESERVE_SLACK_BYTES, kv_cache_budget_bytes  # noqa: E402


# ---------------------------------------------------------------------------- fakes
class FakeGraph:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.replays = 0

    def replay(self) -> None:
        self.fn()
        self.replays += 1


class FakeGraphFactory:
    """Records warm-ups and captures in order, as (event, id of the captured function)."""

    def __init__(self) -> None:
        self.events: List[Tuple[str, int]] = []

    def warmup(self, fn: Callable[[], None], runs: int) -> None:
        for _ in range(runs):
            fn()
            self.events.append(("warmup", id(fn)))

    def capture(self, fn: Callable[[], None]) -> FakeGraph:
        fn()
        self.events.append(("capture", id(fn)))
        return FakeGraph(fn)


class StaticTorchBackend(TorchNativeAttnBackend):
    """torch_native with graph-safe decode metadata: [max_bs, context_len] slot and mask buffers."""

    supports_cuda_graph = True

    def __init__(self, model_runner) -> None:
        super().__init__(model_runner)
        self.width = model_runner.req_to_token_pool.req_to_token.shape[1]

    def init_cuda_graph_state(self, max_bs: int) -> None:
        self.kv_indices = torch.zeros(max_bs, self.width, dtype=torch.int64)
        self.valid = torch.zeros(max_bs, self.width, dtype=torch.bool)
        self.lens = torch.zeros(max_bs, dtype=torch.int64)

    def init_forward_metadata_capture_cuda_graph(self, fb) -> None:
        bs = fb.batch_size
        fb.attn_metadata = _DecodeMetadata(kv_indices=self.kv_indices[:bs], lens=self.lens[:bs],
                                           mask=self.valid[:bs, None, None, :], shared=[])

    def init_forward_metadata_replay_cuda_graph(self, fb) -> None:
        bs = fb.batch_size
        rows = fb.req_to_token_pool.req_to_token.index_select(0, fb.req_pool_indices).long()
        valid = torch.arange(self.width).unsqueeze(0) < fb.seq_lens.unsqueeze(1)
        self.kv_indices[:bs].copy_(torch.where(valid, rows, torch.zeros_like(rows)))
        self.valid[:bs].copy_(valid)
        self.lens[:bs].copy_(fb.seq_lens)


# ---------------------------------------------------------------------------- pure logic
def test_batch_sizes_to_capture():
    assert get_batch_sizes_to_capture(0) == []
    assert get_batch_sizes_to_capture(1) == [1]
    assert get_batch_sizes_to_capture(3) == [1, 2, 3]
    assert get_batch_sizes_to_capture(8) == [1, 2, 4, 8]
    assert get_batch_sizes_to_capture(30) == [1, 2, 4, 8, 16, 24, 30]
    sizes = get_batch_sizes_to_capture(160)
    assert sizes[:7] == [1, 2, 4, 8, 16, 24, 32] and sizes[-1] == 160
    assert all(b - a == 8 for a, b in zip(sizes[4:], sizes[5:]))


def test_padded_batch_size():
    sizes = [1, 2, 4, 8, 16, 24]
    assert [padded_batch_size(b, sizes) for b in (1, 2, 3, 5, 8, 9, 17, 24)] == [1, 2, 4, 8, 8, 16, 24, 24]
    assert padded_batch_size(25, sizes) is None


def test_kv_cache_budget():
    gib = 1 << 30
    # Plenty of memory: the fraction decides.
    assert kv_cache_budget_bytes(100 * gib, 0.88, 4 * gib) == int(100 * gib * 0.88)
    # Little memory: the reserve for activations decides.
    assert kv_cache_budget_bytes(10 * gib, 0.88, 4 * gib) == 6 * gib
    # Not even the reserve: nothing (the caller then refuses to start).
    assert kv_cache_budget_bytes(2 * gib, 0.88, 4 * gib) == 0


def test_runner_is_only_created_on_cuda_with_a_graph_backend(caplog):
    def fake_runner(device: str, backend, disable: bool = False):
        args = SimpleNamespace(disable_cuda_graph=disable, attention_backend=type(backend).__name__,
                               cuda_graph_max_bs=8)
        return SimpleNamespace(device=device, server_args=args, attn_backend=backend,
                               req_to_token_pool=SimpleNamespace(size=16))

    native = TorchNativeAttnBackend(SimpleNamespace(device="cpu"))
    assert maybe_create_cuda_graph_runner(fake_runner("cpu", native)) is None
    assert maybe_create_cuda_graph_runner(fake_runner("cuda:0", native, disable=True)) is None
    with caplog.at_level(logging.INFO, logger="engine.model_executor.cuda_graph_runner"):
        assert maybe_create_cuda_graph_runner(fake_runner("cuda:0", native)) is None
    assert "does not support" in caplog.text
    with pytest.raises(ValueError, match="does not support CUDA graphs"):
        CudaGraphRunner(fake_runner("cpu", native), graph_factory=FakeGraphFactory())


# ---------------------------------------------------------------------------- with a model
PROMPT_LENS = [5, 23, 17, 40, 9, 12, 31, 3, 26]
# Decode batches as (first row, number of rows): sizes 7, 3 (after a larger batch: stale rows must
# be reset), 5, 1 (exactly captured), 9 (above the largest graph: plain forward), 6, 2.
SCHEDULE = [(0, 7), (0, 7), (2, 3), (0, 5), (4, 1), (0, 9), (1, 6), (5, 2), (0, 7)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama_graph")
    build_tiny_model(str(path), "llama", seed=11)
    return str(path)


def _prompts() -> List[List[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def drive(runner, schedule: Sequence[Tuple[int, int]], on_step=None,
          num_prompts: int = len(PROMPT_LENS)) -> List[Tuple[torch.Tensor, List[int]]]:
    """Prefill the prompts, then run the decode batches of `schedule`; (logits, tokens) per step."""
    driver = BatchDriver(runner, seed=3)
    prompts = _prompts()[:num_prompts]
    rows = [driver.new_row() for _ in prompts]
    _, first = driver.run(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, prompts)]))
    last = first.tolist()
    seq_lens = [len(p) for p in prompts]
    results = []
    for start, count in schedule:
        idx = list(range(start, start + count))
        fb = driver.decode_batch([rows[i] for i in idx], [last[i] for i in idx], [seq_lens[i] for i in idx])
        out, tokens = driver.run(fb)
        results.append((out.next_token_logits.clone(), tokens.tolist()))
        for i, t in zip(idx, tokens.tolist()):
            last[i] = t
            seq_lens[i] += 1
        if on_step is not None:
            on_step(count)
    return results


def _graph_runner(path: str, batch_sizes: List[int], backend_cls=StaticTorchBackend, warmup_runs: int = 2,
                  **runner_args):
    runner = make_runner(path, max_running_requests=16, **runner_args)
    assert runner.cuda_graph_runner is None  # never on the CPU by itself
    runner.attn_backend = backend_cls(runner)
    factory = FakeGraphFactory()
    runner.cuda_graph_runner = CudaGraphRunner(runner, graph_factory=factory, batch_sizes=batch_sizes,
                                                warmup_runs=warmup_runs)
    return runner, factory


def test_padded_replay_equals_plain_forward(tiny_llama):
    plain = drive(make_runner(tiny_llama, max_running_requests=16), SCHEDULE)

    runner, factory = _graph_runner(tiny_llama, [1, 2, 4, 8])
    cgr = runner.cuda_graph_runner
    seen_padding: List[Tuple[int, List[int], List[int], List[int]]] = []

    def check_padding(count: int) -> None:
        bucket = padded_batch_size(count, cgr.capture_bs)
        if bucket is not None and bucket > count:
            seen_padding.append((count, cgr.req_pool_indices[count:bucket].tolist(),
                                 cgr.seq_lens[count:bucket].tolist(), cgr.out_cache_loc[count:bucket].tolist()))

    graphed = drive(runner, SCHEDULE, on_step=check_padding)

    for step, ((logits_p, tokens_p), (logits_g, tokens_g)) in enumerate(zip(plain, graphed)):
        assert logits_g.shape == logits_p.shape, f"step {step}: outputs not sliced back to the batch"
        torch.testing.assert_close(logits_g, logits_p, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        assert tokens_g == tokens_p, f"step {step}"

    # Which graph served which batch: 7, 7, 5, 6 and 7 rows -> 8; 3 -> 4; 1 -> 1; 2 -> 2; 9 rows: none.
    assert {bs: g.replays for bs, g in cgr.graphs.items()} == {1: 1, 2: 1, 4: 1, 8: 5}
    # Every padded row named the reserved request row, length 1 and the padding slot.
    assert len(seen_padding) == 6
    for count, rows, lens, locs in seen_padding:
        assert rows == [0] * len(rows) and lens == [1] * len(lens) and locs == [0] * len(locs), count

    # Padding wrote K/V to slot 0 only: every other slot equals the plain runner's.
    ref = make_runner(tiny_llama, max_running_requests=16)
    drive(ref, SCHEDULE)
    for layer in range(runner.model_config.num_hidden_layers):
        torch.testing.assert_close(runner.token_to_kv_pool.k_buffer[layer][1:], ref.token_to_kv_pool.k_buffer[layer][1:])
        torch.testing.assert_close(runner.token_to_kv_pool.v_buffer[layer][1:], ref.token_to_kv_pool.v_buffer[layer][1:])


def test_capture_warms_up_each_size_before_capturing_it(tiny_llama):
    runner, factory = _graph_runner(tiny_llama, [1, 2, 4])
    cgr = runner.cuda_graph_runner
    captured = [fn for event, fn in factory.events if event == "capture"]
    assert len(captured) == 3 and sorted(cgr.graphs) == [1, 2, 4]
    for fn in captured:
        kinds = [event for event, f in factory.events if f == fn]
        assert kinds == ["warmup"] * cgr.warmup_runs + ["capture"]
    # Largest first, so the shared memory pool starts with the biggest blocks.
    assert [id(cgr.graphs[bs].fn) for bs in (4, 2, 1)] == captured


def test_can_run_only_decode_batches_that_fit(tiny_llama):
    runner, _ = _graph_runner(tiny_llama, [1, 2, 4])
    cgr = runner.cuda_graph_runner
    driver = BatchDriver(runner, seed=1)
    rows = [driver.new_row() for _ in range(5)]
    extend = driver.extend_batch([ExtendReq(r, [1, 2, 3]) for r in rows])
    assert not cgr.can_run(extend)
    driver.run(extend)
    assert cgr.can_run(driver.decode_batch(rows[:3], [4, 4, 4], [3, 3, 3]))
    assert not cgr.can_run(driver.decode_batch(rows, [4] * 5, [3] * 5))
    with pytest.raises(ValueError, match="larger than the largest captured graph"):
        cgr.replay(driver.decode_batch(rows, [5] * 5, [4] * 5))


def test_activation_reserve_counts_graphs(tiny_llama):
    with_graphs = make_runner(tiny_llama, max_running_requests=16)
    without = make_runner(tiny_llama, max_running_requests=16, disable_cuda_graph=True)
    vocab = with_graphs.model_config.vocab_size
    r1, r2 = with_graphs.activation_reserve_bytes(), without.activation_reserve_bytes()
    assert r2 > RESERVE_SLACK_BYTES
    assert r1 - r2 == with_graphs.server_args.cuda_graph_max_bs * vocab * 4 * 2


# ---------------------------------------------------------------------------- the triton backend
TRITON_SCHEDULE = [(0, 3), (1, 1), (0, 2)]


def check_triton_graph_hooks(path: str) -> None:
    """Runs under TRITON_INTERPRET=1: the real triton backend's capture/replay hooks."""
    from engine.layers.attention.triton_backend import TritonAttnBackend

    plain = drive(make_runner(path, max_running_requests=16, attention_backend="triton"), TRITON_SCHEDULE,
                  num_prompts=3)
    # One warm-up: interpreted kernels are slow, and compilation is not what is tested here.
    runner, _ = _graph_runner(path, [1, 4], backend_cls=TritonAttnBackend, warmup_runs=1, attention_backend="triton")
    cgr = runner.cuda_graph_runner
    graphed = drive(runner, TRITON_SCHEDULE, num_prompts=3)
    for step, ((logits_p, tokens_p), (logits_g, tokens_g)) in enumerate(zip(plain, graphed)):
        torch.testing.assert_close(logits_g, logits_p, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        assert tokens_g == tokens_p, f"step {step}"
    assert {bs: g.replays for bs, g in cgr.graphs.items()} == {1: 1, 4: 2}
    # The scratch was pre-sized for the model's heads: no per-graph allocation happened.
    backend = runner.attn_backend
    assert list(backend.cuda_graph_scratch) == [backend.layer_heads]
    for fb in cgr.forward_batches.values():
        assert list(fb.attn_metadata.scratch) == [backend.layer_heads]
    print("TRITON_GRAPH_HOOKS_OK")


@pytest.mark.slow  # a subprocess running the Triton backend under the interpreter
def test_triton_backend_graph_hooks_interpreted(tiny_llama):
    pytest.importorskip("triton")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('graph_runner_case', {__file__!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        f"mod.check_triton_graph_hooks({tiny_llama!r})\n"
    )
    # The child imports the shared test helpers (utils_models) as pytest's `pythonpath` lets us.
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "TRITON_GRAPH_HOOKS_OK" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
