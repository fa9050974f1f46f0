"""NEXTN (--speculative-algorithm NEXTN): DeepSeek-V3's multi-token prediction layer, read from the target's
own checkpoint (model.layers.{num_hidden_layers}.*), drafts through the EAGLE machinery. The layer's
forward equals DeepSeek's formula written out by hand (the decoder block by transformers' DeepSeek-V3
layer); greedy outputs with NEXTN equal those without speculation (chains and trees, radix cache on and
off, overlap on and off); a checkpoint without the layer is refused at start-up."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List

import pytest
import torch

from sched_utils import Harness, fast_lane
from test_speculative_draft import _waves as draft_waves
from test_speculative_mla import VOCAB, _prompts
from utils_models import BatchDriver, ExtendReq, LetterTokenizer, build_tiny_model, hf_hidden_states, make_runner

from engine.server_args import ServerArgs, ServerArgsError

N_NEW = 16


def add_mtp_layer(path: str, seed: int) -> Dict[str, torch.Tensor]:
    """Append an MTP layer to the DeepSeek-V3 checkpoint in `path` in DeepSeek's names (transformers saves
    none): enorm, hnorm, eh_proj, shared_head.norm, a decoder layer (layer 1's, a mixture-of-experts one,
    perturbed so it is a layer of its own) and copies of the embedding and head. Returns the layer's
    weights without the prefix."""
    from safetensors.torch import load_file, save_file

    config = json.loads(open(os.path.join(path, "config.json")).read())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    weights = load_file(os.path.join(path, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    layer = {name.removeprefix("model.layers.1."): w for name, w in weights.items() if name.startswith("model.layers.1.")}
    mtp = {name: w + 0.3 * w.std().nan_to_num(0.0) * torch.randn(w.shape, generator=gen) if w.numel() > 1 else w
           for name, w in layer.items()}
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{norm}.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=gen)
    mtp["eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / math.sqrt(2 * hidden) * 1.5
    mtp["embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    mtp["shared_head.head.weight"] = weights["lm_head.weight"].clone()
    weights.update({f"model.layers.{n}.{name}": w.contiguous() for name, w in mtp.items()})
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return mtp


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """A DeepSeek-V3-shaped checkpoint with num_nextn_predict_layers 1 and its MTP layer; transformers'
    model of it (the oracle of the target's features)."""
    path = str(tmp_path_factory.mktemp("nextn_target"))
    hf = build_tiny_model(path, "deepseek_v3", seed=11, num_nextn_predict_layers=1)
    mtp = add_mtp_layer(path, seed=4)
    return path, hf, mtp


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_block(path: str, mtp: Dict[str, torch.Tensor], tmp: str):
    """transformers' DeepSeek-V3 with one (mixture-of-experts) layer, the MTP layer's decoder weights, the
    target's head and shared_head.norm as its final norm: fed inputs_embeds, its logits are
    lm_head(shared_head.norm(TRM(x)))."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    config = json.loads(open(os.path.join(path, "config.json")).read())
    config.update(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0)
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f)
    target = load_file(os.path.join(path, "model.safetensors"))
    weights = {f"model.layers.0.{name}": w for name, w in mtp.items()
               if not name.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))}
    weights.update({"model.embed_tokens.weight": target["model.embed_tokens.weight"],
                    "model.norm.weight": mtp["shared_head.norm.weight"], "lm_head.weight": target["lm_head.weight"]})
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    shutil.copy(os.path.join(path, "config.json"), os.path.join(tmp, "target_config.json"))
    return transformers.DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def test_mtp_layer_forward_matches_deepseeks_formula(mtp_model, tmp_path):
    """At every position i of a prompt: logits of t_{i+2} = lm_head(shared_head.norm(TRM(eh_proj(
    [enorm(embed(t_{i+1})); hnorm(f_i)])))), f_i the target's final hidden state at i."""
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardMode
    from engine.model_executor.model_runner import ModelRunner
    from engine.models.deepseek_nextn import DeepseekV3ForCausalLMNextN

    path, hf, mtp = mtp_model
    prompt = _prompts()[2]
    features = hf_hidden_states(hf, prompt)  # [L, hidden], after the final norm
    eps = hf.config.rms_norm_eps
    embeds = hf.model.embed_tokens.weight[torch.tensor(prompt[1:])].float()
    x = torch.cat([_rms(embeds, mtp["enorm.weight"], eps), _rms(features[:-1], mtp["hnorm.weight"], eps)], -1)
    x = x @ mtp["eh_proj.weight"].T
    with torch.no_grad():
        expected = _reference_block(path, mtp, str(tmp_path / "ref"))(inputs_embeds=x[None]).logits[0]

    target = make_runner(path)
    config = ModelConfig.from_pretrained(path, dtype="float32", device="cpu", eagle_draft=True)
    assert config.architectures == ["DeepseekV3ForCausalLMNextN"] and config.num_hidden_layers == 1
    runner = ModelRunner(config, ServerArgs(model_path=path, device="cpu", max_total_tokens=512, max_running_requests=4))
    model = runner.model
    assert isinstance(model, DeepseekV3ForCausalLMNextN)
    model.share_embed_and_head(target.model)
    driver = BatchDriver(runner)
    fb = driver.extend_batch([ExtendReq(driver.new_row(), prompt[1:])])
    fb.forward_mode = ForwardMode.TARGET_VERIFY  # every position's logits
    fb.spec_hidden_states = features[:-1]
    logits = runner.forward(fb).next_token_logits
    assert expected.shape == logits.shape
    assert (logits - expected).abs().max().item() < 1e-4 * max(1.0, expected.abs().max().item())


def _harness(path: str, spec: Dict, **kwargs) -> Harness:
    from engine.scheduler.tp_worker import TpModelWorker

    page = kwargs.get("page_size", 1)
    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=4096, page_size=page,
                                      max_running_requests=16, **spec))
    return Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=4096, model_path=path, **spec, **kwargs)


