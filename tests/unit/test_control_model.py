"""The control plane and the per-request extras on a real model, in-process.

Oracle: transformers (float32) on the same tiny random checkpoints: greedy tokens after a weight
update equal transformers' on the new checkpoint, returned hidden states equal its
`output_hidden_states`, token_ids_logprob values equal its log-softmax at those ids.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import pytest
import torch

from engine.tokenizer.control_calls import serialize_named_tensors
from engine.io_struct import (
    DestroyWeightsUpdateGroupReqInput,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from engine.sampling.custom_logit_processor import CustomLogitProcessor
from sched_utils import Harness
from utils_models import build_tiny_model, hf_greedy
from utils_trainer import GROUP, trainer_env, trainer_metadata

PROMPTS = [[3, 17, 250, 9, 44, 7, 7, 120, 5, 61, 33], [100, 7, 31], [401, 2]]
N_NEW = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Dict[str, Any]:
    paths, hf = {}, {}
    for name, seed, overrides in (("a", 0, {}), ("b", 1, {}), ("wide", 2, dict(hidden_size=96))):
        path = str(tmp_path_factory.mktemp(name))
        hf[name] = build_tiny_model(path, "llama", seed=seed, **overrides)
        paths[name] = path
    return {"paths": paths, "hf": hf}


def harness(path: str, **kwargs) -> Harness:
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=8)
    return Harness(worker=TpModelWorker(args), model_path=path, max_total_tokens=2048, **kwargs)


def generate(h: Harness, prompts: List[List[int]] = PROMPTS, **fields) -> List[List[int]]:
    rids = [h.submit(p, max_new_tokens=N_NEW, **fields) for p in prompts]
    h.run_until_idle()
    return [h.outputs[r].output_ids for r in rids]


def expected(hf: Any, prompts: List[List[int]] = PROMPTS) -> List[List[int]]:
    return [hf_greedy(hf, p, N_NEW) for p in prompts]


@torch.no_grad()
def hf_forward(hf: Any, ids: List[int]):
    return hf(torch.tensor([ids]), output_hidden_states=True)


# ---------------------------------------------------------------------- weights
def test_update_weights_from_disk_gives_the_new_checkpoints_outputs(models):
    h = harness(models["paths"]["a"])
    assert generate(h) == expected(models["hf"]["a"])
    assert h.scheduler.tree_cache.evictable_size() > 0
    reply = h.control(UpdateWeightFromDiskReqInput(model_path=models["paths"]["b"]))
    assert reply.success, reply.message
    assert h.scheduler.tree_cache.evictable_size() == 0  # flushed: the old KV is stale
    assert generate(h) == expected(models["hf"]["b"])


@pytest.mark.parametrize("target, message", [("wide", "not the running model's architecture"),
                                             ("missing", "Failed to read the model config")])
def test_a_bad_checkpoint_is_refused_and_changes_nothing(models, target, message):
    h = harness(models["paths"]["a"])
    path = models["paths"].get(target, "/nonexistent/checkpoint")
    reply = h.control(UpdateWeightFromDiskReqInput(model_path=path))
    assert not reply.success and message in reply.message
    assert generate(h) == expected(models["hf"]["a"])


def test_a_checkpoint_failing_midway_is_rolled_back(models, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(models["paths"]["b"]):
        data = open(os.path.join(models["paths"]["b"], name), "rb").read()
        (broken / name).write_bytes(data)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.norm.weight"]  # the loader notices only after loading the others
    save_file(weights, str(broken / "model.safetensors"))
    h = harness(models["paths"]["a"])
    reply = h.control(UpdateWeightFromDiskReqInput(model_path=str(broken)))
    assert not reply.success and "Rolled back" in reply.message
    assert generate(h) == expected(models["hf"]["a"])


def test_update_weights_from_tensor_and_get_weights_by_name(models):
    from safetensors.torch import load_file

    h = harness(models["paths"]["a"])
    new = load_file(os.path.join(models["paths"]["b"], "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    before = h.control(GetWeightsByNameReqInput(name=name, truncate_size=3)).parameter
    assert torch.tensor(before).shape == (3, 64)
    payload = serialize_named_tensors(sorted(new.items()))
    assert h.control(UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload])).success
    after = h.control(GetWeightsByNameReqInput(name=name, truncate_size=3)).parameter
    torch.testing.assert_close(torch.tensor(after), new[name][:3], rtol=0, atol=0)
    assert generate(h) == expected(models["hf"]["b"])
    # One weight only: the rest stays.
    one = serialize_named_tensors([("model.norm.weight", torch.full((64,), 2.0))])
    assert h.control(UpdateWeightsFromTensorReqInput(serialized_named_tensors=[one])).success
    assert h.control(GetWeightsByNameReqInput(name="model.norm.weight", truncate_size=2)).parameter == [2.0, 2.0]


@pytest.mark.parametrize("named, message", [
    ([("model.layers.0.mlp.nope.weight", torch.zeros(2))], "no parameter of the model takes"),
    ([("model.norm.weight", torch.zeros(3))], "The weights are unchanged"),
])
def test_a_bad_tensor_update_changes_nothing(models, named, message):
    h = harness(models["paths"]["a"])
    reply = h.control(UpdateWeightsFromTensorReqInput(serialized_named_tensors=[serialize_named_tensors(named)]))
    assert not reply.success and message in reply.message
    assert generate(h) == expected(models["hf"]["a"])


def test_get_weights_by_name_of_unknown_weight(models):
    h = harness(models["paths"]["a"])
    reply = h.control(GetWeightsByNameReqInput(name="model.layers.9.nothing"))
    assert reply.parameter is None and "no weight" in reply.message


# ---------------------------------------------------------------------- SGLang's weight payloads
def _forking_pickle(obj: Any) -> bytes:
    """SGLang's MultiprocessingSerializer.serialize: CPU tensors travel as shared-memory file names
    (torch's "file_system" strategy: an unrelated process can open them)."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    strategy = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        return buf.getvalue()
    finally:
        mp.set_sharing_strategy(strategy)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this must not run",))


def test_pickled_tensors_need_the_flag_and_load_with_it(models):
    from safetensors.torch import load_file

    new = load_file(os.path.join(models["paths"]["b"], "model.safetensors"))
    payload = _forking_pickle(sorted(new.items()))
    plain = harness(models["paths"]["a"])
    reply = plain.control(UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload]))
    assert not reply.success and "--enable-pickled-weight-updates" in reply.message
    assert generate(plain) == expected(models["hf"]["a"])

    trusting = harness(models["paths"]["a"], enable_pickled_weight_updates=True)
    evil = _forking_pickle([("model.norm.weight", _RunsCode())])
    reply = trusting.control(UpdateWeightsFromTensorReqInput(serialized_named_tensors=[evil]))
    assert not reply.success and "posix.system" in reply.message
    assert trusting.control(UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload])).success
    assert generate(trusting) == expected(models["hf"]["b"])


