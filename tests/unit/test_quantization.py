"""Quantized linears (--quantization w8a8_int8 / fp8, layers/quantization.py, csrc/linear_q8.c).

Oracle: the float64 product of the activations with the dequantized weight (qweight * scale), so the
only difference allowed is float32 summation order. w8a8_int8 quantizes the activations per row first
(SGLang's per-token int8): its oracle is the float64 product of those int8 values (computed here with the
float32 operations the spec names) with the int8 weights, times both scales."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kernels import library
from engine.layers import quantization as quant
from engine.layers.quantization import QuantizedWeight, quantize_weight, quantized_linear

METHODS = ["w8a8_int8", "fp8"]


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8: scale max |x| / 127 (at least 1e-10 / 127), values round(x * (127 / max)) to nearest
    even, each float32 operation correctly rounded (127 as a tensor: torch's number / tensor is not)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10)
    qmax = torch.full_like(amax, 127.0)
    return (xf * (qmax / amax)).round().clamp(-127, 127), amax / qmax


def _oracle(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if qw.int8_activations:
        values, x_scale = _int8_rows(x)
        out = (values.double() @ qw.qweight.double().T) * x_scale.double() * qw.scale.double()
    else:
        out = x.double() @ (qw.qweight.double() * qw.scale.double()[:, None]).T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("method", METHODS)
def test_quantize_weight_per_channel(method: str) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(33, 70, generator=gen) * torch.linspace(0.01, 5.0, 33)[:, None]
    w[5] = 0.0  # an all-zero channel: scale 1, zeros
    qw = quantize_weight(w, method)
    assert qw.qweight.dtype == (torch.int8 if method == "w8a8_int8" else torch.float8_e4m3fn)
    assert qw.scale.shape == (33,) and qw.scale[5] == 1.0 and qw.dequantize()[5].abs().max() == 0
    amax = w.abs().amax(dim=1)
    qmax = 127.0 if method == "w8a8_int8" else 448.0
    nonzero = amax > 0
    assert torch.allclose(qw.scale[nonzero], amax[nonzero] / qmax)
    # The largest element of each channel lands on the format's largest value.
    assert torch.equal(qw.qweight.float().abs().amax(dim=1)[nonzero], torch.full((32,), qmax))
    err = (qw.dequantize() - w).abs()
    # int8: half a step of the channel's scale; e4m3: 3 mantissa bits, half an ulp is 1/16 relative.
    bound = qw.scale[:, None] * 0.5 + 1e-7 if method == "w8a8_int8" else w.abs() / 16 + qw.scale[:, None] * 2.0 ** -10
    assert bool((err <= bound).all())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 32, 35])
def test_quantized_linear_equals_dequantized_product(kernel_build: str, method: str, rows: int, monkeypatch) -> None:
    # Up to 32 rows the kernel, 35 the torch path; its row blocks of 256 KiB are 4 rows at k = 16384.
    monkeypatch.setattr(quant, "Q8_MAX_ROWS_F32", 32)
    monkeypatch.setattr(quant, "Q8_MAX_ROWS_BF16", 32)
    # k = 203: whole 8-wide vectors plus a tail of 3; n = 37: channel pairs plus one.
    gen = torch.Generator().manual_seed(rows)
    qw = quantize_weight(torch.randn(37, 203, generator=gen), method)
    bias = torch.randn(37, generator=gen)
    x = torch.randn(rows, 203, generator=gen)
    for b in (None, bias):
        out = quantized_linear(x, qw, b)
        assert out.dtype == torch.float32 and out.shape == (rows, 37)
        torch.testing.assert_close(out.double(), _oracle(x, qw, b), rtol=1e-5, atol=1e-5)
    # bf16 activations: the kernel (decode) rounds the float32 product once to bf16; the torch path
    # (prefill) multiplies by the weight dequantized to bf16, then rounds once (int8 activations: float32
    # sums of the integer products, then the scales, rounded once).
    xb = x.to(torch.bfloat16).reshape(1, rows, 203)
    out = quantized_linear(xb, qw, bias.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (1, rows, 37)
    if qw.int8_activations:
        expected = _oracle(xb[0], qw, bias.to(torch.bfloat16))
    else:
        weight = qw.dequantize(torch.float64) if rows <= 32 else qw.dequantize(torch.bfloat16).double()
        expected = xb[0].double() @ weight.T + bias.to(torch.bfloat16).double()
    err = (out[0].double() - expected).abs()
    assert bool((err <= expected.abs() * 2.0 ** -8 + 1e-3).all()), float(err.max())


@pytest.mark.parametrize("int8_activations", [False, True])
def test_kernel_row_blocks(kernel_build: str, int8_activations: bool) -> None:
    """k = 16384: rows in blocks of 4 (256 KiB of float32 activations), 9 rows are three blocks; with int8
    activations, int32 sums of up to 127 * 127 * 16384 (past float32's exact integers)."""
    gen = torch.Generator().manual_seed(3)
    qw = quantize_weight(torch.randn(5, 16384, generator=gen), "w8a8_int8")
    qw = dataclasses.replace(qw, int8_activations=int8_activations)
    x = torch.randn(9, 16384, generator=gen)
    # float32 sums of 16384 terms: the error bound scales with the sum of their magnitudes.
    magnitude = x.double().abs() @ qw.dequantize(torch.float64).abs().T
    err = (quantized_linear(x, qw, None).double() - _oracle(x, qw, None)).abs()
    assert bool((err <= magnitude * 1e-5).all()), float((err / magnitude).max())


def test_kernel_runs_where_it_should() -> None:
    if library.linear() is None:
        pytest.skip("no kernel library on this machine")
    qw = quantize_weight(torch.randn(16, 64), "w8a8_int8")
    calls = []
    real = library.linear()

    class Spy:
        def linear_q8(self, *args: int) -> int:
            calls.append(("q8", args[1]))
            return real.linear_q8(*args)

        def linear_w8a8(self, *args: int) -> int:
            calls.append(("w8a8", args[1]))
            return real.linear_w8a8(*args)

    import unittest.mock as mock

    weight_only = dataclasses.replace(qw, int8_activations=False)
    with mock.patch.object(library, "linear", lambda: Spy()):
        for w in (qw, weight_only):
            quantized_linear(torch.randn(3, 64), w, None)
            quantized_linear(torch.randn(quant.Q8_MAX_ROWS_F32 + 1, 64), w, None)  # a long prefill: torch
            quantized_linear(torch.randn(quant.Q8_MAX_ROWS_F32 + 1, 64).to(torch.bfloat16), w, None)
    assert calls == [("w8a8", 3), ("w8a8", quant.Q8_MAX_ROWS_F32 + 1), ("q8", 3), ("q8", quant.Q8_MAX_ROWS_F32 + 1)]


def test_fp8_kernel_widens_every_e4m3_value(kernel_build: str) -> None:
    """Every finite e4m3 byte (normals, subnormals, both zeros) as a weight, each alone in its channel."""
    values = torch.arange(256, dtype=torch.uint8)
    finite = values[(values & 0x7F) != 0x7F]
    q = finite.view(torch.float8_e4m3fn)
    k = 11  # one vector of 8 and a scalar tail of 3: both widening paths
    for col in (0, 9):  # in the vector part, in the tail
        qweight = torch.zeros(len(q), k, dtype=torch.float8_e4m3fn)
        qweight[:, col] = q
        qw = QuantizedWeight("fp8", qweight, torch.ones(len(q)))
        x = torch.zeros(1, k)
        x[0, col] = 1.0
        out = quantized_linear(x, qw, None)
        assert torch.equal(out[0], q.float()), col


def test_int8_activations_are_sglangs_per_token_int8(kernel_build: str, monkeypatch) -> None:
    """Through an identity weight the output is q_x * x_scale: the kernel's per-row values and scales equal
    the spec's (_int8_rows), ties rounded to even, an all-zero row all zeros; the torch path (past the
    kernel's rows) computes the same."""
    k = 77  # two 32-byte vectors and a tail
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    x[1] = 0.0
    x[2, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -3.5])  # max 127: x * 127 / max = x
    x[2, 8:] = 0.25
    qw = QuantizedWeight("w8a8_int8", torch.eye(k, dtype=torch.int8), torch.ones(k), int8_activations=True)
    values, x_scale = _int8_rows(x)
    assert values[2, :8].tolist() == [127.0, 0.0, 2.0, 2.0, 0.0, -2.0, 126.0, -4.0] and values[1].abs().sum() == 0
    for rows in (quant.Q8_MAX_ROWS_F32, 2):  # the kernel, then the torch path for all 5 rows
        out = quantized_linear(x, qw, None)
        assert torch.equal(out, values * x_scale), rows
        monkeypatch.setattr(quant, "Q8_MAX_ROWS_F32", rows)