def _waves(h: Harness) -> List[List[int]]:
    """test_speculative_draft's two waves over this module's prompts (the second from the radix cache)."""
    return draft_waves(h, _prompts(), dict(max_new_tokens=N_NEW, ignore_eos=True))


CONFIGS = {"default": {}, "no-radix": dict(disable_radix_cache=True), "page16": dict(page_size=16)}
MODES = [(name, overlap) for name in CONFIGS for overlap in (False, True)]


@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("name,overlap", fast_lane(MODES, {("default", False), ("no-radix", True)}))
def test_nextn_keeps_greedy_outputs(mtp_model, topk, name, overlap):
    path, _, _ = mtp_model
    spec = dict(speculative_algorithm="NEXTN", speculative_batch_size_threshold=1024,
                disable_speculative_adaptive=True, speculative_num_steps=3)
    if topk > 1:
        spec.update(speculative_eagle_topk=topk, speculative_num_draft_tokens=8)
    plain = _waves(_harness(path, {}, overlap=overlap, **CONFIGS[name]))
    h = _harness(path, spec, overlap=overlap, **CONFIGS[name])
    assert h.args.speculative_algorithm == "EAGLE" and h.args.speculative_draft_model_path == path
    assert _waves(h) == plain
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0 and state["spec_draft_tokens"] > 0
    # The MTP layer's latent K/V pool: one layer of kv_lora_rank + rope values a slot, and the target's features.
    assert state["draft_kv_pool_bytes"] == (4096 + page_of(name)) * ((32 + 8) + 64) * 4


def page_of(name: str) -> int:
    return CONFIGS[name].get("page_size", 1)


def test_nextn_flags_map_onto_eagle():
    args = ServerArgs(device="cpu", model_path="/some/deepseek-v3", speculative_algorithm="NEXTN")
    assert args.speculative_algorithm == "EAGLE"
    assert args.speculative_draft_model_path == "/some/deepseek-v3"
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    given = ServerArgs(device="cpu", model_path="/a", speculative_algorithm="NEXTN", speculative_draft_model_path="/b")
    assert given.speculative_draft_model_path == "/b"
    with pytest.raises(ServerArgsError, match="must be one of NGRAM, STANDALONE, EAGLE, EAGLE3, NEXTN"):
        ServerArgs(device="cpu", speculative_algorithm="MEDUSA")


def test_checkpoint_without_mtp_weights_is_refused(tmp_path):
    """transformers keeps num_nextn_predict_layers 1 in the config but drops the layer's weights: refused
    when the draft loads, saying so; a config without the layer is refused before any weight is read."""
    path = str(tmp_path / "no_mtp")
    build_tiny_model(path, "deepseek_v3", seed=11, num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match=r"no MTP weights \(model.layers.2.\*\)"):
        _harness(path, dict(speculative_algorithm="NEXTN"))
    config = json.loads(open(os.path.join(path, "config.json")).read())
    config["num_nextn_predict_layers"] = 0
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="has no multi-token prediction layer"):
        _harness(path, dict(speculative_algorithm="NEXTN"))


