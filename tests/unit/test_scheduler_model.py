"""The scheduler on the real built-in model: greedy outputs equal transformers' under every
scheduling configuration, cached tokens, and logprobs equal to transformers' log-softmax."""

from __future__ import annotations

import pytest
import torch

from sched_utils import Harness

N_NEW = 12


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.builtin_model import ensure_builtin_model

    path = ensure_builtin_model()
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    texts = ["Hello world, this is a test of the engine.", "The quick brown fox", "日本語のテキストと絵文字 🎉",
             "def f(x):\n    return x * 2", "Bonjour à tous", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]
    prompts = [tok(t).input_ids for t in texts]
    prompts.append(prompts[0] + prompts[3][1:])  # shares a prefix with prompt 0
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
            expected.append(out[0, len(p):].tolist())
    return path, tok, hf, prompts, expected


def run(model, **kwargs):
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    path, tok, _, prompts, _ = model
    total = kwargs.pop("max_total_tokens", 4096)
    page = kwargs.get("page_size", 1)
    overlap = kwargs.pop("overlap", False)
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=total, page_size=page, max_running_requests=16)
    h = Harness(worker=TpModelWorker(args), tokenizer=tok, max_total_tokens=total, overlap=overlap, **kwargs)
    rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in prompts]
    h.run_until_idle()
    return h, [h.outputs[r].output_ids for r in rids]


CONFIGS = {
    "default": {},
    "no-radix": dict(disable_radix_cache=True),
    "page16": dict(page_size=16),
    "small-chunk": dict(chunked_prefill_size=8),
    "page16-chunk16": dict(page_size=16, chunked_prefill_size=16),
    "retract": dict(max_total_tokens=96),
    "mixed-overlap": dict(chunked_prefill_size=8, enable_mixed_chunk=True, overlap=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_transformers_under_every_config(model, name):
    h, outputs = run(model, **dict(CONFIGS[name]))
    assert outputs == model[4]


def test_small_pool_really_retracts(model, caplog):
    with caplog.at_level("WARNING"):
        run(model, max_total_tokens=96)
    assert "Retract requests" in caplog.text


def test_repeated_prompt_reports_cached_tokens(model):
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    path, tok, _, prompts, expected = model
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=2048)
    h = Harness(worker=TpModelWorker(args), tokenizer=tok)
    a = h.submit(prompts[0], max_new_tokens=4)
    h.run_until_idle()
    b = h.submit(prompts[0], max_new_tokens=4)
    h.run_until_idle()
    assert h.outputs[a].cached_tokens == 0
    assert h.outputs[b].cached_tokens == len(prompts[0]) - 1
    assert h.outputs[a].output_ids == h.outputs[b].output_ids


def test_logprobs_equal_transformers(model):
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    path, tok, hf, prompts, _ = model
    prompt = prompts[0]
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=2048)
    h = Harness(worker=TpModelWorker(args), tokenizer=tok, chunked_prefill_size=4)
    h.submit(prompt, rid="lp", max_new_tokens=5, return_logprob=True, logprob_start_len=2, top_logprobs_num=3)
    msgs = []
    orig = h.scheduler.send_output
    h.scheduler.send_output = lambda m: (msgs.append(m), orig(m))
    h.run_until_idle()
    out_ids = h.outputs["lp"].output_ids
    full = torch.tensor([prompt + out_ids])
    with torch.inference_mode():
        logp = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
    in_val, out_val, out_top = [], [], []
    for m in msgs:
        if getattr(m, "rids", None) == ["lp"]:
            if m.input_token_logprobs_val[0] is not None:
                in_val = m.input_token_logprobs_val[0]
                in_idx = m.input_token_logprobs_idx[0]
            out_val += m.output_token_logprobs_val[0]
            out_top += m.output_top_logprobs_idx[0]
    # Input: entry k is the logprob of prompt[2 + k]; the first is None.
    assert in_idx == prompt[2:] and in_val[0] is None
    want_in = [logp[p - 1, prompt[p]].item() for p in range(3, len(prompt))]
    assert in_val[1:] == pytest.approx(want_in, abs=1e-4)
    # Output: the chosen token's logprob, and the top-3 ids of each step.
    n = len(prompt)
    want_out = [logp[n - 1 + k, out_ids[k]].item() for k in range(len(out_ids))]
    assert out_val == pytest.approx(want_out, abs=1e-4)
    assert out_top == [logp[n - 1 + k].topk(3).indices.tolist() for k in range(len(out_ids))]


@pytest.mark.parametrize("overlap", [False, True])
def test_shared_prefix_cascade_decode_equals_transformers(model, monkeypatch, overlap):
    """Requests decoding over a long radix-shared prefix take the cascade decode path (prefix read
    once per group) and still give transformers' greedy tokens."""
    import engine.layers.attention.torch_native_backend as backend_mod
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    path, tok, hf, prompts, _ = model
    system = sum((p[1:] for p in prompts[:6]), prompts[0][:1])
    assert len(system) > backend_mod.MIN_SHARED_PREFIX
    questions = [system + tok(q).input_ids[1:] for q in ["What is it?", "Who", "Tell me more about the fox"]]
    expected = []
    with torch.inference_mode():
        for p in questions:
            out = hf.generate(torch.tensor([p]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
            expected.append(out[0, len(p):].tolist())

    groups = []
    real = backend_mod._shared_prefixes
    monkeypatch.setattr(backend_mod, "_shared_prefixes", lambda *a: groups.append(real(*a)) or groups[-1])
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=4096, max_running_requests=16)
    h = Harness(worker=TpModelWorker(args), tokenizer=tok, max_total_tokens=4096, overlap=overlap)
    first = h.submit(questions[0], stream=True, max_new_tokens=N_NEW, ignore_eos=True)
    while not h.outputs.get(first) or not h.outputs[first].output_ids:
        h.step()  # the first prompt is in the radix tree before the others arrive
    rids = [first] + [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in questions[1:]]
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in rids] == expected
    assert any(g and g[0].members.numel() == 3 for g in groups)