@pytest.mark.parametrize("sign", [1, -1])
def test_int8_products_never_saturate(kernel_build: str, sign: int) -> None:
    """Every product +-127 * 127, pairs of them 32258 in magnitude (vpmaddubsw saturates at 32767): the sums
    are exact, 127 * 127 * k, for one row and for a tile of two."""
    k = 1000
    signs = torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)
    x = (signs * 2.0).repeat(3, 1)  # max |x| = 2: every value quantizes to +-127
    w = (signs * 127 * sign).to(torch.int8).repeat(6, 1)
    qw = QuantizedWeight("w8a8_int8", w, torch.full((6,), 0.5), int8_activations=True)
    for rows in (1, 3):
        out = quantized_linear(x[:rows], qw, None)
        expected = sign * 127 * 127 * k * (2.0 / 127) * 0.5
        assert torch.equal(out, torch.full((rows, 6), expected, dtype=torch.float32)), rows


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [3, 9, 37, 40, 1536])
def test_int8_one_row_exact(kernel_build: str, threads: int, n: int) -> None:
    """One row with k a multiple of 32 (the decode path with its prefetch; whole groups of 4 channels, the
    last partial group in the generic tile, the threads' ranges meeting anywhere): every output is the
    float32 of (the exact int32 sum * x_scale) * w_scale + bias, bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernel splits the channel groups between torch's threads
    try:
        for k in (32, 1024, 2816):
            gen = torch.Generator().manual_seed(n * k)
            qw = quantize_weight(torch.randn(n, k, generator=gen), "w8a8_int8")
            qw = dataclasses.replace(qw, int8_activations=True)
            x, bias = torch.randn(1, k, generator=gen), torch.randn(n, generator=gen)
            values, x_scale = _int8_rows(x)
            # exact in float64, then rounded to float32 once, as the kernel converts its int32 sum
            sums = (values.double() @ qw.qweight.double().T).float()
            for b in (None, bias):
                expected = sums * x_scale * qw.scale
                if b is not None:
                    expected = expected + b
                assert torch.equal(quantized_linear(x, qw, b), expected), (k, b is None)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_exact_on_every_path(int8_isa: str, dtype: torch.dtype, monkeypatch) -> None:
    """Every row count, channel count and input width the paths split on: AMX from 2 rows where k is a multiple
    of 64 (16-row blocks, a partial last one; 4-block channel groups, a short last group, channels past the last
    whole block of 16 on the vector paths), VNNI's 64-input steps with a 32-input and a scalar tail: every output
    is the float32 of (the exact int32 sum * x_scale) * w_scale + bias, bit for bit, rounded once to bf16."""
    monkeypatch.setattr(quant, "Q8_MAX_ROWS_F32", 64)  # 40 float32 rows on the kernel
    for k in (64, 200, 1024, 2816):
        for n in (9, 16, 37, 100, 128):
            for rows in (1, 2, 5, 16, 17, 40):
                gen = torch.Generator().manual_seed(k * 1000 + n * 100 + rows)
                qw = dataclasses.replace(quantize_weight(torch.randn(n, k, generator=gen), "w8a8_int8"),
                                         int8_activations=True)
                x, bias = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, generator=gen)
                values, x_scale = _int8_rows(x.float())
                sums = (values.double() @ qw.qweight.double().T).float()
                for b in (None, bias):
                    expected = sums * x_scale * qw.scale
                    if b is not None:
                        expected = expected + b
                    out = quantized_linear(x, qw, b)
                    assert torch.equal(out, expected.to(dtype)), (k, n, rows, b is None)


@pytest.mark.parametrize("method", ["fp8", "w8a8_int8"])
def test_8bit_weights_against_bf16_rows_on_amx_and_vector_paths(method: str) -> None:
    """e4m3 and weight-only int8 weights against bf16 rows: AMX (from 4 rows, k a multiple of 32: the weights
    widened to bf16, tdpbf16ps) and the vector path equal the float64 product up to float32 summation order and
    the one rounding to bf16; whole 16-channel blocks, a short last group and channels past the last block."""
    lib = library.library_info()
    if lib is None:
        pytest.skip("no kernel library on this machine")
    before = lib.amx_active()
    try:
        for n in (16, 37, 64, 100, 200):
            for k in (32, 96, 1024):
                for rows in (2, 4, 5, 16, 17, 40):
                    gen = torch.Generator().manual_seed(n * k + rows)
                    qw = dataclasses.replace(quantize_weight(torch.randn(n, k, generator=gen), method),
                                             int8_activations=False)
                    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
                    bias = torch.randn(n, generator=gen)
                    expected = x.double() @ qw.dequantize(torch.float64).T + bias.double()
                    for amx in (1, 0):
                        lib.amx_set(amx)
                        err = (quantized_linear(x, qw, bias).double() - expected).abs()
                        assert bool((err <= expected.abs() * 2.0 ** -8 + 1e-3).all()), (n, k, rows, amx)
    finally:
        lib.amx_set(before)


def test_w8a8_kernel_keeps_x_scale_when_not_asked(kernel_build: str) -> None:
    """linear_w8a8 with x_scale NULL (what quantized_linear passes) computes what it does with a buffer for
    them, and the buffer, where given, holds each row's scale."""
    lib = library.linear()
    if lib is None:
        pytest.skip("no kernel library on this machine")
    gen = torch.Generator().manual_seed(5)
    qw = quantize_weight(torch.randn(7, 96, generator=gen), "w8a8_int8")
    x = torch.randn(3, 96, generator=gen)
    outs = [torch.full((3, 7), float("nan")) for _ in range(2)]
    x_scale = torch.zeros(3)
    for out, scales in zip(outs, (x_scale.data_ptr(), None)):
        status = lib.linear_w8a8(x.data_ptr(), 3, 96, qw.qweight.data_ptr(), qw.scale.data_ptr(), None, 7,
                                 out.data_ptr(), 0, scales, 1)
        assert status == 0
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(x_scale, _int8_rows(x)[1][:, 0])


