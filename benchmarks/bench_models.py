"""Models for benchmarks: the built-in model, or random-weight Llamas written once into a cache dir.

`small` is the 141M Llama (hidden 1024, 8 layers, 16 heads, 8 KV heads, intermediate 2048, vocab
32000) that vLLM's CPU build and transformers were measured on, so figures compare directly.
"""

from __future__ import annotations

import os
from typing import Tuple

RANDOM_LLAMAS = {
    # name: (hidden, layers, heads, kv_heads, intermediate)
    "tiny": (256, 4, 4, 2, 688),
    "100m": (768, 12, 12, 4, 2048),
    "small": (1024, 8, 16, 8, 2048),
}


def random_llama_dir(name: str, dtype: str = "bfloat16") -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, inter = RANDOM_LLAMAS[name]
    root = os.environ.get("ENGINE_CACHE_DIR", os.path.expanduser("~/.cache/engine"))
    path = os.path.join(root, "bench-models", f"llama-{name}-{dtype}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = LlamaConfig(
        vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=inter, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def resolve_model(name: str, dtype: str = "bfloat16") -> Tuple[str, int]:
    """(model directory, vocab size) for `builtin`, a random Llama name, or a directory."""
    import json

    if name == "builtin":
        from engine.builtin_model import ensure_builtin_model

        path = ensure_builtin_model()
    elif name in RANDOM_LLAMAS:
        path = random_llama_dir(name, dtype)
    else:
        path = name
    with open(os.path.join(path, "config.json")) as f:
        return path, json.load(f)["vocab_size"]
