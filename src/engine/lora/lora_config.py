"""LoRA adapters as PEFT saves them, and the server flags that serve them (SGLang's names).

An adapter is a directory with `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`,
`use_rslora`) and `adapter_model.safetensors` (`...layers.{i}.self_attn.q_proj.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]). The delta of a targeted projection is
`x @ A^T @ B^T * scaling` with `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA).

Everything here is checked before it costs memory: the rank against --max-lora-rank, the targets
against --lora-target-modules, the names and the number of adapters against fixed bounds.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Protocol, Tuple

# The projections an adapter may target, and the fused module of ours each one lands in.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES: Dict[str, Tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
FUSED_OF: Dict[str, str] = {sub: fused for fused, subs in FUSED_MODULES.items() for sub in subs}

# Bounds: an adapter name (it travels with every request), the rank, the adapters held in host
# memory, the adapters one batch may use (each one is a slot of A and B buffers in every layer).
MAX_LORA_NAME_LEN = 256
MAX_LORA_RANK_LIMIT = 256
MAX_LOADED_LORAS = 1024
MAX_LORAS_PER_BATCH_LIMIT = 64
DEFAULT_MAX_LORA_RANK = 16
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9._/\-]+$")


class LoRAError(ValueError):
    """An adapter or a LoRA request that cannot be served (the message says why: a 400)."""


@dataclass(frozen=True)
class LoRASpec:
    """One adapter to load: its name (what requests give as lora_path) and its directory."""

    name: str
    path: str
    pinned: bool = False


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: FrozenSet[str]  # of LORA_MODULES

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


def check_lora_name(name: str) -> None:
    if not name or len(name) > MAX_LORA_NAME_LEN or not _NAME.match(name):
        raise LoRAError(f"LoRA adapter name {name[:64]!r} is not valid: 1 to {MAX_LORA_NAME_LEN} characters of "
                        "letters, digits, '.', '_', '-' and '/'.")


def parse_lora_path_arg(item: str) -> LoRASpec:
    """One --lora-paths entry: 'name=path', a plain path (named by itself) or SGLang's JSON form."""
    text = item.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise LoRAError(f"--lora-paths entry {text[:80]!r} is not valid JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("lora_name"), str) \
                or not isinstance(data.get("lora_path"), str):
            raise LoRAError("--lora-paths JSON entries need string fields lora_name and lora_path")
        spec = LoRASpec(data["lora_name"], data["lora_path"], bool(data.get("pinned", False)))
    elif "=" in text:
        name, path = text.split("=", 1)
        spec = LoRASpec(name.strip(), path.strip())
    else:
        spec = LoRASpec(text, text)
    check_lora_name(spec.name)
    return spec


def _target_names(raw: Any) -> FrozenSet[str]:
    """PEFT's target_modules (a list of module names or paths, or 'all-linear') as LORA_MODULES."""
    if raw == "all-linear":
        return frozenset(LORA_MODULES)
    if isinstance(raw, str):
        raise LoRAError(f"target_modules {raw[:80]!r}: a regular expression is not supported; list the modules")
    if not isinstance(raw, list) or not all(isinstance(m, str) for m in raw):
        raise LoRAError("adapter_config.json: target_modules must be a list of module names")
    names = frozenset(m.rsplit(".", 1)[-1] for m in raw)
    unknown = sorted(names - set(LORA_MODULES))
    if unknown:
        raise LoRAError(f"target modules {unknown} are not supported; LoRA applies to {', '.join(LORA_MODULES)}")
    return names


def read_lora_config(path: str) -> LoRAConfig:
    """The adapter's adapter_config.json, checked (a LoRAError names what is wrong)."""
    config_file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_file):
        raise LoRAError(f"LoRA adapter {path!r}: no {ADAPTER_CONFIG} (a PEFT adapter directory is expected)")
    if os.path.getsize(config_file) > MAX_ADAPTER_CONFIG_BYTES:
        raise LoRAError(f"LoRA adapter {path!r}: {ADAPTER_CONFIG} is larger than {MAX_ADAPTER_CONFIG_BYTES} bytes")
    try:
        with open(config_file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"LoRA adapter {path!r}: {ADAPTER_CONFIG} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise LoRAError(f"LoRA adapter {path!r}: {ADAPTER_CONFIG} is not a JSON object")
    if data.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {path!r}: peft_type {data.get('peft_type')!r} is not LORA")
    rank, alpha = data.get("r"), data.get("lora_alpha", data.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_LORA_RANK_LIMIT:
        raise LoRAError(f"LoRA adapter {path!r}: r must be an integer in [1, {MAX_LORA_RANK_LIMIT}], got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"LoRA adapter {path!r}: lora_alpha must be a finite number, got {alpha!r}")
    # What changes the computation beyond x A^T B^T and is not implemented: refused, never ignored.
    if data.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {path!r}: bias {data.get('bias')!r} is not supported (only 'none')")
    for flag in ("use_dora",):
        if data.get(flag):
            raise LoRAError(f"LoRA adapter {path!r}: {flag} is not supported")
    if data.get("modules_to_save"):
        raise LoRAError(f"LoRA adapter {path!r}: modules_to_save is not supported")
    if data.get("rank_pattern") or data.get("alpha_pattern"):
        raise LoRAError(f"LoRA adapter {path!r}: rank_pattern / alpha_pattern are not supported")
    return LoRAConfig(rank, float(alpha), bool(data.get("use_rslora", False)), _target_names(data.get("target_modules")))


class LoRAServerFlags(Protocol):
    """The ServerArgs fields the LoRA check reads and completes (a protocol: server_args.py imports
    this module)."""

    lora_paths: Optional[List[str]]
    max_loras_per_batch: int
    max_lora_rank: Optional[int]
    lora_target_modules: Optional[List[str]]
    max_loaded_loras: Optional[int]
    speculative_algorithm: Optional[str]
    disaggregation_mode: str
    simulated_device_forward_ms: Optional[str]
    is_embedding: bool
    disable_cuda_graph: bool


def check_lora_server_args(args: LoRAServerFlags, need: Callable[[bool, str], None]) -> None:
    """The LoRA flags, checked; --max-lora-rank and --lora-target-modules default to what the
    start-up adapters need (SGLang's rule)."""
    need(1 <= args.max_loras_per_batch <= MAX_LORAS_PER_BATCH_LIMIT,
         f"--max-loras-per-batch must be in [1, {MAX_LORAS_PER_BATCH_LIMIT}], got {args.max_loras_per_batch}")
    if args.max_loaded_loras is not None:
        need(args.max_loras_per_batch <= args.max_loaded_loras <= MAX_LOADED_LORAS,
             f"--max-loaded-loras must be in [--max-loras-per-batch ({args.max_loras_per_batch}), {MAX_LOADED_LORAS}] "
             f"(SGLang's rule), got {args.max_loaded_loras}")
    try:
        specs = [parse_lora_path_arg(item) for item in args.lora_paths or []]
        configs = [read_lora_config(spec.path) for spec in specs]
    except LoRAError as e:
        need(False, str(e))
        return
    names = [s.name for s in specs]
    need(len(set(names)) == len(names), f"--lora-paths names a LoRA adapter twice: {names}")
    if args.max_loaded_loras is not None:
        need(len(specs) <= args.max_loaded_loras,
             f"--lora-paths has {len(specs)} adapters, more than --max-loaded-loras {args.max_loaded_loras}")
    if args.max_lora_rank is None:
        args.max_lora_rank = max((c.rank for c in configs), default=DEFAULT_MAX_LORA_RANK)
    need(1 <= args.max_lora_rank <= MAX_LORA_RANK_LIMIT,
         f"--max-lora-rank must be in [1, {MAX_LORA_RANK_LIMIT}], got {args.max_lora_rank}")
    if args.lora_target_modules is None:
        targets = sorted({m for c in configs for m in c.target_modules}) if configs else list(LORA_MODULES)
        args.lora_target_modules = [m for m in LORA_MODULES if m in targets]
    elif "all" in args.lora_target_modules or "all-linear" in args.lora_target_modules:
        args.lora_target_modules = list(LORA_MODULES)
    unknown = sorted(set(args.lora_target_modules) - set(LORA_MODULES))
    need(not unknown, f"--lora-target-modules: {unknown} not among {', '.join(LORA_MODULES)} (or 'all')")
    for spec, config in zip(specs, configs):
        try:
            check_adapter_fits(config, spec.path, args.max_lora_rank, args.lora_target_modules)
        except LoRAError as e:
            need(False, str(e))
    # What the LoRA forward does not cover yet: refused at start-up, never silently wrong.
    need(args.speculative_algorithm is None, "--enable-lora is not supported with --speculative-algorithm yet")
    need(args.disaggregation_mode == "null", "--enable-lora is not supported with --disaggregation-mode yet")
    need(args.simulated_device_forward_ms is None and not args.is_embedding,
         "--enable-lora needs a generative model: not with --simulated-device-forward-ms or --is-embedding")
    # The segment layout of a batch changes with its adapters; graphs would freeze one.
    args.disable_cuda_graph = True


def check_adapter_fits(config: LoRAConfig, path: str, max_rank: Optional[int], targets: List[str]) -> None:
    if max_rank is not None and config.rank > max_rank:
        raise LoRAError(f"LoRA adapter {path!r} has rank {config.rank}, above --max-lora-rank {max_rank}")
    outside = sorted(config.target_modules - set(targets))
    if outside:
        raise LoRAError(f"LoRA adapter {path!r} targets {outside}, which --lora-target-modules does not enable "
                        f"({', '.join(targets)})")