def test_quantized_linear_refuses_rows_of_another_width() -> None:
    qw = quantize_weight(torch.randn(4, 32), "w8a8_int8")
    with pytest.raises(ValueError, match="32 inputs"):
        quantized_linear(torch.randn(1, 64), qw, None)  # not two rows of 32


@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16"])
@pytest.mark.parametrize("n", [37, 38, 39, 40])
def test_float_kernels_every_channel_group(kernel_build: str, fmt: str, n: int) -> None:
    """The weights widened to float32 (weight-only int8, e4m3, bf16 for the LM head) against the float64
    product, for one row (channels in fours, n % 4 = 1, 2, 3, 0 left over) and for row tiles."""
    from engine.kernels.linear import WidenedBf16, linear_widened_bf16

    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, 203, generator=gen)
    bias = torch.randn(n, generator=gen)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 203, generator=gen)
        if fmt == "bf16":
            if library.linear() is None:
                pytest.skip("no kernel library on this machine")
            weight = w.to(torch.bfloat16)
            out = linear_widened_bf16(x, WidenedBf16(weight), bias)
            assert out is not None
            expected = x.double() @ weight.double().T + bias.double()
        else:
            qw = dataclasses.replace(quantize_weight(w, "w8a8_int8" if fmt == "int8" else "fp8"), int8_activations=False)
            out = quantized_linear(x, qw, bias)
            expected = _oracle(x, qw, bias)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        if fmt == "bf16":  # bf16 activations: the float32 sums rounded once
            xb = x.to(torch.bfloat16)
            outb = linear_widened_bf16(xb, WidenedBf16(weight), None)
            assert outb is not None and outb.dtype == torch.bfloat16
            expected = xb.double() @ weight.double().T
            assert bool(((outb.double() - expected).abs() <= expected.abs() * 2.0 ** -8 + 1e-4).all())


