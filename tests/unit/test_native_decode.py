"""engine.kernels.decoder_layers: a bf16 decode step's layers in one native call compute the bits the
modules compute, with cascade groups over a shared prefix, biases (Qwen2), per-head q/k norms (Qwen3),
and after the weights are packed again (the cached table is rebuilt); with --quantization w8a8_int8 too."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import library
from engine.layers.moe.layer import FusedMoE
from engine.layers.linear import prepack_linear_weights
from engine.kernels import decoder_layers
from utils_models import BatchDriver, ExtendReq, build_tiny_model, make_runner

STEPS = 8
PREFIX = 80  # > MIN_SHARED_PREFIX: requests 1 and 2 form a cascade group over request 0's slots


def _require_bf16_kernels() -> None:
    lib, layers = library.linear(), library.decoder_layers()
    if lib is None or layers is None or not lib.linear_bf16_available():
        pytest.skip("the native bf16 kernels need a C compiler and a CPU with AVX512-BF16")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"native_{request.param}")
    build_tiny_model(str(path), request.param, dtype=torch.bfloat16)
    return str(path)


def _decode_logits(model_dir: str, **server_args):
    return _decode_steps(make_runner(model_dir, dtype="bfloat16", **server_args))


def _decode_steps(runner):
    """Per decode step, the logits of 4 requests: one alone, three of which two share the first's
    PREFIX slots (as the radix cache would hand them out); the weights are packed again midway."""
    driver = BatchDriver(runner, seed=1)
    gen = torch.Generator().manual_seed(11)
    prompts = [[int(t) for t in torch.randint(0, 512, (n,), generator=gen)] for n in (90, 100, 95, 7)]
    rows = [driver.new_row() for _ in prompts]
    _, first = driver.run(driver.extend_batch([ExtendReq(rows[0], prompts[0]), ExtendReq(rows[3], prompts[3])]))
    table = runner.req_to_token_pool.req_to_token
    for r in rows[1:3]:
        table[r, :PREFIX] = table[rows[0], :PREFIX]
    _, rest = driver.run(driver.extend_batch([ExtendReq(r, p[PREFIX:], prefix_len=PREFIX)
                                              for r, p in zip(rows[1:3], prompts[1:3])]))
    tokens = [int(first[0]), int(rest[0]), int(rest[1]), int(first[1])]
    seq_lens = [len(p) for p in prompts]
    logits = []
    for step in range(STEPS):
        if step == STEPS // 2:
            prepack_linear_weights(runner.model)  # new panels: the native table must follow
        out, next_ids = driver.run(driver.decode_batch(rows, tokens, seq_lens))
        logits.append(out.next_token_logits.clone())
        tokens = [int(t) for t in next_ids]
        seq_lens = [n + 1 for n in seq_lens]
    return logits


def test_native_decode_layers_equal_the_modules(model_dir, monkeypatch):
    _require_bf16_kernels()
    runs, builds = [], []
    real_run, real_init = decoder_layers.DecoderLayers.run, decoder_layers.DecoderLayers.__init__

    def counting_run(self, *args, **kwargs):
        runs.append(kwargs.get("cascade", args[4] if len(args) > 4 else None))
        return real_run(self, *args, **kwargs)

    def counting_init(self, *args, **kwargs):
        builds.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(decoder_layers.DecoderLayers, "run", counting_run)
    monkeypatch.setattr(decoder_layers.DecoderLayers, "__init__", counting_init)
    native = _decode_logits(model_dir)
    assert len(runs) == STEPS and all(c is not None and c.prefix_lens.numel() == 1 for c in runs)
    assert len(builds) == 2  # once, and again after the repack
    monkeypatch.setattr(decoder_layers.DecoderLayersCache, "forward", lambda *args, **kwargs: None)
    modules = _decode_logits(model_dir)
    for a, b in zip(native, modules):
        assert torch.equal(a, b)


def _chain_equals_modules(model_dir: str, chained: bool, monkeypatch, **server_args) -> None:
    """The chain's logits equal the modules'; it runs every step where `chained`, none otherwise."""
    if library.linear() is None or library.decoder_layers() is None:
        pytest.skip("no kernel library on this machine")
    runs = []
    real_run = decoder_layers.DecoderLayers.run

    def counting_run(self, *args, **kwargs):
        runs.append(1)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(decoder_layers.DecoderLayers, "run", counting_run)
    native = _decode_logits(model_dir, **server_args)
    assert len(runs) == (STEPS if chained else 0)
    monkeypatch.setattr(decoder_layers.DecoderLayersCache, "forward", lambda *args, **kwargs: None)
    modules = _decode_logits(model_dir, **server_args)
    for a, b in zip(native, modules):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["w8a8_int8", "fp8"])
def test_native_decode_8bit_layers_equal_the_modules(model_dir, monkeypatch, method: str):
    """w8a8_int8 (linear_w8a8) and fp8 (linear_q8) layers in the chain, gate_up then SiLU-and-mul as two calls;
    Qwen2's biases keep the module path (the chain takes quantized linears without a bias)."""
    _chain_equals_modules(model_dir, "qwen2" not in model_dir, monkeypatch, quantization=method)


