"""Test helpers: tiny random Hugging Face model directories and a hand-driven ModelRunner.

`build_tiny_model` writes a real model directory (config.json + safetensors) with transformers,
so the engine loads it through its normal loading code, and returns transformers' model as the
oracle. `BatchDriver` builds ModelWorkerBatch / ForwardBatch objects by hand (what the scheduler
does), with KV slots handed out page by page in a scrambled order so that paging bugs show.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}

# The mixture-of-experts families' own fields (with TINY): 4-8 experts, top-2; Qwen's layer 0 dense
# (mlp_only_layers) so both kinds of layer are covered.
TINY_MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False, mlp_only_layers=[0],
                      decoder_sparse_step=1),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      mlp_only_layers=[0], decoder_sparse_step=1, head_dim=32),
    # MLA (latent 32, rope 8, nope 16, v 16), the first layer dense. V2: q straight from the hidden state,
    # YaRN rotary with mscale_all_dim, 3 layers, softmax top-2 of 4 experts; V3: q through its own latent,
    # sigmoid routing with a correction bias over 4 groups of 2 experts (the 2 best groups), scaled by 2.5.
    "deepseek_v2": dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                        topk_method="greedy", routed_scaling_factor=1.0,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "mscale": 0.707,
                                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    "deepseek_v3": dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
}

# Sliding-window families (with TINY): a window of 16 that prompts of 100+ tokens run far past, local and
# global layers mixed (Gemma's head_dim and query_pre_attn_scalar set apart so a wrong scale shows).
TINY_SWA = {
    "mistral": dict(sliding_window=16, max_position_embeddings=1024),
    # Qwen2 windows the layers from max_window_layers on: a hybrid model on Llama's layers.
    "qwen2": dict(sliding_window=16, use_sliding_window=True, max_window_layers=1, max_position_embeddings=1024),
    "gemma2": dict(sliding_window=16, max_position_embeddings=1024, head_dim=16, query_pre_attn_scalar=24,
                   num_hidden_layers=3, hidden_activation="gelu_pytorch_tanh"),
    "gemma3": dict(sliding_window=16, max_position_embeddings=1024, head_dim=16, query_pre_attn_scalar=24,
                   num_hidden_layers=3, final_logit_softcapping=20.0,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # Sinks, biases, its own experts (4, top-2) and YaRN rotary; layers alternate local/global.
    "gpt_oss": dict(sliding_window=16, max_position_embeddings=1024, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=32),
}

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


class LetterTokenizer:
    """A tokenizer for random models in scheduler tests: token i decodes to one letter (a + i mod 26), so
    stop strings and detokenized text have something to match; a letter encodes back to its id."""

    eos_token_id = None

    def decode(self, ids, **kwargs) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - ord("a") for c in text]


def build_tiny_model(
    path: str,
    arch: str = "llama",
    seed: int = 0,
    max_shard_size: Optional[str] = None,
    dtype: torch.dtype = torch.float32,
    **overrides,
):
    """Write a random model of architecture `arch` to `path`; return transformers' model (eval)."""
    import transformers

    config_cls = getattr(transformers, ARCHS[arch][0])
    model_cls = getattr(transformers, ARCHS[arch][1])
    kwargs = dict(TINY)
    kwargs.update(TINY_MOE.get(arch, {}))
    kwargs.update(overrides)
    kwargs.setdefault("tie_word_embeddings", False)
    # No EOS: the oracle's greedy loop and the engine both run a fixed number of steps.
    kwargs.setdefault("eos_token_id", None)
    kwargs.setdefault("bos_token_id", None)
    kwargs.setdefault("pad_token_id", None)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _randomize(model, seed)
    model.eval()
    save_kwargs = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.to(dtype).save_pretrained(path, **save_kwargs)
    return model.to(torch.float32)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # transformers' init (std 0.02) gives near-uniform logits; larger weights give distinct
    # greedy tokens, so a wrong kernel changes the generated text.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]) * 1.5)
            elif "norm" in name.lower():  # RMSNorm, q_norm, BERT's LayerNorm
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:  # biases
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: make it matter
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))


TINY_BERT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=512,
    max_position_embeddings=128,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
    hidden_act="gelu",
)


