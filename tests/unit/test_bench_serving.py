"""bench_serving: dataset generation, SSE parsing, token timing and the metric arithmetic."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def _load(name: str, file_name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH_DIR, file_name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ds = _load("serving_datasets", "serving_datasets.py")
bs = _load("bench_serving_under_test", "bench_serving.py")


# ---------------------------------------------------------------------------- datasets
def test_length_range_follows_sglang_rule():
    assert ds.length_range(512, 0.0625) == (32, 512)
    assert ds.length_range(256, 0.0) == (1, 256)
    assert ds.length_range(100, 1.0) == (100, 100)
    with pytest.raises(ValueError):
        ds.length_range(100, 1.5)


def test_random_dataset_lengths_ids_and_determinism():
    reqs = ds.sample_random_requests(200, 64, 32, 0.5, vocab_size=1000, seed=3)
    assert len(reqs) == 200
    assert all(32 <= r.prompt_len <= 64 and r.prompt_len == len(r.prompt_ids) for r in reqs)
    assert all(16 <= r.output_len <= 32 for r in reqs)
    assert all(10 <= t < 990 for r in reqs for t in r.prompt_ids)
    # Both ends of the ranges are reachable, so the range is the inclusive one SGLang uses.
    assert min(r.prompt_len for r in reqs) == 32 and max(r.prompt_len for r in reqs) == 64
    again = ds.sample_random_requests(200, 64, 32, 0.5, vocab_size=1000, seed=3)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in reqs]
    other = ds.sample_random_requests(200, 64, 32, 0.5, vocab_size=1000, seed=4)
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in reqs]


def test_random_dataset_matches_offline_benchmark_draws():
    """Same seed, same prompts and output lengths as bench_offline_throughput.random_workload."""
    n, vocab, seed = 64, 2560, 0
    rng = random.Random(seed)  # bench_offline_throughput's exact draw order, restated
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(32, 512))] for _ in range(n)]
    output_lens = [rng.randint(16, 256) for _ in range(n)]
    reqs = ds.sample_random_requests(n, 512, 256, 0.0625, vocab, seed)
    assert [r.prompt_ids for r in reqs] == prompts
    assert [r.output_len for r in reqs] == output_lens


def test_generated_shared_prefix_groups_share_system_prompt():
    reqs = ds.sample_generated_shared_prefix_requests(3, 4, system_prompt_len=50, question_len=7, output_len=9,
                                                      vocab_size=500, seed=1)
    assert len(reqs) == 12
    assert all(r.prompt_len == 57 and r.output_len == 9 for r in reqs)
    for g in range(3):
        group = reqs[4 * g:4 * g + 4]
        assert len({tuple(r.prompt_ids[:50]) for r in group}) == 1
        assert len({tuple(r.prompt_ids[50:]) for r in group}) == 4
    assert reqs[0].prompt_ids[:50] != reqs[4].prompt_ids[:50]


class _WordTokenizer:
    """Two tokens a word: enough to check that lengths come from the tokenizer."""

    def encode(self, text):
        return list(range(2 * len(text.split())))


def test_synthetic_sharegpt_is_text_with_a_long_tail_and_filtered():
    reqs = ds.sample_synthetic_sharegpt_requests(300, seed=0)
    again = ds.sample_synthetic_sharegpt_requests(300, seed=0)
    assert [r.prompt_text for r in reqs] == [r.prompt_text for r in again]
    assert all(r.prompt_ids is None and r.prompt_text for r in reqs)
    assert all(r.prompt_text.rstrip().endswith("?") for r in reqs)
    words = reqs[0].prompt_text.replace(".", " ").replace("?", " ").lower().split()
    assert all(w.isalpha() for w in words)
    lens = sorted(r.prompt_len for r in reqs)
    assert all(ds.SHAREGPT_MIN_LEN <= r.prompt_len <= ds.SHAREGPT_MAX_PROMPT_LEN for r in reqs)
    assert all(r.prompt_len + r.output_len <= ds.SHAREGPT_MAX_TOTAL_LEN and r.output_len >= 4 for r in reqs)
    median, p95 = lens[len(lens) // 2], lens[int(0.95 * len(lens))]
    assert p95 > 3 * median  # the long tail
    assert len({r.output_len for r in reqs}) > 100  # varied output lengths


def test_synthetic_sharegpt_counts_with_tokenizer_and_honours_limits():
    reqs = ds.sample_synthetic_sharegpt_requests(50, seed=2, tokenizer=_WordTokenizer(), fixed_output_len=100,
                                                 max_total_len=400)
    assert all(r.prompt_len == 2 * len(r.prompt_text.split()) for r in reqs)
    assert all(r.output_len == 100 and r.prompt_len <= 300 for r in reqs)


def test_poisson_intervals_mean_and_inf():
    assert list(ds.poisson_intervals(5, math.inf, 0)) == [0.0] * 5
    gaps = list(ds.poisson_intervals(20000, 4.0, 0))
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.01
    assert gaps == list(ds.poisson_intervals(20000, 4.0, 0))


# ---------------------------------------------------------------------------- stream parsing and timing
def test_split_sse_events_keeps_incomplete_rest():
    buf = b'data: {"a": 1}\n\ndata: [DONE]\n\ndata: {"b"'
    payloads, rest = bs.split_sse_events(buf)
    assert payloads == [b'{"a": 1}', b"[DONE]"]
    assert rest == b'data: {"b"'
    payloads, rest = bs.split_sse_events(rest + b': 2}\r\n\r\n: comment\n\n')
    assert payloads == [b'{"b": 2}'] and rest == b""


def test_token_timer_divides_multi_token_chunks_evenly():
    timer = bs.TokenTimer(start=10.0)
    timer.on_tokens(10.5, 1)   # first token: TTFT 0.5
    timer.on_tokens(10.6, 0)   # an empty chunk changes nothing
    timer.on_tokens(10.9, 4)   # 4 tokens over 0.4 s
    timer.on_tokens(11.0, 1)
    assert timer.ttft == pytest.approx(0.5)
    assert timer.itl == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])


def test_token_timer_first_chunk_with_several_tokens():
    timer = bs.TokenTimer(start=0.0)
    timer.on_tokens(0.2, 3)
    timer.on_tokens(0.5, 1)
    assert timer.ttft == pytest.approx(0.2)
    assert timer.itl == pytest.approx([0.0, 0.0, 0.3])  # one entry per token after the first


def test_payloads():
    req = ds.SampledRequest(prompt_len=3, output_len=7, prompt_ids=[11, 12, 13], prompt_text="a b c")
    p = bs.engine_payload(req, ignore_eos=True, use_text=False)
    assert p["input_ids"] == [11, 12, 13] and "text" not in p and p["stream"] is True
    assert p["sampling_params"] == {"max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}
    assert bs.engine_payload(req, ignore_eos=False, use_text=True)["text"] == "a b c"
    o = bs.openai_payload(req, "m", ignore_eos=True, use_text=False)
    assert o["prompt"] == [11, 12, 13] and o["max_tokens"] == 7 and o["model"] == "m"
    assert o["stream_options"] == {"include_usage": True}


# ---------------------------------------------------------------------------- metrics
def _out(prompt_len, output_len, ttft, latency, itl):
    return bs.RequestOutput(success=True, prompt_len=prompt_len, output_len=output_len, ttft=ttft,
                            latency=latency, itl=itl)


def test_calculate_metrics_sglang_definitions():
    outputs = [
        _out(100, 11, ttft=0.5, latency=1.5, itl=[0.1] * 10),   # TPOT (1.5 - 0.5) / 10 = 0.1
        _out(50, 5, ttft=0.2, latency=1.0, itl=[0.2] * 4),      # TPOT 0.8 / 4 = 0.2
        _out(30, 1, ttft=0.3, latency=0.3, itl=[]),             # one token: no TPOT
        bs.RequestOutput(success=False, prompt_len=999, error="boom"),
    ]
    m = bs.calculate_metrics(outputs, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (180, 17)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.input_throughput == pytest.approx(90.0)
    assert m.output_throughput == pytest.approx(8.5)
    assert m.total_throughput == pytest.approx(98.5)
    assert m.concurrency == pytest.approx((1.5 + 1.0 + 0.3) / 2.0)
    assert m.mean_ttft_ms == pytest.approx(1000 * (0.5 + 0.2 + 0.3) / 3)
    assert m.median_ttft_ms == pytest.approx(300.0)
    assert m.mean_tpot_ms == pytest.approx(150.0)
    assert m.mean_itl_ms == pytest.approx(1000 * (10 * 0.1 + 4 * 0.2) / 14)
    assert m.median_itl_ms == pytest.approx(100.0)
    assert m.max_itl_ms == pytest.approx(200.0)
    assert m.mean_e2e_latency_ms == pytest.approx(1000 * 2.8 / 3)
    assert m.p99_e2e_latency_ms == pytest.approx(1000 * (1.0 + 0.98 * 0.5))  # linear interpolation
    assert outputs[2].tpot is None


def test_metrics_of_all_failed_are_nan_and_json_safe():
    m = bs.calculate_metrics([bs.RequestOutput(error="x")], duration_s=1.0)
    assert m.completed == 0 and math.isnan(m.mean_ttft_ms)
    text = json.dumps(bs.json_safe({"m": bs.asdict(m), "rate": math.inf}), allow_nan=False)
    assert json.loads(text)["m"]["mean_ttft_ms"] is None


def test_result_table_has_sglang_layout():
    m = bs.calculate_metrics([_out(10, 3, 0.1, 0.3, [0.1, 0.1])], duration_s=1.0)
    table = bs.format_result_table(m, "engine", math.inf, None)
    lines = table.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert any(line.startswith("Output token throughput (tok/s):") and "3.00" in line for line in lines)
    assert any(line.startswith("Max request concurrency:") and "not set" in line for line in lines)
    for title in ("End-to-End Latency", "Time to First Token", "Inter-Token Latency"):
        assert any(title in line and line.startswith("-") for line in lines)


def test_parse_args_rejects_contradictions():
    with pytest.raises(SystemExit):
        bs.parse_args(["--launch-server", "--base-url", "http://x"])
    with pytest.raises(SystemExit):
        bs.parse_args(["--request-rate", "0"])
    args = bs.parse_args(["--dataset", "random", "--request-rate", "inf"])
    assert math.isinf(args.request_rate) and args.backend == "engine"
