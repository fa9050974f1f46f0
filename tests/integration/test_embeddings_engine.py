"""Engine.encode (offline, no HTTP) on a Matryoshka variant of the built-in model: a copy of its
directory whose config says `is_matryoshka`, served with is_embedding=True."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest

from engine import Engine
from engine.builtin_model import ensure_builtin_model
from engine.errors import EngineRequestError

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

TEXTS = ["first input", "a second, somewhat longer input with ünïcödé", "3"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("matryoshka") / "model"
    shutil.copytree(ensure_builtin_model(), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    with Engine(model_path=str(path), is_embedding=True, device="cpu", max_total_tokens=4096,
                log_level="warning", disable_radix_cache=True) as eng:
        yield eng


def test_encode_single_and_batch(engine):
    one = engine.encode(TEXTS[1], rid="one")
    assert one["meta_info"]["id"] == "one" and one["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(one["embedding"]) == 256 and np.linalg.norm(one["embedding"]) == pytest.approx(1.0, abs=1e-5)
    batch = engine.encode(TEXTS)
    assert isinstance(batch, list) and len(batch) == 3
    assert np.allclose(batch[1]["embedding"], one["embedding"], atol=1e-5)
    by_ids = engine.encode(input_ids=[[5, 6, 7]])
    assert by_ids[0]["meta_info"]["prompt_tokens"] == 3


def test_matryoshka_dimensions_are_truncated_then_renormalised(engine):
    full = np.array([o["embedding"] for o in engine.encode(TEXTS)])
    short = np.array([o["embedding"] for o in engine.encode(TEXTS, dimensions=64)])
    assert short.shape == (3, 64)
    want = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    assert np.allclose(short, want, atol=1e-5)
    with pytest.raises(EngineRequestError, match="greater than max embedding dimension: 256"):
        engine.encode("x", dimensions=257)


def test_async_encode_and_refusals(engine):
    async def run():
        return await asyncio.gather(*(engine.async_encode(t) for t in TEXTS))

    outs = asyncio.run(run())
    assert [len(o["embedding"]) for o in outs] == [256] * 3
    with pytest.raises(EngineRequestError, match="does not generate text"):
        engine.generate("hello", {"max_new_tokens": 2})
    with pytest.raises(EngineRequestError, match="context length"):
        engine.encode(input_ids=[1] * 2049)
    state = engine.get_internal_state()[0]
    assert state["available_tokens"] == state["max_total_num_tokens"]  # no radix cache: all free