def test_nextn_on_a_llama_target_is_refused(tmp_path):
    path = str(tmp_path / "llama")
    build_tiny_model(path, seed=1, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="nor a DeepSeek-V3 checkpoint with its MTP layer"):
        _harness(path, dict(speculative_algorithm="NEXTN"))


def test_the_draft_reads_and_counts_only_its_layer(mtp_model):
    """The draft's loader reads the MTP layer's tensors alone, and the memory budget counts its share of
    the checkpoint's bytes (the target's 2 layers, then its own: a third), not the whole directory."""
    from engine.configs.mla_config import nextn_weight_prefix
    from engine.configs.model_config import ModelConfig
    from engine.model_loader.weight_utils import safetensors_weights_iterator
    from engine.speculative.memory import draft_memory

    path, _, mtp = mtp_model
    config = ModelConfig.from_pretrained(path, dtype="float32", device="cpu", eagle_draft=True)
    names = [name for name, _ in safetensors_weights_iterator(path, nextn_weight_prefix(config.raw_config))]
    assert sorted(names) == sorted(f"model.layers.2.{name}" for name in mtp)
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=256, speculative_algorithm="NEXTN")
    target = ModelConfig.from_pretrained(path, dtype="float32", device="cpu")
    memory = draft_memory(args, target, 1)
    assert memory is not None
    assert memory.weight_bytes == os.path.getsize(os.path.join(path, "model.safetensors")) // 3
    assert memory.kv_bytes_per_token == (32 + 8) * 4 and memory.feature_bytes_per_token == 64 * 4


# ------------------------------------------------------------------------------------------ TP 2
NEXTN_SPEC = dict(speculative_algorithm="NEXTN", speculative_batch_size_threshold=1024,
                  disable_speculative_adaptive=True, speculative_num_steps=3)
# name: (--ep-size, --speculative-eagle-topk): the MTP layer's and the target's experts split by TP, then by
# expert; chains, and trees (the draft's tree steps and the target's verify under the latent tree mask).
TP_CASES = {"ep1": (1, 1), "ep2": (2, 1), "ep2-tree": (2, 2)}


def _tp_spec(topk: int) -> Dict:
    return dict(NEXTN_SPEC, speculative_eagle_topk=topk, speculative_num_draft_tokens=8) if topk > 1 else NEXTN_SPEC


def _tp_generate(path: str, spec: Dict, tp_size: int, ep_size: int, tp_rank: int = 0) -> Dict:
    """Greedy outputs of _prompts() on this rank's scheduler (a TP group's ranks run the same requests),
    and its speculative counts."""
    from engine.scheduler.tp_worker import TpModelWorker

    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=2048, max_running_requests=16,
                                      tp_size=tp_size, ep_size=ep_size, **spec), tp_rank=tp_rank)
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=2048, model_path=path, tp_size=tp_size,
                ep_size=ep_size, **spec)
    rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in _prompts()]
    h.run_until_idle()  # ends with the strict idle leak check
    state = h.scheduler.internal_state()
    h.scheduler.shutdown()
    return {"greedy": [h.outputs[r].output_ids for r in rids], "verify_ct": state.get("spec_verify_ct", 0),
            "drafted": state.get("spec_draft_tokens", 0)}


def _nextn_tp2_work(path: str) -> Dict[str, Dict]:
    """On each of 2 ranks: NEXTN in each case; every sampled and verified token checked equal on both."""
    from engine.distributed.parallel_state import get_tp_rank
    from engine.model_executor import model_runner

    model_runner.CHECK_TP_SAMPLING = True
    return {name: _tp_generate(path, _tp_spec(topk), 2, ep, get_tp_rank()) for name, (ep, topk) in TP_CASES.items()}


@pytest.mark.slow  # two spawned ranks build the DeepSeek-V3 target and its MTP draft twice
def test_nextn_at_tp2_equals_tp1_without_speculation(mtp_model):
    """NEXTN over 2 TP ranks (the MTP layer's attention heads split as the target's, its experts split by TP
    with --ep-size 1 and by expert with --ep-size 2; chains, and trees at --ep-size 2): greedy outputs equal
    TP 1 without speculation."""
    from tp_utils import run_tp_ranks

    path, _, _ = mtp_model
    plain = _tp_generate(path, {}, 1, 1)["greedy"]
    results = run_tp_ranks(_nextn_tp2_work, path, check_exit=True)
    for name in TP_CASES:
        assert results[name]["greedy"] == plain, name
        assert results[name]["verify_ct"] > 0 and results[name]["drafted"] > 0, (name, results[name])