def scaled_builtin_checkpoint(dst: str, factor: float = 1.3, which: str = "") -> str:
    """A copy of the built-in model in `dst` with the matrices whose names contain `which` (every
    one by default) scaled by `factor`: the same architecture and tokenizer, other outputs (the
    "new weights" of the weight-update tests)."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.builtin_model import ensure_builtin_model

    src = ensure_builtin_model()
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), dst)
    weights = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v * factor if v.dim() == 2 and which in k else v for k, v in weights.items()},
              os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def build_tiny_bert(path: str, seed: int = 0, pooling_mode: Optional[str] = None, normalize: bool = True, **overrides):
    """A random transformers BertModel in `path`; with `pooling_mode` ("mean", "cls", "lasttoken")
    also sentence-transformers' files (modules.json, 1_Pooling/config.json). Returns the model."""
    import json
    import os

    import transformers

    kwargs = dict(TINY_BERT)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig(**kwargs), add_pooling_layer=True).to(torch.float32)
    _randomize(model, seed)
    model.eval()
    model.save_pretrained(path)
    if pooling_mode is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        with open(os.path.join(path, "modules.json"), "w") as f:
            json.dump(modules, f)
        os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": kwargs["hidden_size"], "pooling_mode": pooling_mode}, f)
    return model


@torch.no_grad()
def hf_hidden_states(model, token_ids: Sequence[int]) -> torch.Tensor:
    """[len, hidden] float32 final hidden states of a transformers base model (BertModel,
    LlamaModel, ...) or of the base model inside a *ForCausalLM."""
    base = getattr(model, "model", model)
    ids = torch.tensor([list(token_ids)])
    return base(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0].float()


@torch.no_grad()
def hf_logits(model, token_ids: Sequence[int]) -> torch.Tensor:
    """[len, vocab] float32 logits at every position."""
    return model(torch.tensor([list(token_ids)])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, token_ids: Sequence[int], steps: int) -> List[int]:
    """transformers' greedy generate (the models are built without EOS, so it runs all steps)."""
    ids = torch.tensor([list(token_ids)])
    # An explicit mask: otherwise a prompt token equal to pad_token_id would be masked out.
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=steps,
        min_new_tokens=steps,
        pad_token_id=0,
    )
    return out[0, len(token_ids) :].tolist()


@dataclass
class ExtendReq:
    row: int  # ReqToTokenPool row
    new_ids: List[int]  # tokens computed in this extend
    prefix_len: int = 0  # tokens of this request already in the pool
    logprob_start: Optional[int] = None  # relative to the extend start; None: no input logprobs
    top_logprobs: int = 0


