"""Multi-LoRA serving in-process (engine/lora/): every request's greedy output equals peft's for its
adapter, in mixed batches of 4 adapters and the base model, under the radix cache, chunked prefill,
the overlap loop and a pool with fewer slots than adapters; load/unload; bad adapters refused."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("peft", reason="peft is the oracle of the LoRA tests (pip install peft)")

from lora_utils import ALL_MODULES, build_adapters, peft_greedy  # noqa: E402
from sched_utils import Harness  # noqa: E402
from utils_models import build_tiny_model, hf_greedy  # noqa: E402

from engine.io_struct import LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput  # noqa: E402
from engine.server_args import ServerArgs, ServerArgsError  # noqa: E402

STEPS = 8
HAS_CC = bool(shutil.which("gcc") or shutil.which("cc"))  # the native kernels build
ADAPTERS = {
    "r4-qv": dict(rank=4, targets=["q_proj", "v_proj"], seed=1),
    "r8-all": dict(rank=8, targets=ALL_MODULES, seed=2),
    "r4-mlp": dict(rank=4, targets=["gate_proj", "up_proj", "down_proj"], seed=3),
    "r8-attn": dict(rank=8, targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=4),
}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
           [1, 2, 3, 4, 5, 6, 7, 30, 31]]  # the last shares a prefix with the first


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = str(root / "base")
    hf = build_tiny_model(base)
    paths = build_adapters(hf, str(root / "adapters"), ADAPTERS)
    expected = {name: peft_greedy(hf, path, PROMPTS, STEPS) for name, path in paths.items()}
    expected[None] = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    assert all(expected[name] != expected[None] for name in paths)  # every adapter changes the output
    return base, paths, expected, hf, root


def harness(setup, overlap=False, **kwargs):
    from engine.scheduler.tp_worker import TpModelWorker

    base, paths, _, _, _ = setup
    kwargs.setdefault("lora_paths", [f"{n}={p}" for n, p in paths.items()])
    args = dict(model_path=base, max_total_tokens=kwargs.pop("max_total_tokens", 2048), max_running_requests=32,
                **kwargs)
    worker = TpModelWorker(ServerArgs(device="cpu", **args))
    return Harness(worker=worker, overlap=overlap, **args)


def run_mixed(h, names):
    rids = {}
    for name in names:
        for i, p in enumerate(PROMPTS):
            rids[(name, i)] = h.submit(p, max_new_tokens=STEPS, ignore_eos=True, lora_path=name)
    h.run_until_idle()
    return {key: h.outputs[rid].output_ids for key, rid in rids.items()}


ALL_NAMES = [None, *ADAPTERS]
CONFIGS = {
    "radix": {},
    "no-radix": dict(disable_radix_cache=True),
    "chunked": dict(chunked_prefill_size=4),
    "chunked-mixed-overlap": dict(chunked_prefill_size=4, enable_mixed_chunk=True, overlap=True),
    "overlap-page4": dict(overlap=True, page_size=4),
    "two-slots": dict(max_loras_per_batch=2),
}


# Prompts long enough that each request's rows form a segment the native path multiplies in place
# (backend.IN_PLACE_MIN_ROWS); chunks of 48 cut them mid-request, and mixed chunks put decode rows
# (grouped) after a prefill's segments in one forward.
LONG_PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate((40, 75, 33))]
LONG_CONFIGS = {
    "plain": {},
    "chunked-mixed-overlap": dict(chunked_prefill_size=48, enable_mixed_chunk=True, overlap=True),
}


def _use_path(monkeypatch, path):
    """The CPU path the LoRA products take: the native kernel (its family on: the default where it builds)
    or the torch ops (the family off); the calls of that path, recorded."""
    from engine.kernels import library
    from engine.lora import backend

    taken = []
    if path == "kernel":
        if not HAS_CC:
            pytest.skip("no C compiler: no native kernel")
        assert library.lora() is not None, "a C compiler is present but the kernels did not build"
        real_kernel = backend.lora_kernel
        monkeypatch.setattr(backend, "lora_kernel", lambda *args: taken.append(1) or real_kernel(*args))
    else:
        monkeypatch.setitem(library.switches(), library.Family.LORA, False)
        real = backend._lora_in_place
        monkeypatch.setattr(backend, "_lora_in_place", lambda *args: taken.append(1) or real(*args))
    return taken


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("name", list(LONG_CONFIGS))
def test_long_prompts_equal_peft(setup, name, path, monkeypatch):
    _, paths, _, hf, _ = setup
    taken = _use_path(monkeypatch, path)  # torch: the segments the native path multiplied in place
    expected = {adapter: peft_greedy(hf, path, LONG_PROMPTS, STEPS) for adapter, path in paths.items()}
    expected[None] = [hf_greedy(hf, p, STEPS) for p in LONG_PROMPTS]
    h = harness(setup, **dict(LONG_CONFIGS[name]))
    rids = {}
    for adapter in ALL_NAMES:
        for i, p in enumerate(LONG_PROMPTS):
            rids[(adapter, i)] = h.submit(p, max_new_tokens=STEPS, ignore_eos=True, lora_path=adapter)
    h.run_until_idle()
    for (adapter, i), rid in rids.items():
        assert h.outputs[rid].output_ids == expected[adapter][i], (adapter, i)
    assert taken


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_batches_equal_peft(setup, name, monkeypatch):
    # the native kernel (one config on the torch path too: test_mixed_batches_on_the_torch_path_equal_peft)
    taken = _use_path(monkeypatch, "kernel") if HAS_CC else [1]
    h = harness(setup, **dict(CONFIGS[name]))
    got = run_mixed(h, ALL_NAMES)
    expected = setup[2]
    for (adapter, i), ids in got.items():
        assert ids == expected[adapter][i], (adapter, i)
    assert taken


def test_mixed_batches_on_the_torch_path_equal_peft(setup, monkeypatch):
    _use_path(monkeypatch, "torch")
    h = harness(setup, **dict(CONFIGS["chunked-mixed-overlap"]))
    got = run_mixed(h, ALL_NAMES)
    expected = setup[2]
    for (adapter, i), ids in got.items():
        assert ids == expected[adapter][i], (adapter, i)


def test_adapters_never_exceed_slots_and_never_share_cache(setup, monkeypatch):
    """Every forward uses at most --max-loras-per-batch adapters; the same prompt under two adapters
    (and the base) is computed for each (no cached tokens across adapters)."""
    from engine.lora.lora_manager import LoRAManager

    seen = []
    original = LoRAManager.prepare

    def spy(self, forward_batch):
        seen.append({u for u in (forward_batch.lora_ids or []) if u is not None})
        return original(self, forward_batch)

    monkeypatch.setattr(LoRAManager, "prepare", spy)
    h = harness(setup, max_loras_per_batch=2)
    got = run_mixed(h, ALL_NAMES)
    assert max(len(s) for s in seen) == 2
    assert all(len(s) <= 2 for s in seen)
    assert got[("r8-all", 0)] == setup[2]["r8-all"][0]
    # The same prompt again under another adapter: nothing cached from the first one's KV.
    a = h.submit(PROMPTS[0], max_new_tokens=2, lora_path="r4-qv")
    h.run_until_idle()
    b = h.submit(PROMPTS[0], max_new_tokens=2, lora_path="r4-qv")
    c = h.submit(PROMPTS[0], max_new_tokens=2, lora_path="r4-mlp")
    h.run_until_idle()
    assert h.outputs[b].cached_tokens > 0  # the same adapter shares
    assert h.outputs[c].cached_tokens == 0 or h.outputs[c].output_ids == setup[2]["r4-mlp"][0][:2]
    assert h.outputs[a].output_ids == setup[2]["r4-qv"][0][:2]


def test_load_unload_while_serving(setup):
    base, paths, expected, _, _ = setup
    h = harness(setup, lora_paths=[f"r4-qv={paths['r4-qv']}"], max_lora_rank=8, lora_target_modules=["all"])
    unknown = h.submit(PROMPTS[0], max_new_tokens=2, lora_path="r8-all")
    h.run_until_idle()
    assert h.outputs[unknown].finished_reason["type"] == "abort"
    assert "not loaded" in h.outputs[unknown].finished_reason["message"]
    reply = h.control(LoadLoRAAdapterReqInput(lora_name="r8-all", lora_path=paths["r8-all"]))
    assert reply.success, reply.message
    assert set(reply.loaded_adapters) == {"r4-qv", "r8-all"}
    busy = h.submit(PROMPTS[2], max_new_tokens=STEPS, ignore_eos=True, lora_path="r8-all")
    h.step()  # prefilled, still running
    refused = h.control(UnloadLoRAAdapterReqInput(lora_name="r8-all"))
    assert not refused.success and "used by 1 request" in refused.message
    h.run_until_idle()
    assert h.outputs[busy].output_ids == expected["r8-all"][2]
    done = h.control(UnloadLoRAAdapterReqInput(lora_name="r8-all"))
    assert done.success and set(done.loaded_adapters) == {"r4-qv"}
    again = h.submit(PROMPTS[0], max_new_tokens=2, lora_path="r8-all")
    h.run_until_idle()
    assert h.outputs[again].finished_reason["type"] == "abort"
    # Loaded again (a new uid: nothing of the old one's cache is reused), exact again.
    assert h.control(LoadLoRAAdapterReqInput(lora_name="r8-all", lora_path=paths["r8-all"])).success
    out = run_mixed(h, ["r8-all"])
    assert [out[("r8-all", i)] for i in range(len(PROMPTS))] == expected["r8-all"]


def test_bad_adapters_are_refused(setup, tmp_path):
    base, paths, _, _, _ = setup
    h = harness(setup, lora_paths=[f"r4-qv={paths['r4-qv']}"], max_lora_rank=4, lora_target_modules=["q_proj", "v_proj"])

    def load(name, path):
        return h.control(LoadLoRAAdapterReqInput(lora_name=name, lora_path=path))

    assert "above --max-lora-rank 4" in load("big", paths["r8-all"]).message
    assert "does not enable" in load("mlp", paths["r4-mlp"]).message
    assert "no adapter_config.json" in load("none", str(tmp_path)).message
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(open(os.path.join(paths["r4-qv"], "adapter_config.json")).read())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    assert "cannot be read" in load("corrupt", str(corrupt)).message
    assert "already loaded" in load("r4-qv", paths["r4-qv"]).message
    assert "not valid" in load("bad name!", paths["r4-qv"]).message
    assert not h.control(UnloadLoRAAdapterReqInput(lora_name="nope")).success
    # Nothing was kept of the refused ones; the loaded adapter still serves exactly.
    last = h.control(LoadLoRAAdapterReqInput(lora_name="r4-qv", lora_path=paths["r4-qv"]))
    assert set(last.loaded_adapters) == {"r4-qv"}
    out = run_mixed(h, ["r4-qv"])
    assert out[("r4-qv", 1)] == setup[2]["r4-qv"][1]


def test_lora_request_without_lora_server_is_refused(setup):
    from engine.scheduler.tp_worker import TpModelWorker

    base = setup[0]
    h = Harness(worker=TpModelWorker(ServerArgs(model_path=base, device="cpu", max_total_tokens=1024)),
                model_path=base, max_total_tokens=1024)
    rid = h.submit(PROMPTS[0], max_new_tokens=2, lora_path="x")
    h.run_until_idle()
    assert "LoRA is not enabled" in h.outputs[rid].finished_reason["message"]


def test_server_args_refuse_bad_flags(setup, tmp_path):
    base, paths, _, _, _ = setup
    with pytest.raises(ServerArgsError, match="above --max-lora-rank"):
        ServerArgs(model_path=base, lora_paths=[f"a={paths['r8-all']}"], max_lora_rank=4)
    with pytest.raises(ServerArgsError, match="does not enable"):
        ServerArgs(model_path=base, lora_paths=[f"a={paths['r8-all']}"], lora_target_modules=["q_proj"])
    with pytest.raises(ServerArgsError, match="no adapter_config.json"):
        ServerArgs(model_path=base, lora_paths=[str(tmp_path)])
    args = ServerArgs(model_path=base, lora_paths=[
        paths["r4-qv"], json.dumps({"lora_name": "j", "lora_path": paths["r8-attn"]})])
    assert args.enable_lora and args.max_lora_rank == 8
    assert args.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]


# Run in a subprocess: Triton reads TRITON_INTERPRET when triton is imported (see test_triton_kernels.py).
_KERNEL_CHECK = """
import torch
from engine.lora.backend import NativeShape, build_batch_info, lora_native, lora_triton, native_b