def test_lm_head_takes_the_widening_kernel_without_bf16_instructions() -> None:
    """On a CPU whose bf16 panels do not run (AVX2 only), prepacking gives a bf16 LM head the widening
    kernel; its logits are the float32 product rounded once to bf16."""
    from engine.kernels.linear import WidenedBf16, widened_bf16_usable
    from engine.layers.linear import ColumnParallelLinear, linear_forward, prepack_linear_weights
    from engine.layers.vocab_parallel_embedding import ParallelLMHead

    lib = library.linear()
    if lib is None or lib.linear_bf16_available():
        pytest.skip("the bf16 panels serve this CPU (or there is no kernel library)")
    gen = torch.Generator().manual_seed(5)
    head = ParallelLMHead(96, 64)
    head.weight.data = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    # A bf16 linear before it (a bf16 model), which oneDNN cannot pack on such a CPU: the head still gets its kernel.
    linear = ColumnParallelLinear(64, 32, bias=False)
    linear.weight.data = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    model = torch.nn.ModuleList([linear, head])
    prepack_linear_weights(model)
    assert widened_bf16_usable(head.weight)
    assert isinstance(head.packed_weight, WidenedBf16) and head.packed_weight.weight is not None
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    logits = linear_forward(x, head.weight, None, head.packed_weight)
    expected = x.double() @ head.weight.double().T
    assert logits.dtype == torch.bfloat16 and logits.shape == (3, 96)
    assert bool(((logits.double() - expected).abs() <= expected.abs() * 2.0 ** -8 + 1e-6).all())