def test_a_flattened_bucket_loads_like_its_tensors(models, monkeypatch):
    """SGLang's load_format "flattened_bucket": one flat tensor and each tensor's place in it,
    pickled with SGLang's own metadata class (stood in for by a module of that name)."""
    import dataclasses
    import sys
    import types

    from safetensors.torch import load_file

    sglang_module = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = sglang_module.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    sglang_module.FlattenedTensorMetadata = FlattenedTensorMetadata  # type: ignore[attr-defined]
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, sglang_module.__name__, sglang_module)
    new = load_file(os.path.join(models["paths"]["b"], "model.safetensors"))
    flat, metadata, start = [], [], 0
    for name, tensor in sorted(new.items()):
        flat.append(tensor.flatten().view(torch.uint8))  # newer SGLang flattens raw bytes
        end = start + flat[-1].numel()
        metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, start, end, tensor.numel()))
        start = end
    payload = _forking_pickle({"flattened_tensor": torch.cat(flat), "metadata": metadata})
    h = harness(models["paths"]["a"], enable_pickled_weight_updates=True)
    reply = h.control(UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload],
                                                      load_format="flattened_bucket"))
    assert reply.success, reply.message
    assert generate(h) == expected(models["hf"]["b"])


def test_one_payload_per_rank_or_one_for_all(models):
    h = harness(models["paths"]["a"])
    one = serialize_named_tensors([("model.norm.weight", torch.full((64,), 2.0))])
    reply = h.control(UpdateWeightsFromTensorReqInput(serialized_named_tensors=[one, one]))
    assert not reply.success and "one per tensor-parallel rank (1)" in reply.message
    assert generate(h) == expected(models["hf"]["a"])