torch.manual_seed(0)
slots, rank, k, sections = 4, 8, 40, [(0, 24), (24, 8), (32, 8)]
n = sum(s for _, s in sections)
a = torch.randn(slots, len(sections) * rank, k)
b = torch.randn(slots, n, rank)
a[0].zero_()
b[0].zero_()
scalings = torch.tensor([0.0, 2.0, 0.5, 1.5])
row_slots = [1] * 5 + [0] * 3 + [3] * 17 + [2] + [1] * 2
info = build_batch_info(row_slots, scalings, torch.device("cpu"), NativeShape(n, len(sections) * rank, torch.float32))
x = torch.randn(len(row_slots), k)
base = torch.randn(len(row_slots), n)
want, got = base.clone(), base.clone()
lora_native(x, want, a, native_b(b, sections, rank, scalings), sections, rank, info.native)
lora_triton(x, got, a, b, sections, rank, info)
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
assert not torch.equal(want, base)
assert torch.equal(got[5:8], base[5:8])  # rows without an adapter are untouched
print("KERNEL-OK")
"""


@pytest.mark.slow
def test_triton_kernel_equals_native():
    """The segmented GEMM kernel under the Triton interpreter against the native loop (tiny shapes,
    fused sections, slots with and without an adapter, segments of several lengths)."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "KERNEL-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


