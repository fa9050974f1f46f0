"""The control plane and the per-request extras through the offline Engine (built-in model, CPU).

Oracle: the engine's own greedy outputs before a change that must not alter them (release and
resume, pause and continue, an update back to the same weights), the checkpoint's tensors, and a
logit processor whose effect is known exactly.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from engine import Engine
from engine.builtin_model import ensure_builtin_model
from engine.errors import EngineRequestError
from engine.sampling.custom_logit_processor import CustomLogitProcessor

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

ENGINE_ARGS = dict(device="cpu", max_total_tokens=8192, log_level="warning", strict_memory_check=True,
                   enable_custom_logit_processor=True, allow_auto_truncate=True)
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4"]


@pytest.fixture(scope="module")
def engine():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GLOO_SOCKET_IFNAME", "lo")  # a weight update group's pairs listen on loopback only
        with Engine(**ENGINE_ARGS) as eng:
            yield eng


@pytest.fixture(scope="module")
def weights():
    from safetensors.torch import load_file

    return load_file(os.path.join(ensure_builtin_model(), "model.safetensors"))


def outputs(engine, prompts=PROMPTS):
    return [o["output_ids"] for o in engine.generate(list(prompts), GREEDY)]


def test_update_weights_from_tensor_round_trip(engine, weights):
    before = outputs(engine)
    name = "model.layers.2.mlp.down_proj.weight"
    assert torch.equal(torch.tensor(engine.get_weights_by_name(name, 4)), weights[name][:4])
    changed = [(n, t * 1.5) for n, t in weights.items() if t.dim() == 2]
    success, message = engine.update_weights_from_tensor(changed, weight_version="v2")
    assert success, message
    assert torch.equal(torch.tensor(engine.get_weights_by_name(name, 4)), weights[name][:4] * 1.5)
    assert outputs(engine) != before
    assert engine.get_model_info()["weight_version"] == "v2"
    success, message = engine.update_weights_from_tensor(list(weights.items()))
    assert success, message
    assert outputs(engine) == before
    success, message = engine.update_weights_from_tensor([("model.layers.0.nope", torch.zeros(1))])
    assert not success and "no parameter" in message
    with pytest.raises(EngineRequestError, match="no weight"):
        engine.get_weights_by_name("model.nope")


@pytest.mark.slow
def test_update_weights_from_distributed_through_the_engine(engine, weights, tmp_path):
    """A trainer process broadcasts new matrices; the outputs equal those of the same weights set
    through update_weights_from_tensor. SGLang's Engine signature, torch dtypes included."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    from engine.utils.network_utils import get_free_port
    from utils_trainer import GROUP, trainer_env, trainer_metadata

    changed = {n: t * 1.5 for n, t in weights.items() if t.dim() == 2}
    assert engine.update_weights_from_tensor(list(changed.items()))[0]
    expected = outputs(engine)
    assert engine.update_weights_from_tensor(list(weights.items()))[0]
    save_file(changed, str(tmp_path / "pushed.safetensors"))
    port = get_free_port()
    trainer = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "..", "utils_trainer.py"), "--port", str(port),
         "--world-size", "2", "--weights", str(tmp_path / "pushed.safetensors")],
        env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        success, message = engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, backend="gloo")
        assert success, message
        meta = trainer_metadata(changed)
        success, message = engine.update_weights_from_distributed(
            meta["names"], [getattr(torch, d) for d in meta["dtypes"]], meta["shapes"], group_name=GROUP,
            weight_version="pushed")
        assert success, message
        _, err = trainer.communicate(timeout=120)
        assert trainer.returncode == 0, err
        assert outputs(engine) == expected
        assert engine.get_weight_version() == "pushed"
        assert engine.destroy_weights_update_group(GROUP) == (True, "Succeeded to destroy custom process group.")
    finally:
        trainer.kill()
        trainer.communicate()
        assert engine.update_weights_from_tensor(list(weights.items()), weight_version="default")[0]


def test_release_resume_and_pause_continue(engine):
    before = outputs(engine)
    engine.release_memory_occupation(["kv_cache"])
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert outputs(engine) == before
    with pytest.raises(EngineRequestError, match="Unknown memory tag"):
        engine.resume_memory_occupation(["everything"])

    for mode in ("retract", "in_place", "abort"):
        engine.pause_generation(mode)
        results = {}
        # Sent while paused: they wait, then run as if nothing happened.
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, engine.generate(PROMPTS[i], GREEDY)))
                   for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        engine.continue_generation()
        for t in threads:
            t.join(timeout=120)
        assert [results[i]["output_ids"] for i in range(len(PROMPTS))] == before, mode
    with pytest.raises(EngineRequestError, match="mode must be one of"):
        engine.pause_generation("nap")


FORCE_TOKEN_SOURCE = """
def __call__(self, logits, custom_param_list=None):
    for row, params in enumerate(custom_param_list):
        keep = logits[row, params["token_id"]].clone()
        logits[row] = float("-inf")
        logits[row, params["token_id"]] = keep
    return logits
"""


def _force_token_processor() -> str:
    """A processor serialized by value: dill pickles a class of module '__main__' with its code,
    so the scheduler process loads it without importing this test module (whose globals, like
    pytest's captured streams, must stay out of the pickle)."""
    scope = {"__name__": "__main__"}
    exec(FORCE_TOKEN_SOURCE, scope)
    cls = type("ForceToken", (CustomLogitProcessor,), {"__call__": scope["__call__"], "__module__": "__main__"})
    return cls.to_str()


def test_custom_logit_processor_and_extras_through_the_engine(engine):
    forced = engine.generate(PROMPTS[0], {**GREEDY, "custom_params": {"token_id": 42}},
                             custom_logit_processor=_force_token_processor())
    assert forced["output_ids"] == [42] * GREEDY["max_new_tokens"]
    out = engine.generate(PROMPTS[1], GREEDY, priority=1, cache_salt="x", return_hidden_states=True)
    assert len(out["meta_info"]["hidden_states"]) == GREEDY["max_new_tokens"]
    with pytest.raises(TypeError, match="unexpected keyword"):
        engine.generate(PROMPTS[0], GREEDY, session_params={"id": "s"})
    with pytest.raises(EngineRequestError, match="LoRA is not enabled"):  # an option, refused without --enable-lora
        engine.generate(PROMPTS[0], GREEDY, lora_path="adapter")


def test_auto_truncate_keeps_the_first_tokens(engine):
    limit = engine.tokenizer_manager.max_req_input_len
    ids = [(7 * i) % 2000 + 10 for i in range(limit + 50)]
    long = engine.generate(input_ids=ids, sampling_params=GREEDY)
    exact = engine.generate(input_ids=ids[:limit], sampling_params=GREEDY)
    assert long["meta_info"]["prompt_tokens"] == limit
    assert long["output_ids"] == exact["output_ids"]