# ---------------------------------------------------------------------- weight update groups
def _save(weights: Dict[str, torch.Tensor], path: str) -> str:
    from safetensors.torch import save_file

    save_file(weights, path)
    return path


@pytest.mark.slow
def test_update_weights_from_distributed_gives_the_pushed_weights_outputs(models, tmp_path, monkeypatch):
    """A trainer process (rank 0) broadcasts checkpoint b to this rank (1) in two buckets, after
    two bad ones that must change nothing; the greedy outputs become transformers' on b."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from engine.utils.network_utils import get_free_port

    new = load_file(os.path.join(models["paths"]["b"], "model.safetensors"))
    names = sorted(new)
    rounds = [
        {"model.layers.0.mlp.nope.weight": torch.zeros(3)},  # no such weight
        {"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 64)},  # the wrong shape
        {n: new[n] for n in names[: len(names) // 2]},
        {n: new[n] for n in names[len(names) // 2:]},
    ]
    files = [_save(r, str(tmp_path / f"round{i}.safetensors")) for i, r in enumerate(rounds)]
    port = get_free_port()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # this rank's gloo pairs stay on loopback too
    trainer = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "..", "utils_trainer.py"),
                                "--port", str(port), "--world-size", "2", "--weights", *files],
                               env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    h = harness(models["paths"]["a"])
    try:
        reply = h.control(InitWeightsUpdateGroupReqInput(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                                         world_size=2, group_name=GROUP, backend="gloo"))
        assert reply.success, reply.message
        replies = [h.control(UpdateWeightsFromDistributedReqInput(**trainer_metadata(r), group_name=GROUP))
                   for r in rounds]
        out, err = trainer.communicate(timeout=120)
        assert trainer.returncode == 0, err
        assert not replies[0].success and "no parameter of the model takes" in replies[0].message
        assert not replies[1].success and "unchanged" in replies[1].message
        assert replies[2].success and replies[3].success, [r.message for r in replies]
        assert generate(h) == expected(models["hf"]["b"])
        assert h.control(DestroyWeightsUpdateGroupReqInput(group_name=GROUP)).success
        again = h.control(DestroyWeightsUpdateGroupReqInput(group_name=GROUP))
        assert not again.success and "does not exist" in again.message
    finally:
        trainer.kill()
        trainer.communicate()
        h.worker.update_groups.destroy_all()


@pytest.mark.parametrize("fields, message", [
    (dict(group_name="nobody"), "is not initialized"),
    (dict(dtypes=["float32", "float32"]), "must have the same length"),
    (dict(dtypes=["complex32"]), "Unknown dtype"),
    (dict(shapes=[[-1]]), "is not a tensor shape"),
])
def test_an_update_that_cannot_be_received_is_refused_at_once(models, fields, message):
    h = harness(models["paths"]["a"])
    h.worker.update_groups.groups[GROUP] = (None, "gloo")  # a joined group, as far as the checks go
    try:
        body = dict(names=["model.norm.weight"], dtypes=["float32"], shapes=[[64]], group_name=GROUP)
        reply = h.control(UpdateWeightsFromDistributedReqInput(**{**body, **fields}))
        assert not reply.success and message in reply.message
    finally:
        h.worker.update_groups.groups.clear()


def test_an_update_larger_than_the_model_is_refused(models):
    h = harness(models["paths"]["a"])
    h.worker.update_groups.groups[GROUP] = (None, "gloo")
    try:
        reply = h.control(UpdateWeightsFromDistributedReqInput(
            names=["model.norm.weight"], dtypes=["float32"], shapes=[[1 << 20, 1 << 10]], group_name=GROUP))
        assert not reply.success and "more than a whole model's worth" in reply.message
    finally:
        h.worker.update_groups.groups.clear()


@pytest.mark.parametrize("fields, message", [
    (dict(backend="nccl"), "needs CUDA"),
    (dict(backend="mpi"), "is not one of"),
    (dict(rank_offset=1, world_size=1), "is not among ranks"),
])
def test_a_group_that_cannot_be_joined_is_refused(models, fields, message):
    h = harness(models["paths"]["a"])
    body = dict(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2, group_name=GROUP,
                backend="gloo")
    reply = h.control(InitWeightsUpdateGroupReqInput(**{**body, **fields}))
    assert not reply.success and message in reply.message
    assert h.worker.update_groups.groups == {}


# ---------------------------------------------------------------------- memory
@pytest.mark.parametrize("tags", [None, ["kv_cache"], ["weights"], ["cuda_graph"], ["weights_drafter"],
                                  ["kv_cache", "weights", "cuda_graph"]])
def test_release_then_resume_gives_identical_outputs(models, tags):
    h = harness(models["paths"]["a"], overlap=True)
    before = generate(h)
    assert h.control(ReleaseMemoryOccupationReqInput(tags=tags)).success
    runner = h.worker.model_runner
    released = tags or ["kv_cache", "weights", "weights_drafter", "cuda_graph"]
    assert h.scheduler.control.released == set(released)
    assert (runner.token_to_kv_pool.k_buffer[0].numel() == 0) == ("kv_cache" in released)
    assert (runner.model.model.embed_tokens.weight.numel() == 0) == ("weights" in released)
    assert h.control(ResumeMemoryOccupationReqInput(tags=tags)).success
    assert generate(h) == before == expected(models["hf"]["a"])


# ---------------------------------------------------------------------- per-request extras
@pytest.mark.parametrize("config", [{}, dict(chunked_prefill_size=4), dict(overlap=True)])
def test_hidden_states_equal_transformers(models, config):
    h = harness(models["paths"]["a"], **config)
    generate(h, PROMPTS[:1])  # its prefix is cached: the hidden states must still cover it all
    rid = h.submit(PROMPTS[0], max_new_tokens=N_NEW, return_hidden_states=True)
    h.run_until_idle()
    out = h.outputs[rid]
    states = out.hidden_states
    assert len(states) == N_NEW  # the prompt's block, then one vector per decode step
    assert torch.tensor(states[0]).shape == (len(PROMPTS[0]), 64)
    mine = torch.cat([torch.tensor(states[0]), torch.tensor(states[1:])])
    ref = hf_forward(models["hf"]["a"], PROMPTS[0] + out.output_ids[:-1]).hidden_states[-1][0]
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4)


def test_token_ids_logprob_equals_the_log_softmax_at_those_ids(models):
    h = harness(models["paths"]["a"])
    ids = [0, 5, 511]
    rid = h.submit(PROMPTS[0], max_new_tokens=N_NEW, return_logprob=True, logprob_start_len=0,
                   token_ids_logprob=ids)
    h.run_until_idle()
    out = h.outputs[rid]
    logits = hf_forward(models["hf"]["a"], PROMPTS[0] + out.output_ids[:-1]).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)[:, ids]
    n = len(PROMPTS[0])
    torch.testing.assert_close(torch.tensor(out.token_ids_logprobs), ref[n - 1:], rtol=1e-4, atol=1e-4)
    assert out.input_token_ids_logprobs[0] is None  # nothing predicts the first token
    torch.testing.assert_close(torch.tensor(out.input_token_ids_logprobs[1:]), ref[: n - 1], rtol=1e-4, atol=1e-4)


class ForceToken(CustomLogitProcessor):
    """Only custom_params["token_id"] may be sampled."""

    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[List[Dict[str, Any]]] = None) -> torch.Tensor:
        for row, params in enumerate(custom_param_list):
            assert params["__req__"].rid.startswith("forced")
            keep = logits[row, params["token_id"]].clone()
            logits[row] = float("-inf")
            logits[row, params["token_id"]] = keep
        return logits


class Broken(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        raise RuntimeError("boom")


def test_custom_logit_processor_steers_only_its_requests(models):
    h = harness(models["paths"]["a"], enable_custom_logit_processor=True)
    forced = h.submit(PROMPTS[0], rid="forced-0", max_new_tokens=N_NEW, custom_logit_processor=ForceToken.to_str(),
                      custom_params={"token_id": 77})
    plain = h.submit(PROMPTS[1], max_new_tokens=N_NEW)
    broken = h.submit(PROMPTS[2], max_new_tokens=N_NEW, custom_logit_processor=Broken.to_str())
    h.run_until_idle()
    assert h.outputs[forced].output_ids == [77] * N_NEW
    assert h.outputs[plain].output_ids == expected(models["hf"]["a"], [PROMPTS[1]])[0]
    reason = h.outputs[broken].finished_reason
    assert reason["status_code"] == 400 and "custom_logit_processor failed" in reason["message"]