def test_quantize_weight_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown quantization method"):
        quantize_weight(torch.randn(4, 4), "awq")
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.randn(4), "fp8")


# ------------------------------------------------------------------------------- whole models
def _next_token_logits(model_dir: str, quantization: str | None, prompts: list[list[int]], steps: int,
                       forced: list[list[int]] | None, quantize_lm_head: bool = False
                       ) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits of the prompts' next token (one extend of every prompt: the torch path) and of `steps`
    decode steps (8 rows: the kernel), fed the tokens in `forced` (the unquantized model's greedy
    choice) so both models are compared at the same contexts. Returns [(1 + steps) * len, vocab]."""
    from utils_models import BatchDriver, ExtendReq, make_runner

    runner = make_runner(model_dir, dtype="float32", quantization=quantization, quantize_lm_head=quantize_lm_head)
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in prompts]
    out, _ = driver.run(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, prompts)]))
    logits = [out.next_token_logits.float()]
    chosen = [[int(t)] for t in out.next_token_logits.argmax(-1)] if forced is None else forced
    lens = [len(p) for p in prompts]
    for step in range(steps):
        tokens = [c[step] for c in chosen]
        out, _ = driver.run(driver.decode_batch(rows, tokens, lens))
        lens = [n + 1 for n in lens]
        logits.append(out.next_token_logits.float())
        if forced is None:
            for c, t in zip(chosen, out.next_token_logits.argmax(-1).tolist()):
                c.append(int(t))
    return torch.cat(logits), chosen


def _compare(model_dir: str, vocab: int, method: str, quantize_lm_head: bool = False) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (12 + i,), generator=gen).tolist() for i in range(8)]
    reference, chosen = _next_token_logits(model_dir, None, prompts, 4, None)
    quantized, _ = _next_token_logits(model_dir, method, prompts, 4, chosen, quantize_lm_head)
    log_p, log_q = reference.log_softmax(-1), quantized.log_softmax(-1)
    kl = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
    top1 = float((reference.argmax(-1) == quantized.argmax(-1)).float().mean())
    print(f"\n{model_dir.rsplit('/', 1)[-1]} {method}{' + head' if quantize_lm_head else ''}: mean KL {kl:.2e}, "
          f"top-1 agreement {top1:.3f} over {reference.shape[0]} positions")
    return kl, top1


# Measured (Zen 1, float32 activations, 40 positions): the random Llama (weights 1.5 / sqrt(k), sharp
# logits that magnify any weight error) int8 KL 3.4e-3 / top-1 0.925 with int8 activations (1.8e-3 /
# 0.95 weight-only), fp8 KL 2.4e-2 / 0.75 (e4m3 keeps 3 mantissa bits: ~3% per weight); the built-in model
# int8 KL 2.7e-5 / 0.95 (weight-only 1.7e-5), fp8 2.6e-4 / 0.90 (its
# random prompts give near-ties, so top-1 moves while KL stays small). A wrong scale or a misread byte
# gives KL > 1.
BOUNDS = {("llama", "w8a8_int8"): (5e-3, 0.9), ("llama", "fp8"): (5e-2, 0.7),
          ("builtin", "w8a8_int8"): (2e-4, 0.9), ("builtin", "fp8"): (2e-3, 0.85)}


# --quantize-lm-head (the head quantized per vocabulary row as well). Measured (Zen 1, 40 positions, head
# quantized vs not): random Llama int8 KL 3.47e-3 / top-1 0.900 (3.40e-3 / 0.925), fp8 2.50e-2 / 0.700
# (2.45e-2 / 0.750); built-in model int8 3.22e-5 / 0.950 (2.73e-5 / 0.950), fp8 2.92e-4 / 0.875
# (2.55e-4 / 0.900).
HEAD_BOUNDS = {("llama", "w8a8_int8"): (5e-3, 0.85), ("llama", "fp8"): (5e-2, 0.65),
               ("builtin", "w8a8_int8"): (2e-4, 0.9), ("builtin", "fp8"): (2e-3, 0.8)}
HEAD = [False, pytest.param(True, id="head")]
HEAD_SLOW = [False, pytest.param(True, id="head", marks=pytest.mark.slow)]


@pytest.mark.parametrize("head", HEAD)
@pytest.mark.parametrize("method", METHODS)
def test_random_llama_next_token_distribution(tmp_path, method: str, head: bool) -> None:
    from utils_models import build_tiny_model

    build_tiny_model(str(tmp_path), "llama")
    kl, top1 = _compare(str(tmp_path), 512, method, head)
    bounds = (HEAD_BOUNDS if head else BOUNDS)["llama", method]
    assert kl < bounds[0] and top1 >= bounds[1]


@pytest.mark.parametrize("head", HEAD_SLOW)
@pytest.mark.parametrize("method", METHODS)
def test_builtin_model_next_token_distribution(method: str, head: bool) -> None:
    from engine.builtin_model import ensure_builtin_model
    from engine.configs.model_config import ModelConfig

    path = ensure_builtin_model()
    vocab = ModelConfig.from_pretrained(path, device="cpu").vocab_size
    kl, top1 = _compare(path, vocab, method, head)
    bounds = (HEAD_BOUNDS if head else BOUNDS)["builtin", method]
    assert kl < bounds[0] and top1 >= bounds[1]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_quantized_lm_head(kernel_build: str, tmp_path, method: str, tied: bool) -> None:
    """--quantize-lm-head: the head's rows quantized per row (scale max |row| / QMAX of each vocabulary row), its
    logits the product with the dequantized head (the linears' oracle) on the kernel's one-row path and the
    torch path; an untied head's float rows released, a tied embedding left float and intact."""
    from utils_models import build_tiny_model, make_runner

    build_tiny_model(str(tmp_path), "llama", tie_word_embeddings=tied)
    reference = make_runner(str(tmp_path), quantization=method).model
    float_head = reference.lm_head.weight.detach().clone()
    runner = make_runner(str(tmp_path), quantization=method, quantize_lm_head=True)
    model = runner.model
    qw = model.lm_head.packed_weight
    assert isinstance(qw, QuantizedWeight) and qw.method == method and (qw.n, qw.k) == (512, 64)
    expected = quantize_weight(float_head, method)
    assert torch.equal(qw.qweight.view(torch.uint8), expected.qweight.view(torch.uint8))
    assert torch.equal(qw.scale, expected.scale)
    embed = model.model.embed_tokens.weight
    assert embed.dtype == torch.float32 and torch.equal(embed, reference.model.embed_tokens.weight)
    assert model.lm_head.weight.numel() == (512 * 64 if tied else 0)
    hidden = torch.randn(300, 64, generator=torch.Generator().manual_seed(2))
    for rows in (hidden[:1], hidden[:16], hidden):  # the kernel's decode rows; 300 > 256 rows: torch's path
        got = model.logits_processor.compute_logits(rows, model.lm_head)
        torch.testing.assert_close(got, _oracle(rows, qw, None).float(), rtol=1e-5, atol=1e-4)
        assert not torch.allclose(got, rows @ float_head.T, rtol=1e-6, atol=1e-6)  # not the float head's


def test_quantized_lm_head_refused_where_it_does_not_apply(tmp_path) -> None:
    import json

    from utils_models import build_tiny_model, make_runner

    from engine.server_args import ServerArgs, ServerArgsError

    with pytest.raises(ServerArgsError, match="--quantize-lm-head quantizes the head with --quantization"):
        ServerArgs(quantize_lm_head=True, quantization="mxfp4", device="cpu")
    build_tiny_model(str(tmp_path), "llama")
    # No --quantization: only a 4-bit checkpoint's float head (test_prequantized.py); a float one is refused.
    with pytest.raises(ValueError, match="this checkpoint is float and --quantization is unset"):
        make_runner(str(tmp_path), quantize_lm_head=True)
    # fp8 also names the block-fp8 checkpoint format: refused there before any weight is read.
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="--quantize-lm-head quantizes a float head of a float or 4-bit checkpoint; "
                                         r"this checkpoint is pre-quantized \(fp8, block_fp8 weights\)"):
        make_runner(str(tmp_path), quantization="fp8", quantize_lm_head=True)