@pytest.mark.parametrize("int8_activations", [False, True])
def test_native_decode_int4_layers_equal_the_modules(model_dir, tmp_path, monkeypatch, int8_activations: bool):
    """AWQ layers: linear_q4, or linear_w4a8 with ENGINE_INT4_INT8_ACTIVATIONS (their float32 rows widened from
    bf16 and rounded back); Qwen2's biases keep the module path."""
    from utils_quant import write_int4_checkpoint

    monkeypatch.setenv("ENGINE_INT4_INT8_ACTIVATIONS", str(int(int8_activations)))
    quantized = str(tmp_path / "awq")
    write_int4_checkpoint(model_dir, quantized, "awq", group=32)
    _chain_equals_modules(quantized, "qwen2" not in model_dir, monkeypatch)


def test_native_decode_is_skipped_where_it_does_not_apply(model_dir, monkeypatch):
    """Unpacked linears (fp32 model, or packing refused) keep the module path."""
    _require_bf16_kernels()
    calls = []
    monkeypatch.setattr(decoder_layers.DecoderLayers, "run", lambda *a, **k: calls.append(1))
    runner = make_runner(model_dir, dtype="float32")
    driver = BatchDriver(runner, seed=1)
    row = driver.new_row()
    _, tok = driver.run(driver.extend_batch([ExtendReq(row, [1, 2, 3, 4, 5])]))
    driver.run(driver.decode_batch([row], [int(tok[0])], [5]))
    assert calls == []


@pytest.mark.parametrize("arch, quantization", [("mixtral", None), ("qwen3_moe", None), ("qwen2_moe", None),
                                                ("mixtral", "w8a8_int8"), ("qwen3_moe", "fp8")])
def test_native_decode_moe_layers_equal_the_modules(arch, quantization, tmp_path, monkeypatch):
    """Mixture-of-experts layers in the chain (router panels, moe_route, moe_experts: what SparseMoeBlock
    calls), bf16 experts (repacked midway) or --quantization's; the recorder counts the same experts. Qwen2-MoE's
    gated shared expert keeps the module path."""
    _require_bf16_kernels()
    build_tiny_model(str(tmp_path), arch, dtype=torch.bfloat16)
    counts = {}
    for chained in (True, False):
        runs = []
        real_run = decoder_layers.DecoderLayers.run

        def counting_run(self, *args, **kwargs):
            runs.append(1)
            return real_run(self, *args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(decoder_layers.DecoderLayers, "run", counting_run)
            if not chained:
                patch.setattr(decoder_layers.DecoderLayersCache, "forward", lambda *args, **kwargs: None)
            runner = make_runner(str(tmp_path), dtype="bfloat16", quantization=quantization)
            if quantization is not None:  # the experts are quantized and run natively
                experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
                assert experts and all(m.packed_experts is not None and m.packed_weight is not None for m in experts)
            counts[chained] = (_decode_steps(runner), runner.model.expert_recorder.counts.clone())
            assert len(runs) == (STEPS if chained and arch != "qwen2_moe" else 0)
    (native, native_counts), (modules, module_counts) = counts[True], counts[False]
    for a, b in zip(native, modules):
        assert torch.equal(a, b)
    assert torch.equal(native_counts, module_counts) and int(native_counts.sum()) > 0
