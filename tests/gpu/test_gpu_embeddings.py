"""Embedding models on CUDA: a tiny random BERT encoder (non-causal triton extend) and a tiny
Llama served with --is-embedding (last-token pooling), float32, against transformers on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from utils_models import BatchDriver, ExtendReq, build_tiny_bert, build_tiny_model, hf_hidden_states

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def cuda_runner(path: str, **args):
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.model_runner import ModelRunner
    from engine.server_args import ServerArgs

    server_args = ServerArgs(model_path=path, dtype="float32", device="cuda", attention_backend="triton",
                             max_total_tokens=8192, max_running_requests=16, **args)
    config = ModelConfig.from_pretrained(path, dtype="float32", device="cuda", is_embedding=server_args.is_embedding)
    return ModelRunner(config, server_args)


def embed(runner, prompts):
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in prompts]
    out = runner.forward_embedding(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, prompts)]))
    return out.embeddings.cpu()


def prompts():
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 17, 64, 100, 33)]


def test_bert_encoder_on_cuda_matches_transformers(tmp_path):
    hf = build_tiny_bert(str(tmp_path), pooling_mode="mean")
    got = embed(cuda_runner(str(tmp_path)), prompts())
    want = torch.stack([F.normalize(hf_hidden_states(hf, p).mean(0), dim=-1) for p in prompts()])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_decoder_last_token_embedding_on_cuda_matches_transformers(tmp_path):
    hf = build_tiny_model(str(tmp_path), "llama")
    got = embed(cuda_runner(str(tmp_path), is_embedding=True), prompts())
    want = torch.stack([F.normalize(hf_hidden_states(hf, p)[-1], dim=-1) for p in prompts()])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
