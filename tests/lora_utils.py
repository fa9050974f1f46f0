"""Test helpers for LoRA: random PEFT adapters on a tiny random Llama, and peft's greedy output."""

from __future__ import annotations

import copy
import os
from typing import Dict, List, Sequence

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_model, path: str, rank: int, targets: Sequence[str], seed: int, alpha: float = 16.0,
                 use_rslora: bool = False) -> None:
    """A PEFT adapter with random A and B (PEFT starts B at zero, which would change nothing), saved to `path`."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                        use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = get_peft_model(copy.deepcopy(base_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(path)


def peft_greedy(base_model, adapter_path: str, prompts: Sequence[Sequence[int]], steps: int) -> List[List[int]]:
    """Greedy tokens of the base model with the adapter, by peft on transformers (float32)."""
    from peft import PeftModel

    from utils_models import hf_greedy

    model = PeftModel.from_pretrained(copy.deepcopy(base_model), adapter_path).eval()
    return [hf_greedy(model, p, steps) for p in prompts]


def build_adapters(base_model, root: str, specs: Dict[str, dict]) -> Dict[str, str]:
    """Adapters named by `specs` (rank, targets, seed), written under `root`; name -> path."""
    paths = {}
    for name, spec in specs.items():
        path = os.path.join(root, name)
        make_adapter(base_model, path, spec["rank"], spec["targets"], spec["seed"])
        paths[name] = path
    return paths
