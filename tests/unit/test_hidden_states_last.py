"""return_hidden_states "last" (SGLang's mode): only the last position's hidden state, on a real tiny
model in-process. Oracle: transformers' `output_hidden_states` on the same weights; the last vector
is the one of the last position the model ran (the prompt's last token after prefill, then each
token fed by a decode step), and the prompt's cached prefix is reused (full mode recomputes it)."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

from engine.entrypoints.openai.utils import last_hidden_state
from engine.io_struct import BatchStrOutput
from engine.tokenizer.output_assembly import OutputAssembler, ReqState, build_output
from engine.tokenizer.request_normalizer import GenerateReqInput
from engine.errors import EngineRequestError
from sched_utils import Harness
from utils_models import build_tiny_model

PROMPT = [3, 17, 250, 9, 44, 7, 7, 120, 5, 61, 33, 8, 90]
N_NEW = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Dict[str, Any]:
    path = str(tmp_path_factory.mktemp("last"))
    return {"path": path, "hf": build_tiny_model(path, "llama", seed=3)}


def harness(path: str, **kwargs: Any) -> Harness:
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=8)
    return Harness(worker=TpModelWorker(args), model_path=path, max_total_tokens=2048, **kwargs)


@torch.no_grad()
def hf_last_layer(hf: Any, ids: Any) -> torch.Tensor:
    return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


@pytest.mark.parametrize("config", [{}, dict(chunked_prefill_size=4), dict(overlap=True)])
def test_last_mode_sends_the_last_positions_vector_only(model: Dict[str, Any], config: Dict[str, Any]) -> None:
    h = harness(model["path"], **config)
    h.submit(PROMPT, max_new_tokens=2)
    h.run_until_idle()  # the prompt is now cached
    rid = h.submit(PROMPT, max_new_tokens=N_NEW, return_hidden_states="last")
    h.run_until_idle()
    out = h.outputs[rid]
    assert out.cached_tokens > 0  # unlike "full", "last" needs no prompt position recomputed
    ref = hf_last_layer(model["hf"], PROMPT + out.output_ids[:-1])
    # Each emission carries one vector, the newest: the prompt's last position, then one per decode step.
    assert all(torch.tensor(v).shape == (64,) for v in out.hidden_states)
    torch.testing.assert_close(torch.tensor(out.hidden_states[-1]), ref[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(out.hidden_states), ref[len(PROMPT) - 1:][-len(out.hidden_states):],
                               rtol=1e-4, atol=1e-4)


def test_the_tokenizer_side_keeps_one_vector_and_the_chat_choice_returns_it() -> None:
    state = ReqState(rid="r", stream=True, return_logprob=False, return_text_in_logprobs=False, created_time=0.0,
                     return_hidden_states=True, hidden_states_last=True)
    assembler = OutputAssembler(tokenizer=None)
    for step, vector in enumerate(([1.0, 2.0], [3.0, 4.0])):
        batch = BatchStrOutput(rids=["r"], finished_reasons=[None], output_strs=["x"], output_ids=[[step]],
                               prompt_tokens=[3], completion_tokens=[step + 1], cached_tokens=[0],
                               output_hidden_states=[[vector]])
        assembler.apply(state, batch, 0)
    meta = build_output(state)["meta_info"]
    assert meta["hidden_states"] == [[3.0, 4.0]]
    assert last_hidden_state(meta) == [3.0, 4.0]
    # "full" keeps the prompt's block first, and a one-token answer has no generated position.
    assert last_hidden_state({"hidden_states": [[[1.0], [2.0]]]}) == []
    assert last_hidden_state({"hidden_states": [[[1.0], [2.0]], [3.0]]}) == [3.0]


@pytest.mark.parametrize("value, ok", [("last", True), ([True, "last"], True), (["last", False, None], False),
                                       ("first", False), (1, False)])
def test_generate_accepts_true_false_and_last(value: Any, ok: bool) -> None:
    obj = GenerateReqInput(text=["a", "b"], return_hidden_states=value)
    if not ok:
        with pytest.raises(EngineRequestError, match="return_hidden_states"):
            obj.normalize()
        return
    obj.normalize()
    expected = value if isinstance(value, list) else [value, value]
    assert [sub.options.return_hidden_states for sub in obj.subs] == expected
