"""Every field of SGLang's GenerateReqInput and SamplingParams is accepted when null or default.

The field lists below are written out from SGLang's python/sglang/srt/managers/io_struct.py
(GenerateReqInput) and python/sglang/srt/sampling/sampling_params.py (SamplingParams), with
SGLang's defaults. A client of SGLang (its router, sglang.RuntimeEndpoint) that sends them unset
must be served; one that really uses a field we do not implement gets a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest
from pydantic import ValidationError

from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from engine.entrypoints.openai.sglang_fields import NATIVE_UNSUPPORTED, is_unset
from engine.tokenizer.tokenizer_manager import GenerateReqInput
from engine.sampling.sampling_params import SamplingParams

# GenerateReqInput: field -> SGLang's default. `text` (the prompt) is given by every case.
GENERATE_REQ_INPUT_FIELDS: Dict[str, Any] = {
    "rid": None, "session_id": None, "input_ids": None, "input_embeds": None, "image_data": None,
    "video_data": None, "audio_data": None, "mm_hashes": None, "mm_content_hashes": None,
    "use_audio_in_video": False, "video_config": None, "sampling_params": None, "return_logprob": None,
    "logprob_start_len": None, "top_logprobs_num": None, "token_ids_logprob": None,
    "return_sampling_mask": None, "return_text_in_logprobs": False, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False, "stream": False, "log_metrics": True,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_indexer_topk": False, "modalities": None, "session_params": None, "lora_path": None,
    "lora_id": None, "custom_logit_processor": None, "positional_embed_overrides": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "routed_dp_rank": None, "data_parallel_rank": None,
    "disagg_prefill_dp_rank": None, "kv_router_hint": None, "routing_key": None, "conversation_id": None,
    "http_worker_ipc": None, "background": False, "require_reasoning": False, "max_thinking_tokens": None,
    "priority": None, "extra_key": None, "no_logs": False, "custom_labels": None, "return_bytes": False,
    "return_entropy": False, "return_prompt_token_ids": False, "external_trace_header": None,
    "received_time": None, "need_wait_for_mm_inputs": None, "num_items_assigned": None,
    "encoder_urls": None, "max_dynamic_patch": None, "min_dynamic_patch": None,
    "image_max_dynamic_patch": None, "video_max_dynamic_patch": None, "images_config": None,
    "multi_item_delimiter_indices": None, "cache_salt": None,
}

# SamplingParams' API fields -> SGLang's default (top_k: SGLang's "whole vocabulary" value).
SAMPLING_PARAMS_FIELDS: Dict[str, Any] = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": 1 << 30, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "custom_params": None,
    "stream_interval": None, "logit_bias": None, "sampling_seed": None,
}

# The body sglang-router 0.3 forwards for {"text": ..., "sampling_params": {...}}.
ROUTER_BODY = {"text": "Hello", "model": None, "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
               "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
               "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
               "return_entropy": False}


@pytest.mark.parametrize("name", sorted(GENERATE_REQ_INPUT_FIELDS))
@pytest.mark.parametrize("value_kind", ["null", "default"])
def test_every_generate_field_is_accepted_null_or_default(name: str, value_kind: str) -> None:
    value = None if value_kind == "null" else GENERATE_REQ_INPUT_FIELDS[name]
    request = GenerateRequest.model_validate({"text": "a", name: value})
    assert request.text == "a"


def test_every_sampling_param_is_accepted_null_or_default() -> None:
    for name, default in SAMPLING_PARAMS_FIELDS.items():
        for value in (None, default):
            params = SamplingParams(**{name: value})
            params.verify(vocab_size=100)
    # null means the default, as in SGLang (max_new_tokens: null is "up to the context").
    assert SamplingParams(temperature=None, top_k=None, n=None, ignore_eos=None) == SamplingParams()
    assert SamplingParams(max_new_tokens=None).max_new_tokens is None


def test_the_router_body_is_accepted_and_means_the_plain_request() -> None:
    request = GenerateRequest.model_validate(ROUTER_BODY)
    assert (request.text, request.sampling_params, request.stream, request.log_metrics) == (
        "Hello", {"temperature": 0.0, "max_new_tokens": 4}, False, True)
    assert request.return_logprob is None and request.logprob_start_len is None
    obj = GenerateReqInput(text=request.text, sampling_params=request.sampling_params,
                           return_logprob=request.return_logprob, logprob_start_len=request.logprob_start_len,
                           top_logprobs_num=request.top_logprobs_num)
    obj.normalize()
    assert (obj.return_logprob, obj.logprob_start_len, obj.top_logprobs_num) == ([False], [-1], [0])


@pytest.mark.parametrize("name, value", [
    ("image_data", "http://x/cat.png"), ("input_embeds", [[0.1, 0.2]]), ("lora_id", "adapter-uid"),
    ("lora_id", ["adapter-uid", None]), ("bootstrap_pair_key", "k"), ("session_params", {"id": "s"}),
    ("disagg_prefill_dp_rank", 1), ("background", True), ("routed_experts_start_len", 2),
])
def test_an_unimplemented_field_in_use_is_refused_by_name(name: str, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        GenerateRequest.model_validate({"text": "a", name: value})
    assert f"{name} is not supported" in str(info.value)


def test_structural_tag_is_an_output_constraint() -> None:
    tag = '{"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a>"]}'
    assert SamplingParams(structural_tag=tag).constraint == ("structural_tag", tag)
    with pytest.raises(ValueError, match="Only one of json_schema, regex, ebnf and structural_tag"):
        SamplingParams(structural_tag=tag, regex="a").verify(100)


@pytest.mark.parametrize("name, value", [
    ("return_hidden_states", True), ("priority", 1), ("extra_key", "tenant"), ("cache_salt", "s"),
    ("token_ids_logprob", [3]), ("custom_logit_processor", "{}"), ("return_hidden_states", [True, False]),
])
def test_implemented_extras_are_accepted(name: str, value: Any) -> None:
    request = GenerateRequest.model_validate({"text": ["a", "b"], name: value})
    assert getattr(request, name) == value


def test_implemented_sampling_extras_are_checked() -> None:
    SamplingParams(stop_regex=["[0-9]+", "x"], stream_interval=2, custom_params={"k": 1}).verify(100)
    for bad in ({"stop_regex": "("}, {"stop_regex": [""]}, {"stream_interval": 0}, {"custom_params": [1]},
                {"stop_regex": ["a"] * 33}):
        with pytest.raises(ValueError):
            SamplingParams(**bad).verify(100)


@pytest.mark.parametrize("body", [
    {"text": "a", "return_hidden_states": 0}, {"text": "a", "priority": "high"},
    {"text": "a", "model": 5}, {"text": "a", "custom_labels": {"k": 1}}, {"text": "a", "log_metrics": "yes"},
    {"text": "a", "received_time": "now"}, {"text": "a", "stream": 1}, {"text": "a", "unknown_field": 1},
    {"text": "a", "top_logprobs_num": 21}, {"input_ids": None},
])
def test_bad_values_are_still_refused(body: Dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate(body)


def test_unset_means_nothing_asked() -> None:
    for name, (unset_values, _) in NATIVE_UNSUPPORTED.items():
        for value in unset_values:
            assert is_unset(value, unset_values) and is_unset([value, value], unset_values), name
    assert not is_unset(0, (None, False)) and not is_unset(False, (None, 0))


def test_openai_requests_refuse_sglang_extras_in_use() -> None:
    ok = CompletionRequest(prompt="x", regex=None, lora_path=None, continue_final_message=False, priority=None)
    assert ok.prompt == "x"
    chat = {"messages": [{"role": "user", "content": "hi"}], "separate_reasoning": True, "stream_reasoning": True,
            "continue_final_message": False, "return_hidden_states": False}
    assert ChatCompletionRequest(**chat).messages[0].text() == "hi"
    assert ChatCompletionRequest(**{**chat, "priority": 3, "cache_salt": "s", "stop_regex": "x"}).priority == 3
    # lora_path is served (LoRA adapters); session_params is not.
    assert ChatCompletionRequest(**{**chat, "lora_path": "adapter"}).generate_extras()["lora_path"] == "adapter"
    for extra in ({"structural_tag": "{}"}, {"session_params": {"id": "s"}}):
        with pytest.raises(ValidationError) as info:
            ChatCompletionRequest(**{**chat, **extra})
        assert f"{next(iter(extra))} is not supported" in str(info.value)


# DP-aware routing: SGLang's gateway names the replica of every request.
@pytest.mark.parametrize("name", ["routed_dp_rank", "data_parallel_rank"])
def test_dp_rank_fields_are_accepted_and_reach_the_scheduler_request(name: str) -> None:
    from engine.tokenizer.request_normalizer import RequestNormalizer

    body = GenerateRequest.model_validate({"text": "a", name: 1})
    assert (body.routed_dp_rank if name == "routed_dp_rank" else body.data_parallel_rank) == 1
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 name: 1})
    assert chat.generate_extras()[name] == 1
    CompletionRequest.model_validate({"model": "m", "prompt": "x", name: 0})
    obj = GenerateReqInput(input_ids=[1, 2, 3], **{name: 1})
    obj.normalize()
    tokenized = RequestNormalizer(None, 100, 64, dp_size=2).tokenize_one(obj, 0, [1, 2, 3])
    assert tokenized.options.routed_dp_rank == 1
    plain = GenerateReqInput(input_ids=[1, 2, 3])
    plain.normalize()
    assert RequestNormalizer(None, 100, 64, dp_size=2).tokenize_one(plain, 0, [1, 2, 3]).options.routed_dp_rank is None


def test_a_dp_rank_outside_the_replicas_is_a_400() -> None:
    from engine.errors import EngineRequestError
    from engine.tokenizer.request_normalizer import RequestNormalizer

    normalizer = RequestNormalizer(None, 100, 64, dp_size=2)
    for rank in (2, 7):
        obj = GenerateReqInput(input_ids=[1, 2, 3], routed_dp_rank=rank)
        obj.normalize()
        with pytest.raises(EngineRequestError, match=r"routed_dp_rank must be in \[0, 2\)"):
            normalizer.tokenize_one(obj, 0, [1, 2, 3])
    for bad in (-1, True, "1"):
        with pytest.raises(EngineRequestError, match="non-negative integer"):
            GenerateReqInput(input_ids=[1], data_parallel_rank=bad).normalize()  # type: ignore[arg-type]
    with pytest.raises(EngineRequestError, match="different ranks"):
        GenerateReqInput(input_ids=[1], routed_dp_rank=0, data_parallel_rank=1).normalize()


def test_embedding_requests_still_refuse_a_dp_rank() -> None:
    from engine.entrypoints.openai.embedding_protocol import EncodeRequest

    with pytest.raises(ValidationError, match="routed_dp_rank is not supported"):
        EncodeRequest.model_validate({"text": "a", "routed_dp_rank": 0})