# Row layouts of the native path: adapters interleaved with base rows (padded groups), one adapter
# whose rows are already in order (no gather), very unequal groups (the long ones in place, the
# short ones looped, not padded), adapters on non-consecutive slots (the pool's slots gathered), a
# single row; a prefill (requests' rows consecutive: every segment in place), and a mixed batch
# (a prefill's segments in place, then decode rows grouped). Each: (row slots, padded grouped
# layout or None without one, segments in place).
_LONG = 40  # rows of a prefill's request: >= backend.IN_PLACE_MIN_ROWS
_LAYOUTS = {
    "interleaved": ([1, 1, 0, 3, 2, 1, 3, 3, 0, 4], True, 0),
    "in-order": ([2] * 7, True, 0),
    "unequal": ([1] * 90 + [0, 3, 2] + ([1] * 31 + [0]) * 10 + [2, 2, 3] + [1] * _LONG, False, 2),
    "sparse-slots": ([4, 2, 4, 0, 2, 4], True, 0),
    "one-row": ([3], True, 0),
    "prefill": ([2] * _LONG + [0] * _LONG + [4] * _LONG + [2] * (_LONG + 3) + [1] * _LONG, None, 4),
    "prefill-and-decode": ([3] * _LONG + [1] * (_LONG + 5) + [0] * _LONG + [1, 0, 2, 3, 2, 4], True, 2),
}


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_native_path_equals_a_per_row_reference(layout):
    """The native path (rows grouped by adapter: padded batched products, or a loop over adapters when
    the groups are very unequal) against the delta computed row by row, in float32 and bfloat16."""
    from engine.lora import backend

    row_slots, padded, in_place = _LAYOUTS[layout]
    torch.manual_seed(1)
    slots, rank, k, sections = 5, 4, 24, [(0, 16), (16, 8), (24, 8)]
    n = sum(s for _, s in sections)
    a = torch.randn(slots, len(sections) * rank, k)
    b = torch.randn(slots, n, rank)
    a[0].zero_()
    b[0].zero_()
    scalings = torch.tensor([0.0, 2.0, 0.5, 1.5, 3.0])
    # The workspace is sized for a wider projection than this one (as for a model's narrower targets).
    shape = backend.NativeShape(n + 8, len(sections) * rank + 4, torch.float32)
    info = backend.build_batch_info(row_slots, scalings, torch.device("cpu"), shape)
    plan = info.native
    assert plan is not None and len(plan.segments) == in_place
    assert (plan.grouped is None) == (padded is None)
    if plan.grouped is not None:
        assert plan.grouped.padded == padded
        assert (plan.grouped.gather is None) == (layout in ("in-order", "one-row"))
        plan.grouped.workspace.fill_(float("nan"))  # stale workspace values must never reach the output
    plan.shrink.fill_(float("nan"))
    x, base = torch.randn(len(row_slots), k), torch.randn(len(row_slots), n)
    want = base.clone()
    for t, s in enumerate(row_slots):
        if s == 0:
            continue
        shrink = a[s] @ x[t]
        for i, (off, size) in enumerate(sections):
            want[t, off:off + size] += b[s, off:off + size] @ shrink[i * rank:(i + 1) * rank] * scalings[s]
    b_sections = backend.native_b(b, sections, rank, scalings)
    for _ in range(2):  # a second projection of the same forward reuses the workspace
        got = base.clone()
        backend.lora_native(x, got, a, b_sections, sections, rank, plan)
        # float32, summed in another order (the in-place products accumulate into out)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)
    low = base.to(torch.bfloat16)  # a bfloat16 model: the products run in float32, added in bfloat16
    backend.lora_native(x.to(torch.bfloat16), low, a, b_sections, sections, rank, plan)
    torch.testing.assert_close(low.float(), want, rtol=2e-2, atol=0.2)  # x and out are rounded to bf16
    single = [(0, n)]  # an unfused projection (o / down): one section
    want1 = base.clone()
    for t, s in enumerate(row_slots):
        if s:
            want1[t] += b[s] @ (a[s, :rank] @ x[t]) * scalings[s]
    got1 = base.clone()
    backend.lora_native(x, got1, a[:, :rank].contiguous(), backend.native_b(b, single, rank, scalings), single, rank,
                        plan)
    torch.testing.assert_close(got1, want1, rtol=1e-5, atol=5e-5)


def test_batch_without_adapter_rows_has_no_native_layout():
    from engine.lora import backend

    shape = backend.NativeShape(8, 4, torch.float32)
    info = backend.build_batch_info([0, 0, 0], torch.zeros(3), torch.device("cpu"), shape)
    assert not info.has_lora and info.native is None
