"""SGLang request fields this engine does not implement: accepted when unset, a 400 when used.

SGLang's clients (its router, `sglang.RuntimeEndpoint`, scripts written against SGLang) send many
fields of `GenerateReqInput`, most of them as null or at their default. Such a request must work
here exactly as on SGLang; a request that really asks for a feature we lack (an image, a session,
a regex) must get a clear 400 that names the field, never a silently different answer.

Each table maps a field to the values that mean "not used" and to what the field would need.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from engine.request_options import OPTION_FIELDS

# Values that mean "feature not used": null, and the field's SGLang default.
_NULL: Tuple[Any, ...] = (None,)
_FALSE: Tuple[Any, ...] = (None, False)
_ZERO: Tuple[Any, ...] = (None, 0)
_EMPTY_STR: Tuple[Any, ...] = (None, "")

_MULTIMODAL = "multimodal input is not implemented"
# bootstrap_host/port/room are implemented (PD disaggregation); these extras are not.
_DISAGG = "this PD feature is not implemented (a prefill pair key, a prefill DP rank, decode TP hints)"
_MOE = "MoE routing data is not implemented"

# Top-level fields of SGLang's GenerateReqInput (python/sglang/srt/managers/io_struct.py).
NATIVE_UNSUPPORTED: Dict[str, Tuple[Tuple[Any, ...], str]] = {
    "input_embeds": (_NULL, "input embeddings are not implemented: send text or input_ids"),
    "image_data": (_NULL, _MULTIMODAL),
    "video_data": (_NULL, _MULTIMODAL),
    "audio_data": (_NULL, _MULTIMODAL),
    "mm_hashes": (_NULL, _MULTIMODAL),
    "mm_content_hashes": (_NULL, _MULTIMODAL),
    "use_audio_in_video": (_FALSE, _MULTIMODAL),
    "video_config": (_NULL, _MULTIMODAL),
    "modalities": (_NULL, _MULTIMODAL),
    "max_dynamic_patch": (_NULL, _MULTIMODAL),
    "min_dynamic_patch": (_NULL, _MULTIMODAL),
    "image_max_dynamic_patch": (_NULL, _MULTIMODAL),
    "video_max_dynamic_patch": (_NULL, _MULTIMODAL),
    "images_config": (_NULL, _MULTIMODAL),
    "need_wait_for_mm_inputs": (_FALSE, _MULTIMODAL),
    "num_items_assigned": (_NULL, _MULTIMODAL),
    "encoder_urls": (_NULL, _MULTIMODAL),
    "return_sampling_mask": (_FALSE, "sampling masks are not implemented"),
    "return_flat_raw_top_logprobs": (_FALSE, "flat top-logprob arrays are not implemented"),
    "return_flat_raw_top_logprobs_b64": (_FALSE, "flat top-logprob arrays are not implemented"),
    "return_routed_experts": (_FALSE, _MOE),
    "routed_experts_start_len": (_ZERO, _MOE),
    "return_indexer_topk": (_FALSE, _MOE),
    "session_params": (_NULL, "sessions are not implemented"),
    # lora_path is a request option (request_options.py); SGLang's lora_id is its server's internal id.
    "lora_id": (_NULL, "lora_id is assigned by the server: name the adapter in lora_path"),
    "positional_embed_overrides": (_NULL, "embedding overrides are not implemented"),
    "bootstrap_pair_key": (_NULL, _DISAGG),
    "decode_tp_size": (_NULL, _DISAGG),
    "disagg_prefill_dp_rank": (_NULL, _DISAGG),
    # Implemented on /generate and the OpenAI routes (GENERATE_UNSUPPORTED), not on /encode.
    "routed_dp_rank": (_NULL, "routing an embedding request to a data-parallel rank is not implemented"),
    "data_parallel_rank": (_NULL, "routing an embedding request to a data-parallel rank is not implemented"),
    "background": (_FALSE, "background requests are not implemented"),
    "max_thinking_tokens": (_NULL, "reasoning control is not implemented"),
    "return_bytes": (_FALSE, "image generation is not implemented"),
    "return_entropy": (_FALSE, "returning the entropy is not implemented"),
    "return_prompt_token_ids": (_FALSE, "prompt token ids are returned by /generate only"),
    "multi_item_delimiter_indices": (_NULL, "multi-item scoring is not implemented"),
}

# SGLang's gateway in DP-aware mode names the replica of every request (routed_dp_rank, or the older
# data_parallel_rank): /generate and the OpenAI routes take them (fields of the request models).
DP_RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")
# /generate takes every request option (request_options.py) as a field of its own.
GENERATE_UNSUPPORTED: Dict[str, Tuple[Tuple[Any, ...], str]] = {
    name: entry for name, entry in NATIVE_UNSUPPORTED.items() if name not in DP_RANK_FIELDS and name not in OPTION_FIELDS}

# SGLang's extra fields of the OpenAI requests (python/sglang/srt/entrypoints/openai/protocol.py)
# that change what is generated. The implemented ones (regex, ebnf, json_schema,
# separate_reasoning, stream_reasoning, chat_template_kwargs, continue_final_message) are fields of
# the request models.
OPENAI_UNSUPPORTED: Dict[str, Tuple[Tuple[Any, ...], str]] = {
    "structural_tag": (_NULL, "on this route a structural tag is a response_format of type 'structural_tag'"),
    **{name: NATIVE_UNSUPPORTED[name] for name in (
        "session_params", "return_routed_experts", "return_prompt_token_ids",
    )},
}


def is_unset(value: Any, unset_values: Tuple[Any, ...]) -> bool:
    """True when `value` (or, for a per-prompt list, each of its items) asks for nothing."""
    if isinstance(value, list):
        return all(is_unset(item, unset_values) for item in value)
    # Compared with the type: `0` must not pass for `false`, nor `false` for `0`.
    return any(value is None if u is None else (type(value) is type(u) and value == u) for u in unset_values)


def refuse_unsupported(data: Any, table: Mapping[str, Tuple[Tuple[Any, ...], str]]) -> Any:
    """`data` without the table's fields; ValueError naming the first one that is really used."""
    if not isinstance(data, dict):
        return data  # pydantic reports the wrong body type itself
    kept = dict(data)
    for name, (unset_values, reason) in table.items():
        if name not in kept:
            continue
        value = kept.pop(name)
        if not is_unset(value, unset_values):
            raise ValueError(f"{name} is not supported by this server ({reason}); leave it out or send "
                             f"{_spell(unset_values[-1])}")
    return kept


def _spell(value: Any) -> str:
    if isinstance(value, bool):
        return "false"
    return "0" if isinstance(value, int) else "null"