def test_quantized_model_holds_one_byte_weights(tmp_path) -> None:
    from utils_models import build_tiny_model, make_runner

    from engine.layers.linear import ColumnParallelLinear, RowParallelLinear

    build_tiny_model(str(tmp_path), "llama")
    runner = make_runner(str(tmp_path), quantization="w8a8_int8")
    linears = [m for m in runner.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down per layer
    for m in linears:
        assert isinstance(m.packed_weight, QuantizedWeight) and m.packed_weight.qweight.dtype == torch.int8
        assert m.weight.numel() == 0  # the float copy is released
    assert runner.model.lm_head.weight.dtype == torch.float32  # the LM head is not quantized


def test_prequantized_checkpoint_refused(tmp_path) -> None:
    import json

    from utils_models import build_tiny_model, make_runner

    build_tiny_model(str(tmp_path), "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    # Formats we load are tested in test_prequantized.py; others are refused before any weight is read.
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for flag in (None, "w8a8_int8"):
        with pytest.raises(ValueError, match="quant_method 'bitsandbytes', which is not supported"):
            make_runner(str(tmp_path), quantization=flag)


def test_server_args_refuse_lora_with_quantization() -> None:
    from engine.server_args import QUANTIZATION_METHODS, ServerArgs, ServerArgsError

    assert set(quant.ONLINE_METHODS) <= set(QUANTIZATION_METHODS)
    with pytest.raises(ServerArgsError, match="not supported yet with LoRA"):
        ServerArgs(quantization="fp8", enable_lora=True, device="cpu")


def test_weight_updates_refused_on_a_quantized_model(tmp_path) -> None:
    from utils_models import build_tiny_model, make_runner

    build_tiny_model(str(tmp_path), "llama")
    runner = make_runner(str(tmp_path), quantization="fp8")
    before = runner.model.model.layers[0].self_attn.qkv_proj.packed_weight.qweight.clone()
    ok, message = runner.weight_updater.update_from_tensors([("model.layers.0.self_attn.q_proj.weight",
                                                              torch.zeros(64, 64))])
    assert not ok and "not supported yet with --quantization" in message
    ok, message = runner.weight_updater.update_from_disk(str(tmp_path))
    assert not ok and "not supported yet with --quantization" in message
    assert torch.equal(runner.model.model.layers[0].self_attn.qkv_proj.packed_weight.qweight.view(torch.uint8),
                       before.view(torch.uint8))
    values, message = runner.weight_updater.full_weight("model.layers.0.self_attn.q_proj.weight", 4)
    assert values is None and "not supported yet with --quantization" in message


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_experts_are_quantized_and_equal_their_dequantized_product(tmp_path, arch: str, method: str,
                                                                      monkeypatch) -> None:
    """--quantization on a MoE model quantizes each expert's gate_up and down per output channel too (one
    byte a weight); the experts' forward equals the same model whose experts run the float product of the
    dequantized weights (the linears quantized in both), logits within float32 rounding (int8 weight-only:
    the exact int8 activations of w8a8 are checked against their own oracle above)."""
    from utils_models import BatchDriver, ExtendReq, build_tiny_model, make_runner

    from engine.layers.moe.layer import FusedMoE

    monkeypatch.setenv("ENGINE_W8A8_INT8_ACTIVATIONS", "0")
    build_tiny_model(str(tmp_path), arch, seed=3)
    prompts = [[3, 17, 250, 9, 44, 3], [100, 7, 7, 31, 480, 2, 65, 11]]

    def logits(runner) -> torch.Tensor:
        driver = BatchDriver(runner)
        rows = [driver.new_row() for _ in prompts]
        out, tokens = driver.run(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, prompts)]))
        steps = [out.next_token_logits.float()]
        lens = [len(p) for p in prompts]
        for _ in range(3):  # decode rows: the kernel's one-row and several-row paths
            out, tokens = driver.run(driver.decode_batch(rows, [int(t) for t in tokens], lens))
            lens = [n + 1 for n in lens]
            steps.append(out.next_token_logits.float())
        return torch.cat(steps)

    quantized = make_runner(str(tmp_path), dtype="float32", quantization=method)
    moe = [m for m in quantized.model.modules() if isinstance(m, FusedMoE)]
    assert moe
    for layer in moe:
        assert layer.packed_experts is not None and layer.w13.weight.numel() == 0  # the float stacks released
        for w in layer.packed_experts[0] + layer.packed_experts[1]:
            assert isinstance(w, QuantizedWeight) and w.qweight.element_size() == 1
    reference = make_runner(str(tmp_path), dtype="float32", quantization=method)
    for layer in (m for m in reference.model.modules() if isinstance(m, FusedMoE)):
        assert layer.packed_experts is not None
        gate_up, down = layer.packed_experts
        layer.packed_experts = None
        layer.w13.weight = torch.nn.Parameter(torch.stack([w.dequantize() for w in gate_up]), requires_grad=False)
        layer.w2.weight = torch.nn.Parameter(torch.stack([w.dequantize() for w in down]), requires_grad=False)
    got, want = logits(quantized), logits(reference)
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
