"""The built-in tiny model: a real Hugging Face Llama directory written on first use.

`python -m engine.launch_server` with no `--model-path` serves this model, so the engine runs on any
machine with no download. Its weights are random (fixed seed) and its text is meaningless, but it is
an ordinary model directory: `config.json`, `model.safetensors`, a byte-level BPE `tokenizer.json`
trained on `builtin_data/corpus.txt`, `tokenizer_config.json` with a chat template, and
`generation_config.json`. The engine loads it through the same code as any other model.

Every file is byte-identical on every machine and every run: JSON keys are sorted, the safetensors
metadata is fixed, BPE training has no data-dependent randomness, and the weights are derived from
integer draws of a seeded CPU `torch.Generator` (see `_seeded_normal`), not from `normal_`, whose
floating-point path differs between CPU instruction sets.

Run `python -m engine.builtin_model` to write it; the last line printed is its directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

BUILTIN_MODEL_NAME = "engine-builtin"
# Bump the suffix whenever any written byte changes, so stale caches are never reused.
BUILTIN_MODEL_DIRNAME = "builtin-model-v2"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
PAD_TOKEN = "<|pad|>"
# The BPE trainer gives special tokens the first ids, in this order.
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    EOT_TOKEN,
    SYSTEM_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    PAD_TOKEN,
)
BOS_TOKEN_ID = SPECIAL_TOKENS.index(BOS_TOKEN)
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)
EOT_TOKEN_ID = SPECIAL_TOKENS.index(EOT_TOKEN)
PAD_TOKEN_ID = SPECIAL_TOKENS.index(PAD_TOKEN)
# Generation stops at either: EOS ends a document, EOT ends a chat turn.
STOP_TOKEN_IDS: tuple[int, ...] = (EOS_TOKEN_ID, EOT_TOKEN_ID)

# The corpus yields about 2.6k merges that occur at least twice; 2560 is reached with margin and
# is a multiple of 64, which keeps the embedding and lm_head shapes friendly to GPU kernels.
VOCAB_SIZE = 2560
MIN_MERGE_FREQUENCY = 2

MODEL_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Roles render as `<|role|>\n{content}<|eot|>\n`; the rendered text starts with BOS (as Llama 3
# does), so it must be encoded with add_special_tokens=False. Content may be a string or a list
# of OpenAI-style parts, of which the text parts are kept.
#
# Tools follow the Hermes / Qwen 2.5 convention (`--tool-call-parser qwen25`): their signatures go
# into the system turn inside <tools></tools>, an assistant turn's tool calls render as
# `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, and a tool result is a user turn
# wrapped in <tool_response></tool_response>. Without tools the rendering is unchanged.
_CONTENT = (
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
)
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|system|>\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set message = messages[0] -%}" + _CONTENT + "{{- '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\nYou may call one or more functions. Their signatures:\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\nFor each call, answer <tool_call>\\n{\"name\": <name>, \"arguments\": <JSON object>}"
    "\\n</tool_call><|eot|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|user|>\\n<tool_response>\\n' -}}" + _CONTENT + "{{- '\\n</tool_response><|eot|>\\n' -}}"
    "{%- elif message['role'] in ['system', 'user', 'assistant'] -%}"
    "{{- '<|' ~ message['role'] ~ '|>\\n' -}}" + _CONTENT +
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set function = call['function'] if call['function'] is defined else call -%}"
    "{{- '<tool_call>\\n{\"name\": ' ~ (function['name'] | tojson) ~ ', \"arguments\": ' -}}"
    "{%- if function['arguments'] is string -%}{{- function['arguments'] -}}"
    "{%- else -%}{{- function['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|eot|>\\n' -}}"
    "{%- else -%}"
    "{{- raise_exception('Unsupported chat role: ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class BuiltinModelSpec:
    """Shape and initialisation of the built-in Llama model."""

    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 32
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    seed: int = 20240601


SPEC = BuiltinModelSpec()


# --------------------------------------------------------------------------- locations


def builtin_model_dir(cache_dir: Optional[str] = None) -> str:
    """Where the built-in model lives (without writing it).

    `cache_dir` defaults to `$ENGINE_CACHE_DIR`, else `~/.cache/engine`.
    """
    if cache_dir is None:
        cache_dir = os.environ.get("ENGINE_CACHE_DIR") or os.path.join(
            os.path.expanduser("~"), ".cache", "engine"
        )
    return os.path.join(os.path.abspath(cache_dir), BUILTIN_MODEL_DIRNAME)


def is_complete_model_dir(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in MODEL_FILES)


def ensure_builtin_model(cache_dir: Optional[str] = None) -> str:
    """Return the built-in model's directory, writing it first if it is missing.

    The files are built in a temporary directory next to the target and renamed into place, so a
    concurrent process sees either no directory or a complete one. If two processes race, the
    loser discards its copy (the bytes are identical anyway).
    """
    target = Path(builtin_model_dir(cache_dir))
    if is_complete_model_dir(str(target)):
        return str(target)
    logger.info("Writing the built-in model to %s", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{BUILTIN_MODEL_DIRNAME}.tmp-", dir=target.parent))
    try:
        write_builtin_model(str(staging))
        # mkdtemp creates 0700; a shared cache should be readable like any other model directory.
        os.chmod(staging, 0o755)
        _publish(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("Built-in model ready at %s", target)
    return str(target)


def _publish(staging: Path, target: Path) -> None:
    try:
        os.rename(staging, target)
    except OSError:
        if is_complete_model_dir(str(target)):
            return  # another process published first
        # An incomplete leftover (not one of ours: we only ever rename complete directories).
        # Move it aside rather than delete in place, so the rename below cannot meet it again.
        graveyard = Path(
            tempfile.mkdtemp(prefix=f".{BUILTIN_MODEL_DIRNAME}.old-", dir=target.parent)
        )
        try:
            os.rename(target, graveyard / "old")
        except FileNotFoundError:
            pass
        shutil.rmtree(graveyard, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            if not is_complete_model_dir(str(target)):
                raise
    _fsync_dir(target.parent)


# --------------------------------------------------------------------------- writing


def write_builtin_model(out_dir: str) -> None:
    """Write every file of the model into `out_dir` (an existing directory); not atomic."""
    tokenizer = build_tokenizer()
    if tokenizer.get_vocab_size() != SPEC.vocab_size:
        raise RuntimeError(
            f"built-in tokenizer has {tokenizer.get_vocab_size()} tokens, "
            f"expected {SPEC.vocab_size}"
        )
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token!r} did not get id {token_id}")

    tokenizer_json = json.loads(tokenizer.to_str())
    _write_bytes(out_dir, "tokenizer.json", _json_bytes(tokenizer_json))
    _write_bytes(out_dir, "tokenizer_config.json", _json_bytes(_tokenizer_config()))
    _write_bytes(out_dir, "special_tokens_map.json", _json_bytes(_special_tokens_map()))
    _write_bytes(out_dir, "config.json", _json_bytes(_model_config()))
    _write_bytes(out_dir, "generation_config.json", _json_bytes(_generation_config()))
    _write_bytes(out_dir, "model.safetensors", _safetensors_bytes(build_state_dict()))


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE tokenizer on the packaged corpus (deterministic)."""
    # Imported here: only the first run in a cache needs them.
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers import trainers

    tokenizer = Tokenizer(models.BPE())
    # No normalizer: any string must survive encode/decode unchanged (e.g. combining marks).
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SPEC.vocab_size,
        min_frequency=MIN_MERGE_FREQUENCY,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        # All 256 byte symbols, so text never seen in the corpus still encodes (byte fallback).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    with _tokenizers_parallelism_disabled():
        tokenizer.train_from_iterator([read_corpus()], trainer=trainer)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
            ),
        ]
    )
    return tokenizer


