"""The embedding front end without processes: EmbeddingReqInput normalisation, the
EmbeddingNormalizer's checks (context length, vocabulary, Matryoshka dimensions, truncation),
results from BatchEmbeddingOutput, and /v1/embeddings and /encode over a fake TokenizerManager
that runs the real normalizer with a toy model."""

from __future__ import annotations

import asyncio
import base64
from typing import Any, List, Optional

import numpy as np
import pytest
from fastapi.testclient import TestClient

from engine.entrypoints.http_server import create_app
from engine.tokenizer.embedding_requests import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingModelInfo,
    EmbeddingNormalizer,
    EmbeddingReqInput,
    EmbeddingResult,
    apply_embedding_output,
    embedding_result,
)
from engine.errors import EngineRequestError
from engine.io_struct import BatchEmbeddingOutput
from engine.tokenizer.tokenizer_manager import ReqState
from engine.server_args import ServerArgs

CONTEXT = 16
VOCAB = 100


class WordTokenizer:
    """One token per word (its length), plus a leading 1 and a trailing 2 like [CLS]/[SEP]."""

    def __call__(self, texts: List[str], truncation: bool = False, max_length: Optional[int] = None) -> dict:
        out = []
        for text in texts:
            ids = [1] + [len(w) for w in text.split()] + [2]
            if truncation and len(ids) > max_length:
                ids = ids[: max_length - 1] + [2]  # special tokens survive truncation
            out.append(ids)
        return {"input_ids": out}


def model_info(matryoshka: bool = False, dims: Optional[List[int]] = None) -> EmbeddingModelInfo:
    return EmbeddingModelInfo(is_generation=False, max_input_len=CONTEXT, vocab_size=VOCAB, embedding_dim=8,
                              is_matryoshka=matryoshka, matryoshka_dimensions=dims, model_name="toy")


def toy_vector(ids: List[int], dimensions: Optional[int]) -> np.ndarray:
    vec = np.array([len(ids), sum(ids), 1, 2, 3, 4, 5, 6], dtype=np.float32)[: dimensions or 8]
    return vec / np.linalg.norm(vec)


class FakeEmbeddingTokenizerManager:
    """The TokenizerManager's embedding contract over the real EmbeddingNormalizer."""

    def __init__(self, matryoshka: bool = False) -> None:
        self.served_model_name = "toy-embed"
        self.model_path = "/models/toy"
        self.context_len = CONTEXT
        self.max_req_input_len = CONTEXT
        self.max_total_num_tokens = 1024
        self.is_generation = False
        self.normalizer = EmbeddingNormalizer(WordTokenizer(), model_info(matryoshka), allow_auto_truncate=False)

    async def encode_request(self, obj: EmbeddingReqInput, request: Any = None) -> List[EmbeddingResult]:
        reqs = self.normalizer.tokenize(obj)
        return [EmbeddingResult(rid=r.rid, embedding=toy_vector(r.input_ids, r.dimensions),
                                prompt_tokens=len(r.input_ids), cached_tokens=0,
                                finish_reason={"type": "length", "length": 0}, e2e_latency=0.0) for r in reqs]

    def is_alive(self) -> bool:
        return True


@pytest.fixture()
def client():
    with TestClient(create_app(FakeEmbeddingTokenizerManager(), ServerArgs(device="cpu"))) as c:
        yield c


# ---------------------------------------------------------------------------- normalisation
def test_request_shapes_normalise_to_one_entry_per_input():
    single = EmbeddingReqInput(text="hello world", rid="a")
    single.normalize()
    assert single.is_single and single.text == ["hello world"] and single.rid == ["a"]
    batch = EmbeddingReqInput(input_ids=[[1, 2], [3]], rid="b")
    batch.normalize()
    assert not batch.is_single and batch.batch_size == 2 and batch.rid == ["b_0", "b_1"]
    for bad, message in [(dict(text=""), "empty"), (dict(text=["x", ""]), "empty"), (dict(), "Exactly one"),
                         (dict(text=["x"] * (MAX_EMBEDDING_INPUTS + 1)), "At most"),
                         (dict(text="x", dimensions=True), "integer"), (dict(input_ids=[[1], []]), "input_ids")]:
        with pytest.raises(EngineRequestError, match=message):
            EmbeddingReqInput(**bad).normalize()


def test_normalizer_checks_length_vocabulary_and_dimensions():
    norm = EmbeddingNormalizer(WordTokenizer(), model_info(), allow_auto_truncate=False)
    reqs = norm.tokenize(EmbeddingReqInput(text=["a bb", "ccc"], dimensions=None))
    assert [r.input_ids for r in reqs] == [[1, 1, 2, 2], [1, 3, 2]]
    assert norm.tokenize(EmbeddingReqInput(input_ids=list(range(CONTEXT))))[0].input_ids == list(range(CONTEXT))
    with pytest.raises(EngineRequestError, match=r"\(17 tokens\) is longer than the model's context length \(16"):
        norm.tokenize(EmbeddingReqInput(input_ids=list(range(CONTEXT + 1))))
    with pytest.raises(EngineRequestError, match="out of range for the vocabulary of size 100"):
        norm.tokenize(EmbeddingReqInput(input_ids=[1, VOCAB]))
    with pytest.raises(EngineRequestError, match="does not support matryoshka representation"):
        norm.tokenize(EmbeddingReqInput(text="a", dimensions=4))
    matryoshka = EmbeddingNormalizer(WordTokenizer(), model_info(True, [2, 4]), allow_auto_truncate=False)
    assert matryoshka.tokenize(EmbeddingReqInput(text="a", dimensions=4))[0].dimensions == 4
    for dims, message in [(0, "greater than 0"), (3, r"only supports \[2, 4\]")]:
        with pytest.raises(EngineRequestError, match=message):
            matryoshka.tokenize(EmbeddingReqInput(text="a", dimensions=dims))
    unlisted = EmbeddingNormalizer(WordTokenizer(), model_info(True), allow_auto_truncate=False)
    with pytest.raises(EngineRequestError, match="greater than max embedding dimension: 8"):
        unlisted.tokenize(EmbeddingReqInput(text="a", dimensions=9))