class BatchDriver:
    """Drives a ModelRunner like a scheduler would, for tests and benchmarks."""

    def __init__(self, runner, seed: int = 0, scramble: bool = False) -> None:
        """Slots come from the runner's allocator, or with `scramble` (or no allocator) from a
        private shuffled page list, so pages of one request are far apart in the pool."""
        self.runner = runner
        self.page_size = runner.page_size
        self.allocator = None if scramble else runner.token_to_kv_pool_allocator
        num_pages = runner.max_total_num_tokens // self.page_size
        self.free_pages = list(range(1, num_pages + 1))  # page 0 is the padding page
        random.Random(seed).shuffle(self.free_pages)
        self.pages: Dict[int, List[int]] = {}
        self.free_rows = list(range(1, runner.req_to_token_pool.size + 1))

    def new_row(self) -> int:
        row = self.free_rows.pop(0)
        self.pages[row] = []
        return row

    def _last_loc(self, row: int, seq_len: int) -> int:
        return int(self.runner.req_to_token_pool.req_to_token[row, seq_len - 1]) if seq_len > 0 else -1

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots for positions [start, end) of a request; records them in its req_to_token row."""
        if self.allocator is not None:
            slots = self.allocator.alloc_extend(
                torch.tensor([start]), torch.tensor([end]), torch.tensor([self._last_loc(row, start)]), end - start
            )
            assert slots is not None, "KV pool exhausted"
        else:
            pages = self.pages[row]
            out = []
            for pos in range(start, end):
                while pos // self.page_size >= len(pages):
                    pages.append(self.free_pages.pop())
                out.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
            slots = torch.tensor(out, dtype=torch.int64)
        self.runner.req_to_token_pool.req_to_token[row, start:end] = slots.to(torch.int32)
        return slots

    def extend_batch(self, reqs: Sequence[ExtendReq], decode_rows: Sequence[Tuple[int, int, int]] = ()) -> ForwardBatch:
        """EXTEND batch, or MIXED when decode rows (row, token, seq_len_before) follow."""
        input_ids, out_loc, seq_lens, ext_lens, pre_lens, starts, lp_ids = [], [], [], [], [], [], []
        top = []
        for r in reqs:
            input_ids += r.new_ids
            out_loc.append(self.slots(r.row, r.prefix_len, r.prefix_len + len(r.new_ids)))
            seq_lens.append(r.prefix_len + len(r.new_ids))
            ext_lens.append(len(r.new_ids))
            pre_lens.append(r.prefix_len)
            start = len(r.new_ids) if r.logprob_start is None else r.logprob_start
            starts.append(start)
            # The token after each logprob position; the last one is not known yet (placeholder 0).
            lp_ids += (r.new_ids + [0])[start + 1 : len(r.new_ids) + 1]
            top.append(r.top_logprobs)
        for row, token, seq_len in decode_rows:
            input_ids.append(token)
            out_loc.append(self.slots(row, seq_len, seq_len + 1))
            seq_lens.append(seq_len + 1)
            ext_lens.append(1)
            pre_lens.append(seq_len)
            starts.append(1)
            top.append(0)
        want_lp = any(r.logprob_start is not None for r in reqs)
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.MIXED if decode_rows else ForwardMode.EXTEND,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            req_pool_indices=torch.tensor([r.row for r in reqs] + [d[0] for d in decode_rows], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            seq_lens_cpu=seq_lens,
            out_cache_loc=torch.cat(out_loc),
            return_logprob=want_lp,
            top_logprobs_nums=top if want_lp else None,
            extend_num_tokens=len(input_ids),
            extend_seq_lens=ext_lens,
            extend_prefix_lens=pre_lens,
            extend_logprob_start_lens=starts if want_lp else None,
            extend_input_logprob_token_ids=torch.tensor(lp_ids, dtype=torch.int64) if want_lp else None,
        )
        return ForwardBatch.init_new(batch, self.runner)

    def decode_batch(self, rows: Sequence[int], tokens: Sequence[int], seq_lens_before: Sequence[int]) -> ForwardBatch:
        seq_lens = [n + 1 for n in seq_lens_before]
        if self.allocator is not None:
            last_loc = torch.tensor([self._last_loc(row, n) for row, n in zip(rows, seq_lens_before)])
            out_loc = self.allocator.alloc_decode(torch.tensor(seq_lens), last_loc)
            assert out_loc is not None, "KV pool exhausted"
            for row, n, slot in zip(rows, seq_lens_before, out_loc.tolist()):
                self.runner.req_to_token_pool.req_to_token[row, n] = slot
        else:
            out_loc = torch.cat([self.slots(row, n, n + 1) for row, n in zip(rows, seq_lens_before)])
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=torch.tensor(list(tokens), dtype=torch.int64),
            req_pool_indices=torch.tensor(list(rows), dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            seq_lens_cpu=seq_lens,
            out_cache_loc=out_loc,
        )
        return ForwardBatch.init_new(batch, self.runner)

    def run(self, forward_batch: ForwardBatch):
        out = self.runner.forward(forward_batch)
        return out, self.runner.sample(out, forward_batch)


def make_runner(model_dir: str, page_size: int = 1, dtype: str = "float32", max_total_tokens: int = 4096, **args):
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.model_runner import ModelRunner
    from engine.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=model_dir,
        dtype=dtype,
        device="cpu",
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        max_running_requests=args.pop("max_running_requests", 16),
        **args,
    )
    config = ModelConfig.from_pretrained(model_dir, dtype=dtype, device="cpu", is_embedding=server_args.is_embedding)
    return ModelRunner(config, server_args)


def build_eagle_head(path: str, target_path: str, seed: int = 0, identity: bool = False) -> str:
    """An EAGLE-1 head for the Llama model in `target_path`, in EAGLE's checkpoint format (config.json
    with architectures LlamaForCausalLMEagle and one layer; safetensors fc.weight [hidden, 2 * hidden],
    fc.bias and layers.0.* without input_layernorm; no embedding or head: the target's are shared).
    `identity`: fc passes the token's embedding through and the layer adds nothing (o_proj and
    down_proj zero), so the head's output is embed(token): a target without layers whose final norm
    is all ones then predicts exactly what the head predicts."""
    import json
    import os

    from safetensors.torch import save_file

    with open(os.path.join(target_path, "config.json")) as f:
        config = json.load(f)
    config.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1]) * 1.5

    weights = {
        "fc.weight": rand(hidden, 2 * hidden), "fc.bias": 0.1 * torch.randn(hidden, generator=gen),
        "layers.0.self_attn.q_proj.weight": rand(q_out, hidden),
        "layers.0.self_attn.k_proj.weight": rand(kv_out, hidden),
        "layers.0.self_attn.v_proj.weight": rand(kv_out, hidden),
        "layers.0.self_attn.o_proj.weight": rand(hidden, q_out),
        "layers.0.mlp.gate_proj.weight": rand(inter, hidden),
        "layers.0.mlp.up_proj.weight": rand(inter, hidden),
        "layers.0.mlp.down_proj.weight": rand(hidden, inter),
        "layers.0.post_attention_layernorm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=gen),
    }
    if identity:
        weights["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        weights["fc.bias"] = torch.zeros(hidden)
        weights["layers.0.self_attn.o_proj.weight"] = torch.zeros(hidden, q_out)
        weights["layers.0.mlp.down_proj.weight"] = torch.zeros(hidden, inter)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return path


def build_eagle3_head(path: str, target_path: str, seed: int = 0, draft_vocab_size: Optional[int] = None,
                      aux_layer_ids: Optional[List[int]] = None, repeat: bool = False) -> str:
    """A random EAGLE3 head for the Llama model in `target_path`, in EAGLE3's checkpoint format:
    config.json with architectures LlamaForCausalLMEagle3, one layer, draft_vocab_size and
    target_hidden_size (and eagle_config.eagle_aux_hidden_state_layer_ids when given: target layer
    outputs, SGLang's meaning); safetensors fc.weight [hidden, 3 * hidden], midlayer.* (q/k/v_proj
    reading 2 * hidden, input_layernorm, hidden_norm, post_attention_layernorm, mlp), norm.weight,
    lm_head.weight [draft_vocab, hidden] and d2t (target id - draft id) over a random subset of the
    target's vocabulary, in random order; t2d (a boolean mask over the target's vocabulary) as well.
    No embedding: the target's is shared.
    `repeat`: fc passes the first of the three states through, the layer adds nothing (o_proj and
    down_proj zero), the final norm is all ones and lm_head's row of each draft id is the target's
    embedding of its target id (d2t): fed a feature embed(t) (a 1-layer target's layer input at t),
    the head predicts t again and feeds embed(t) on, so it predicts exactly what a target that
    repeats its last token predicts (utils: repeat_target)."""
    import json
    import os

    from safetensors.torch import save_file

    with open(os.path.join(target_path, "config.json")) as f:
        config = json.load(f)
    vocab = config["vocab_size"]
    draft_vocab = draft_vocab_size or vocab
    config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=draft_vocab,
                  target_hidden_size=config["hidden_size"])
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1]) * 1.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(hidden, generator=gen)

    hot = torch.randperm(vocab, generator=gen)[:draft_vocab]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    weights = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": rand(q_out, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_out, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_out, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, q_out),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "norm.weight": norm(),
        "lm_head.weight": rand(draft_vocab, hidden) * 3,
        "d2t": hot - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    if repeat:
        from safetensors.torch import load_file

        embed = load_file(os.path.join(target_path, "model.safetensors"))["model.embed_tokens.weight"]
        weights["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, 2 * hidden)], dim=1)
        weights["midlayer.self_attn.o_proj.weight"] = torch.zeros(hidden, q_out)
        weights["midlayer.mlp.down_proj.weight"] = torch.zeros(hidden, inter)
        weights["norm.weight"] = torch.ones(hidden)
        weights["lm_head.weight"] = embed[hot].float()
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return path


def repeat_target(path: str, seed: int = 0, vocab_size: int = 2560) -> str:
    """A 1-layer random Llama that always predicts its last token: the layer adds nothing (o_proj and
    down_proj zero), the final norm is all ones and lm_head is the embedding with rows of norm 1, so
    the logit of s at token t is |e_t| cos(e_s, e_t) / rms(e_t), largest at s = t (the embeddings are
    distinct)."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    build_tiny_model(path, seed=seed, vocab_size=vocab_size, max_position_embeddings=2048, num_hidden_layers=1)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    for name in weights:
        if "o_proj" in name or "down_proj" in name:
            weights[name] = torch.zeros_like(weights[name])
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    embed = weights["model.embed_tokens.weight"]
    embed = embed / embed.norm(dim=-1, keepdim=True)
    weights["model.embed_tokens.weight"] = embed
    with open(os.path.join(path, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    if not tied:
        weights["lm_head.weight"] = embed.clone()
    save_file({k: v.contiguous() for k, v in weights.items()}, file, metadata={"format": "pt"})
    return path