def read_corpus() -> str:
    # One path segment per `/`: `engine` may be a namespace package, whose multiplexed path
    # joins a single segment at a time.
    corpus = resources.files("engine") / "builtin_data" / "corpus.txt"
    return corpus.read_text(encoding="utf-8")


@contextlib.contextmanager
def _tokenizers_parallelism_disabled() -> Iterator[None]:
    # The trainer's result does not depend on thread scheduling (counts are summed, and merge ties
    # break on token ids), but running it serially makes that independent of the library's
    # internals, and keeps `tokenizers` from warning in processes forked after training.
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def build_state_dict(spec: BuiltinModelSpec = SPEC) -> dict[str, torch.Tensor]:
    """Hugging Face Llama parameter names and shapes, filled from a fixed seed."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q_out = spec.num_attention_heads * spec.head_dim
    kv_out = spec.num_key_value_heads * spec.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (spec.vocab_size, hidden))
    ]
    for i in range(spec.num_hidden_layers):
        prefix = f"model.layers.{i}"
        shapes += [
            (f"{prefix}.input_layernorm.weight", (hidden,)),
            (f"{prefix}.self_attn.q_proj.weight", (q_out, hidden)),
            (f"{prefix}.self_attn.k_proj.weight", (kv_out, hidden)),
            (f"{prefix}.self_attn.v_proj.weight", (kv_out, hidden)),
            (f"{prefix}.self_attn.o_proj.weight", (hidden, q_out)),
            (f"{prefix}.post_attention_layernorm.weight", (hidden,)),
            (f"{prefix}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{prefix}.mlp.up_proj.weight", (inter, hidden)),
            (f"{prefix}.mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (spec.vocab_size, hidden))]

    # Imported here: the launcher calls ensure_builtin_model before it starts the schedulers, and
    # a built model needs no torch (seconds of import that would delay every child's start).
    import torch

    generator = torch.Generator(device="cpu").manual_seed(spec.seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes:  # a fixed order, so each tensor gets the same draws every time
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=torch.float32)
        else:
            state[name] = _seeded_normal(shape, spec.init_std, generator)
    return state


# Irwin-Hall: the sum of 12 uniform integers in [0, 2**24) has variance exactly 2**48 - 1, i.e. a
# standard deviation of 2**24, and is close to normal. Integer sums are exact, so the result is the
# same bit for bit on every CPU (unlike `normal_`, whose vectorised Box-Muller varies by ISA).
_UNIFORM_BITS = 24
_UNIFORM_TERMS = 12


def _seeded_normal(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    import torch

    count = math.prod(shape)
    draws = torch.randint(
        0, 1 << _UNIFORM_BITS, (count, _UNIFORM_TERMS), generator=generator, dtype=torch.int64
    )
    total = draws.sum(dim=1)
    centered = total - _UNIFORM_TERMS * ((1 << _UNIFORM_BITS) - 1) // 2  # even product: exact mean
    scale = std / float(1 << _UNIFORM_BITS)  # a power-of-two division: exact
    values = centered.to(torch.float64) * scale  # one correctly rounded IEEE multiply
    return values.to(torch.float32).reshape(shape).contiguous()


# --------------------------------------------------------------------------- file contents


def _model_config() -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": SPEC.vocab_size,
        "hidden_size": SPEC.hidden_size,
        "intermediate_size": SPEC.intermediate_size,
        "num_hidden_layers": SPEC.num_hidden_layers,
        "num_attention_heads": SPEC.num_attention_heads,
        "num_key_value_heads": SPEC.num_key_value_heads,
        "head_dim": SPEC.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": SPEC.max_position_embeddings,
        "rms_norm_eps": SPEC.rms_norm_eps,
        "rope_theta": SPEC.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": SPEC.init_std,
        "torch_dtype": "float32",
        "use_cache": True,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": list(STOP_TOKEN_IDS),
        "pad_token_id": PAD_TOKEN_ID,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [EOT_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        # The generic fast tokenizer loads tokenizer.json as written; a Llama-specific class
        # would rebuild the pipeline from vocab and merges with its own pre-tokenizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [EOT_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
        "add_bos_token": True,
        "add_eos_token": False,
        # Cleanup would rewrite " ." as "." and break exact round trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": SPEC.max_position_embeddings,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
    }


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _safetensors_bytes(state: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    # `save` lays tensors out by (dtype, name), so the bytes depend only on the contents.
    return save(dict(sorted(state.items())), metadata={"format": "pt"})


def _write_bytes(out_dir: str, name: str, data: bytes) -> None:
    with open(os.path.join(out_dir, name), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # Makes the rename durable; not every platform allows opening a directory, hence best effort.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- CLI


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.builtin_model",
        description="Write the built-in tiny model (if needed) and print its directory last.",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="parent directory (default: $ENGINE_CACHE_DIR, else ~/.cache/engine)",
    )
    args = parser.parse_args(argv)
    from engine.utils.log_utils import configure_logging

    configure_logging("info")
    path = ensure_builtin_model(args.cache_dir)
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