def test_auto_truncate_cuts_to_the_context_keeping_the_end_token():
    norm = EmbeddingNormalizer(WordTokenizer(), model_info(), allow_auto_truncate=True)
    text, ids = norm.tokenize(EmbeddingReqInput(text=["w " * 40, "short"]))[:2]
    assert len(text.input_ids) == CONTEXT and text.input_ids[-1] == 2 and ids.input_ids == [1, 5, 2]
    assert norm.tokenize(EmbeddingReqInput(input_ids=list(range(40))))[0].input_ids == list(range(CONTEXT))


def test_results_come_from_batch_embedding_output():
    async def run():
        states = {rid: ReqState(rid=rid, stream=False, return_logprob=False, return_text_in_logprobs=False,
                                created_time=0.0) for rid in ("ok", "bad")}
        vec = np.array([0.6, 0.8], dtype="<f4")
        apply_embedding_output(states, BatchEmbeddingOutput(
            rids=["ok", "bad", "gone"],
            finished_reasons=[{"type": "length", "length": 0},
                              {"type": "abort", "message": "queue full", "status_code": 503}, None],
            embeddings=[vec.tobytes(), b"", b""], prompt_tokens=[3, 4, 5], cached_tokens=[1, 0, 0]))
        return states

    states = asyncio.run(run())
    assert all(s.finished and s.event.is_set() for s in states.values())
    result = embedding_result(states["ok"])
    assert result.embedding.tolist() == pytest.approx([0.6, 0.8]) and result.prompt_tokens == 3
    assert result.to_dict()["meta_info"]["cached_tokens"] == 1
    with pytest.raises(EngineRequestError) as err:
        embedding_result(states["bad"])
    assert (err.value.status_code, err.value.err_type, err.value.message) == (503, "ServiceUnavailableError",
                                                                             "queue full")


# ---------------------------------------------------------------------------- HTTP
def test_v1_embeddings_float_and_base64(client):
    texts = ["one two three", "x", "a bb ccc dddd"]
    body = client.post("/v1/embeddings", json={"input": texts, "model": "anything"}).json()
    assert body["object"] == "list" and body["model"] == "toy-embed"
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and all(d["object"] == "embedding" for d in body["data"])
    ids = WordTokenizer()(texts)["input_ids"]
    for d, tokens in zip(body["data"], ids):
        # JSON numbers are the shortest decimals of the float32 values: they read back exactly.
        assert np.array(d["embedding"], dtype=np.float32).tolist() == toy_vector(tokens, None).tolist()
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    b64 = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
    for d, tokens in zip(b64["data"], ids):
        assert np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist() == toy_vector(tokens, None).tolist()


def test_v1_embeddings_token_id_inputs(client):
    one = client.post("/v1/embeddings", json={"input": [5, 6, 7]}).json()
    many = client.post("/v1/embeddings", json={"input": [[5, 6, 7], [9]]}).json()
    assert len(one["data"]) == 1 and len(many["data"]) == 2
    assert one["data"][0]["embedding"] == many["data"][0]["embedding"]
    assert many["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("body,message", [
    ({"input": ""}, "empty string"),
    ({"input": []}, "empty list"),
    ({"input": [[1], []]}, "empty token-id list"),
    ({"input": [1, -2]}, "non-negative"),
    ({"input": {"text": "x"}}, "input"),
    ({"input": "x", "encoding_format": "binary"}, "encoding_format"),
    ({"input": "x", "dimensions": 4}, "does not support matryoshka"),
    ({"input": "w " * 20}, "longer than the model's context length"),
    ({"input": [1, 100]}, "out of range"),
    ({}, "input"),
])
def test_v1_embeddings_bad_input_is_a_400(client, body, message):
    resp = client.post("/v1/embeddings", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()
    assert err["object"] == "error" and err["code"] == 400 and message in err["message"]


def test_encode_native_shapes_and_errors(client):
    single = client.post("/encode", json={"text": "a bb", "rid": "r1"}).json()
    assert single["meta_info"]["id"] == "r1" and single["meta_info"]["prompt_tokens"] == 4
    assert len(single["embedding"]) == 8
    batch = client.post("/encode", json={"input_ids": [[1, 2], [3]], "sampling_params": {}}).json()
    assert isinstance(batch, list) and len(batch) == 2
    for body, message in [({"text": "x", "image_data": "http://x/y.png"}, "image_data is not supported"),
                          ({"text": "x", "temperature": 1}, "temperature"),
                          ({"text": "x", "input_ids": [1]}, "exactly one"),
                          ({"text": ""}, "empty")]:
        resp = client.post("/encode", json=body)
        assert resp.status_code == 400 and message in resp.json()["message"], resp.text


def test_matryoshka_dimensions_through_http():
    app = create_app(FakeEmbeddingTokenizerManager(matryoshka=True), ServerArgs(device="cpu"))
    with TestClient(app) as c:
        body = c.post("/v1/embeddings", json={"input": ["a", "bb cc"], "dimensions": 3}).json()
    assert [len(d["embedding"]) for d in body["data"]] == [3, 3]
    assert np.linalg.norm(np.array(body["data"][1]["embedding"])) == pytest.approx(1.0, abs=1e-6)
