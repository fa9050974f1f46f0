"""Server arguments: one dataclass, turned into argparse flags with SGLang's names."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Union, get_args, get_origin, get_type_hints

from engine.parsers.reasoning import REASONING_PARSER_NAMES, reasoning_parser_error
from engine.disaggregation.server_args_check import (DISAGGREGATION_MODES, DISAGGREGATION_TRANSFER_BACKENDS,
                                                    check_disaggregation_server_args)

logger = logging.getLogger(__name__)

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "routing-key")
ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# SGLang's --quantization names we accept (engine/layers/quant_config.py QUANTIZATION_METHODS): applied at
# load to a bf16/fp16/fp32 checkpoint, or naming a pre-quantized checkpoint's format.
# The ones applied at load (--quantize-lm-head takes their method for the head).
ONLINE_QUANTIZATION = ("w8a8_int8", "fp8")
# Methods whose checkpoints may hold 4-bit linears with a float head (--quantize-lm-head applies: model_runner.py).
PREQUANTIZED_4BIT = ("compressed-tensors", "awq", "gptq", "awq_marlin", "gptq_marlin")
QUANTIZATION_METHODS = ("w8a8_int8", "fp8", "compressed-tensors", "awq", "gptq", "awq_marlin", "gptq_marlin", "mxfp4")
# SGLang's --kv-cache-dtype names (engine/mem_cache/memory_pool.py KV_CACHE_DTYPES).
KV_CACHE_DTYPE_NAMES = ("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")
GRAMMAR_BACKENDS = ("xgrammar", "none")
# Output formats of tool calls (parsers/tool_calls.py); reasoning formats: REASONING_PARSER_NAMES.
TOOL_CALL_PARSERS = ("llama3", "qwen25", "qwen", "hermes", "mistral", "pythonic")
# --max-queued-requests when not given (docs/security.md).
DEFAULT_MAX_QUEUED_REQUESTS = 4096


class ServerArgsError(ValueError):
    """An inconsistent or out-of-range server argument."""


def arg(default: Any, help: str, choices: Optional[Sequence[str]] = None) -> Any:
    """A ServerArgs field with its --help text (every flag has one: tests/unit/test_server_args.py) and,
    for a flag with a fixed set of values, its choices. The flag's type comes from the annotation."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ServerArgs:
    # Model and tokenizer
    model_path: Optional[str] = arg(None, "Hugging Face model directory (config.json, *.safetensors, tokenizer "
                                          "files). Default: the built-in tiny model, written to the cache on first use.")
    tokenizer_path: Optional[str] = arg(None, "Tokenizer directory, when it is not the model's.")
    served_model_name: Optional[str] = arg(None, "The model name the OpenAI API reports and accepts. Default: the "
                                                 "model path (engine-builtin for the built-in model).")
    chat_template: Optional[str] = arg(None, "A Jinja chat template (a file or the template text) instead of the "
                                             "tokenizer's.")
    dtype: str = arg("auto", "Weights and activations: auto (the checkpoint's; bfloat16 for a float32 checkpoint "
                             "on CUDA), float32, bfloat16 or float16 (bfloat16 on the CPU).", choices=DTYPES)
    quantization: Optional[str] = arg(None, (
        "Quantize the linear layers' weights at load, per output channel: w8a8_int8 (int8) or fp8 (float8 "
        "e4m3); the LM head (unless --quantize-lm-head) and embeddings keep --dtype. A pre-quantized "
        "checkpoint (compressed-tensors 8-bit, awq or gptq 4-bit, gpt-oss's mxfp4 experts) is detected from "
        "its config.json; naming its method (awq_marlin / gptq_marlin mean awq / gptq) is optional, naming "
        "another is refused. Default: none (the checkpoint's)."),
        choices=QUANTIZATION_METHODS)
    quantize_lm_head: bool = arg(False, (
        "Not an SGLang flag: with --quantization w8a8_int8 or fp8, quantize the LM head too, per vocabulary row "
        "(the largest weight a small decode step reads); on a 4-bit checkpoint (AWQ, GPTQ, compressed-tensors "
        "W4A16) whose head is float, quantize the head to int8 as w8a8_int8 does (llama.cpp's Q4_K_M files "
        "keep a 6-bit head); tied embeddings keep --dtype. Off by default, as SGLang keeps the head in --dtype."))
    kv_cache_dtype: str = arg("auto", (
        "The KV cache's element type: auto (the model's dtype), fp8_e5m2 or fp8_e4m3 (one byte per element, "
        "scaled by the checkpoint's per-layer k_scale / v_scale, 1.0 without them: about twice the tokens "
        "in the same memory), bf16 / bfloat16."), choices=KV_CACHE_DTYPE_NAMES)
    context_length: Optional[int] = arg(None, "The longest sequence (prompt + output). Default: the model's "
                                              "max_position_embeddings (its sliding window, if shorter; a "
                                              "sentence-transformers model's max_seq_length, if shorter).")
    trust_remote_code: bool = arg(False, "Let the tokenizer run code shipped with the model.")
    skip_tokenizer_init: bool = arg(False, "Serve without a tokenizer: requests give input_ids and get output_ids.")
    is_embedding: bool = arg(False, "Serve the model as an embedding model (/v1/embeddings, /encode) even when its "
                                    "architecture is a generative one: last-token pooling, normalised. BertModel, "
                                    "MistralModel, ... and sentence-transformers directories embed without it.")

    # HTTP
    host: str = arg("127.0.0.1", "The address to serve HTTP on.")
    port: int = arg(30000, "The port to serve HTTP on.")
    api_key: Optional[str] = arg(None, "Require 'Authorization: Bearer <key>' on every route but /health.")
    admin_api_key: Optional[str] = arg(None, (
        "The key of the operator routes (weights, memory, pause/continue, /flush_cache, /abort_request), as "
        "SGLang's flag: with it those routes take this key only and --api-key no longer opens them; the other "
        "routes keep --api-key (open without one). See docs/security.md."))
    # Slow and idle clients (entrypoints/http_protocol.py); per HTTP process, workers included.
    http_header_timeout: float = arg(15.0, "Seconds a client may take to send a request's head (from the "
                                           "connection, or from the first byte of a later request); then 408.")
    http_body_timeout: float = arg(60.0, "Seconds a client may take to send a request's body after its head; "
                                         "then 408. Responses (streams) have no deadline.")
    http_keep_alive_timeout: int = arg(5, "Seconds an idle connection stays open after a response.")
    http_max_header_bytes: int = arg(65536, "The largest request head (request line and headers) accepted; "
                                            "larger: 431.")
    http_max_connections: Optional[int] = arg(None, (
        "Open connections per HTTP process. Beyond it a new connection closes the oldest one that waits on "
        "its client (idle, or sending its request); 503 when all are being answered. Default: the open-file "
        "limit (raised at start-up up to 65536 where the hard limit allows) less a reserve."))
    tokenizer_worker_num: int = arg(1, (
        "HTTP worker processes, each with its own TokenizerManager, sharing the port (SGLang's flag): for "
        "thousands of concurrent streams, whose HTTP and output handling one process cannot keep up with. "
        "The offline Engine has none."))

    # Memory and scheduling
    mem_fraction_static: Optional[float] = arg(None, "Share of the free memory (GPU memory after the weights, "
                                                     "or RAM on the CPU) for the KV cache when "
                                                     "--max-total-tokens is not given. Default 0.88 on CUDA, "
                                                     "0.3 on the CPU.")
    max_total_tokens: Optional[int] = arg(None, "The KV cache size in tokens (overrides --mem-fraction-static).")
    max_running_requests: Optional[int] = arg(None, "Requests decoded together. Default: derived from the KV "
                                                    "cache size.")
    # SGLang has no default limit; every waiting request holds its prompt (~50 bytes a token in the
    # scheduler, as much again in the HTTP process), so an unbounded queue grows with the load.
    max_queued_requests: Optional[int] = arg(DEFAULT_MAX_QUEUED_REQUESTS, (
        "Waiting requests beyond which new ones get HTTP 503 (a retracted request is never refused). "
        f"Default {DEFAULT_MAX_QUEUED_REQUESTS} (SGLang: no limit); docs/security.md."))
    max_prefill_tokens: int = arg(16384, "Prompt tokens admitted into one prefill batch.")
    chunked_prefill_size: Optional[int] = arg(None, "Prompt tokens per prefill chunk; -1 disables chunking. "
                                                    "Default 8192 on CUDA, 2048 on the CPU.")
    page_size: int = arg(1, "Tokens per KV page (a power of two); prefixes are shared page by page.")
    schedule_policy: str = arg("fcfs", "Order of the waiting queue: fcfs, lpm (longest cached prefix first), "
                                       "dfs-weight (radix-tree order), lof (longest output first), random, "
                                       "routing-key (requests whose routing_key is most frequent among the "
                                       "running ones first).", choices=SCHEDULE_POLICIES)
    schedule_conservativeness: float = arg(1.0, "Scales the decode-token reservation of running requests: "
                                                "higher admits fewer new requests (fewer retractions).")
    disable_radix_cache: bool = arg(False, "No prefix sharing between requests.")
    disable_hybrid_swa_memory: bool = arg(False, (
        "Sliding-window models: keep every token of the windowed layers in the one KV pool. Without it, "
        "with page size 1, the torch_native or triton backend and no draft-model speculative decoding, "
        "windowed layers get a second pool holding only what their windows (and the SWA radix cache) still need."))
    disable_overlap_schedule: bool = arg(False, "Schedule the next batch after the forward instead of during it.")
    # SGLang's SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP (default off: prefills in a row overlap).
    disable_consecutive_prefill_overlap: bool = arg(False, (
        "With the overlap scheduler, process a prefill's result before launching the next prefill "
        "instead of during it: better time to first token for back-to-back prefills, slightly less "
        "throughput (SGLang's SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP)."))
    enable_mixed_chunk: bool = arg(False, "Running decode requests ride along with prefill chunks. The default "
                                          "on the CPU (see --disable-mixed-chunk); off on CUDA, as in SGLang.")
    disable_mixed_chunk: bool = arg(False, "On the CPU: decoding stops while a prefill chunk runs (SGLang's "
                                           "default) instead of riding along with it.")
    stream_interval: int = arg(1, "Stream every N-th token (larger: fewer, bigger chunks).")
    incremental_streaming_output: bool = arg(
        False, "Streamed /generate (and Engine) chunks carry only what is new: the text, output_ids and output "
               "logprobs since the previous chunk, instead of everything so far (SGLang's flag). The OpenAI routes "
               "stream deltas either way.")
    req_waiting_timeout: float = arg(0.0, "Seconds a request may wait in the queue before it is aborted with "
                                          "HTTP 503; 0: no limit. Not synchronised across TP ranks: leave it "
                                          "at 0 with --tp-size > 1.")

    # Structured outputs, tool calls and reasoning
    grammar_backend: str = arg("xgrammar", "Constrained decoding (json_schema, regex, ebnf, response_format, "
                                           "forced tool choices): xgrammar, or none to refuse such requests.", choices=GRAMMAR_BACKENDS)
    constrained_json_disable_any_whitespace: bool = arg(
        False, "Constrained JSON without free whitespace between tokens (compact JSON): a model can no longer "
               "pad its output with endless spaces or newlines.")
    grammar_timeout: float = arg(300.0, "Seconds a request may wait for its grammar to compile; then it is "
                                        "refused (HTTP 400) and the constraint is remembered as failed.")
    tool_call_parser: Optional[str] = arg(None, "The format of the model's tool calls, parsed for tool_choice "
                                                "auto: llama3, qwen25 (qwen, hermes), mistral, pythonic.", choices=TOOL_CALL_PARSERS)
    reasoning_parser: Optional[str] = arg(None, "Split <think> reasoning into reasoning_content, with SGLang's "
                                                "parser names: " + ", ".join(REASONING_PARSER_NAMES) + ".")

    # Priority scheduling (SGLang's flags)
    enable_priority_scheduling: bool = arg(False, (
        "Order the waiting queue by each request's `priority` (higher values first unless "
        "--schedule-low-priority-values-first), preempt lower-priority running requests, and let a "
        "full queue (--max-queued-requests) drop its lowest-priority request for a better one."))
    disable_priority_preemption: bool = arg(False, "With --enable-priority-scheduling: order the queue by priority "
                                                   "but never preempt running requests.")
    default_priority_value: Optional[int] = arg(None, "The priority of a request that gives none (default: the "
                                                      "least urgent value there is).")
    abort_on_priority_when_disabled: bool = arg(False, "Without --enable-priority-scheduling, refuse (503) a "
                                                       "request that gives a priority instead of ignoring it.")
    schedule_low_priority_values_first: bool = arg(False, "With --enable-priority-scheduling: smaller priority "
                                                          "values are more urgent.")
    priority_scheduling_preemption_threshold: int = arg(10, "How much more urgent a waiting request must be than "
                                                            "a running one to preempt it.")

    # Per-request extras
    allow_auto_truncate: bool = arg(False, "Truncate a prompt longer than the maximum input length (keeping its "
                                           "first tokens, as SGLang) instead of refusing it with 400; for "
                                           "embedding inputs, texts keep their end token.")
    enable_custom_logit_processor: bool = arg(False, (
        "Accept requests' `custom_logit_processor` (a serialized Python callable that the scheduler "
        "deserializes and runs: enable only for trusted clients)."))

    # Execution
    device: str = arg("auto", "auto (cuda when available), cpu or cuda.", choices=DEVICES)
    attention_backend: Optional[str] = arg(None, "torch_native (default on the CPU), triton (default on CUDA) "
                                                 "or flashinfer (CUDA, when installed).", choices=ATTENTION_BACKENDS)
    random_seed: int = arg(0, "Seed of the model's initialisation and of unseeded sampling.")
    disable_cuda_graph: bool = arg(False, "Run decode batches without CUDA graphs.")
    cuda_graph_max_bs: int = arg(160, "The largest decode batch captured in a CUDA graph.")
    threads_per_rank: Optional[int] = arg(None, "CPU only: intra-op threads of each scheduler rank. Default: "
                                                "the cores of this machine shared equally by its ranks.")
    simulated_device_forward_ms: Optional[str] = arg(None, (
        "Benchmarks and tests only: 'A' or 'A,B' replaces the model by a simulated accelerator whose "
        "forward takes A + B x (tokens in the batch) ms of wall time without using the CPU and samples "
        "deterministic tokens (never EOS); scheduling, radix cache, KV accounting, detokenizer and HTTP "
        "run for real. Reads only config.json and the tokenizer of the model; runs on --device cpu with "
        "--tp-size 1."))

    # Speculative decoding (SGLang's flags: engine/speculative/).
    speculative_algorithm: Optional[str] = arg(None, (
        "NGRAM: each decode step verifies tokens proposed by matching the request's latest tokens "
        "earlier in its prompt and output. STANDALONE: a smaller draft model "
        "(--speculative-draft-model-path, same tokenizer) proposes them. EAGLE: an EAGLE head "
        "(LlamaForCausalLMEagle) proposes them from the target's hidden states; EAGLE3: an EAGLE3 head "
        "(LlamaForCausalLMEagle3) from three of the target's layers. Exact in every case: "
        "greedy output is unchanged, sampling keeps the target distribution. NEXTN: DeepSeek-V3's "
        "multi-token prediction layer as an EAGLE head (run as EAGLE, as SGLang; the draft path defaults "
        "to --model-path, whose checkpoint keeps the layer)."))
    speculative_draft_model_path: Optional[str] = arg(None, "STANDALONE, EAGLE, EAGLE3: the draft model's (or "
                                                            "EAGLE / EAGLE3 head's) directory. NEXTN: the "
                                                            "DeepSeek-V3 checkpoint holding the MTP layer "
                                                            "(default: --model-path).")
    speculative_num_steps: Optional[int] = arg(None, (
        "STANDALONE, EAGLE: draft forwards per verify step (the drafts of a chain). Default 3 (SGLang's "
        "default for STANDALONE), with --speculative-eagle-topk 1 and --speculative-num-draft-tokens 4."))
    speculative_eagle_topk: Optional[int] = arg(None, (
        "STANDALONE, EAGLE, EAGLE3, NEXTN: draft tokens kept per step: 1 drafts a chain, more a tree of "
        "--speculative-num-draft-tokens nodes verified under a tree mask."))
    speculative_num_draft_tokens: Optional[int] = arg(None, (
        "Tokens one verify step checks per request: the last token plus up to N-1 drafts. "
        "Default for NGRAM: --speculative-ngram-max-match-window-size; for a chain draft model it is "
        "--speculative-num-steps + 1 (set so when given otherwise, as SGLang)."))
    speculative_batch_size_threshold: Optional[int] = arg(None, (
        "Decode batches with more running requests than this take the plain decode step instead of "
        "a verify step (speculation costs more than it saves once a batch is compute-bound). "
        "Default: 4 on the CPU (measured: benchmarks/bench_speculative.py --verify-cost), no limit on "
        "CUDA (as SGLang)."))
    disable_speculative_adaptive: bool = arg(False, (
        "Verify drafts at every eligible decode step. By default the scheduler measures the accept length "
        "and the cost of a verify step against a plain decode step, per batch size, and decodes plainly "
        "(probing now and then) where drafts do not pay (engine/speculative/switch.py). SGLang has no such "
        "default; its opt-in --speculative-adaptive tunes the number of steps instead."))
    speculative_ngram_min_match_window_size: int = arg(1, "NGRAM: the shortest suffix of the request's "
                                                          "tokens that is matched.")
    speculative_ngram_max_match_window_size: int = arg(12, "NGRAM: the longest suffix of the request's "
                                                           "tokens that is matched.")

    # Multi-LoRA serving (SGLang's flags; engine/lora/).
    enable_lora: bool = arg(False, "Serve LoRA adapters (PEFT format) over the base model; implied by --lora-paths.")
    lora_paths: Optional[List[str]] = arg(None, (
        "Adapters loaded at start-up: 'name=path', a plain path (its name is the path) or JSON "
        "'{\"lora_name\": ..., \"lora_path\": ..., \"pinned\": ...}'."))
    max_loras_per_batch: int = arg(8, "Distinct adapters one batch may use (requests of the base model do not "
                                      "count); also the adapter slots of the memory pool.")
    max_lora_rank: Optional[int] = arg(None, "The largest adapter rank served. Default: the largest rank of "
                                             "--lora-paths (16 without any).")
    lora_target_modules: Optional[List[str]] = arg(None, (
        "Projections adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or 'all'. "
        "Default: those of --lora-paths (all without any)."))
    max_loaded_loras: Optional[int] = arg(None, "Adapters kept in host memory at once (loaded adapters); "
                                                "default: no limit beyond MAX_LOADED_LORAS.")
    lora_backend: str = arg("auto", "The LoRA product: auto (triton on CUDA, torch_native on the CPU), triton or "
                                    "torch_native.", choices=("auto", "triton", "torch_native"))

    # Parallelism
    tp_size: int = arg(1, "Tensor parallelism: scheduler ranks that shard the model.")
    dp_size: int = arg(1, "Data parallelism: model replicas behind one endpoint.")
    ep_size: int = arg(1, "Expert parallelism of mixture-of-experts layers: the TP ranks form ep-size groups, "
                          "each holding 1/ep-size of the experts (must divide --tp-size; no effect on dense models).")
    load_balance_method: str = arg("round_robin", "How --dp-size replicas share requests: round_robin or "
                                                  "shortest_queue.", choices=LOAD_BALANCE_METHODS)
    nnodes: int = arg(1, "Machines that tensor parallelism spans.")
    node_rank: int = arg(0, "This machine's index among --nnodes (node 0 serves HTTP).")
    dist_init_addr: Optional[str] = arg(None, "host:port of node 0 for the multi-node rendezvous.")
    dist_timeout: float = arg(600.0, "Seconds a rank waits for its peers at start-up and in a collective.")

    # Prefill/decode disaggregation: SGLang's flags; the timeouts and the heartbeat are its
    # SGLANG_DISAGGREGATION_* environment variables (docs/architecture.md, "PD disaggregation").
    disaggregation_mode: str = arg("null", "null (a unified server), prefill (runs prompts and sends their KV) or "
                                           "decode (receives the KV and generates); put sglang-router in "
                                           "--pd-disaggregation mode in front of both.", choices=DISAGGREGATION_MODES)
    disaggregation_transfer_backend: str = arg("tcp", "How KV moves: tcp (ZMQ, between processes and machines), "
                                                      "fake (no prefill: a synthetic first token; decode-only "
                                                      "benchmarks) or loopback (in-process tests only).", choices=DISAGGREGATION_TRANSFER_BACKENDS)
    disaggregation_bootstrap_port: int = arg(8998, "Prefill: the port of its bootstrap server, which decode "
                                                   "servers ask where to send their destinations (give it to the "
                                                   "router with --prefill URL PORT).")
    disaggregation_decode_polling_interval: int = arg(1, "Decode: poll the transfer queues every N scheduler "
                                                         "iterations.")
    num_reserved_decode_tokens: int = arg(512, "Decode: KV tokens kept free for every live request when a new "
                                               "transfer is admitted.")
    disaggregation_prealloc_reqs: Optional[int] = arg(None, "Decode: request slots for requests that wait for or "
                                                            "receive their KV, beyond --max-running-requests "
                                                            "(default: as many).")
    disaggregation_bootstrap_timeout: float = arg(300.0, "Seconds a prefill waits for the decode side to reserve "
                                                         "memory for a request (SGLANG_DISAGGREGATION_BOOTSTRAP_"
                                                         "TIMEOUT).")
    disaggregation_waiting_timeout: float = arg(300.0, "Seconds a decode waits for a request's KV once its "
                                                       "memory is reserved (SGLANG_DISAGGREGATION_WAITING_TIMEOUT).")
    disaggregation_heartbeat_interval: float = arg(5.0, "Decode: seconds between probes of each prefill's "
                                                        "bootstrap server (SGLANG_DISAGGREGATION_HEARTBEAT_"
                                                        "INTERVAL).")
    disaggregation_heartbeat_max_failures: int = arg(2, "Decode: missed probes after which a prefill counts as "
                                                        "dead and its requests fail (SGLANG_DISAGGREGATION_"
                                                        "HEARTBEAT_MAX_FAILURE).")
    disaggregation_host: Optional[str] = arg(None, "The address other servers reach this one's KV transfer "
                                                   "socket at. Default: --host, or this machine's outbound "
                                                   "address when --host is a wildcard.")
    disaggregation_secret: Optional[str] = arg(None, "A shared secret that authenticates every PD bootstrap and "
                                                     "KV transfer message (HMAC-SHA256); the same on every prefill "
                                                     "and decode server. Prefer the environment variable "
                                                     "ENGINE_DISAGGREGATION_SECRET (keeps it off the command line). "
                                                     "Without one the PD planes are open (docs/security.md).")
    disaggregation_prefill_allowlist: Optional[str] = arg(None, "Decode: the prefill bootstrap servers a request "
                                                                "may name, comma-separated host[:port] entries (an "
                                                                "IP, a CIDR network, a host name, or * for any). "
                                                                "Default: loopback plus --host and "
                                                                "--disaggregation-host (docs/security.md).")

    # Observability and robustness
    log_level: str = arg("info", "debug, info, warning, error or critical.")
    log_requests: bool = arg(False, "Log each request's arrival and finish (rid, reason, tokens, text).")
    enable_metrics: bool = arg(False, "Serve Prometheus metrics on /metrics.")
    tokenizer_metrics_allowed_custom_labels: Optional[List[str]] = arg(None, (
        "Label names a request may add to its request metrics (custom_labels on /generate and the Engine, "
        "the --tokenizer-metrics-custom-labels-header JSON header on the OpenAI routes); others are dropped."))
    tokenizer_metrics_custom_labels_header: str = arg("x-custom-labels", (
        "The HTTP header whose JSON object gives an OpenAI request's custom metric labels."))
    decode_log_interval: int = arg(40, "Log one decode-batch line every N decode steps.")
    watchdog_timeout: float = arg(300.0, "Seconds a forward may make no progress before the server is "
                                         "taken down.")
    health_check_timeout: float = arg(20.0, "Seconds /health_generate waits for its probe to make progress.")
    control_timeout: float = arg(60.0, "Seconds a control call (/flush_cache, /get_server_info, ...) waits "
                                       "for the scheduler's reply.")
    enable_pickled_weight_updates: bool = arg(False, (
        "Accept SGLang's pickled tensors (MultiprocessingSerializer) in /update_weights_from_tensor, as "
        "colocated RL trainers send them (CUDA IPC handles). Unpickling client data runs code and opens "
        "memory by handle: enable only for trusted clients (docs/security.md); safetensors payloads need no flag."))
    weight_version: str = arg("default", "The version of the loaded weights, as reported by /get_weight_version "
                                         "and every output's meta_info (weight updates may set a new one).")
    weight_update_timeout: float = arg(1800.0, "Seconds a weight update or a memory release / resume waits for "
                                               "the scheduler's reply (loading a large checkpoint takes a while).")
    startup_timeout: float = arg(900.0, "Seconds the launcher waits for its processes to load the model.")
    strict_memory_check: bool = arg(False, (
        "Make the idle memory self-check fatal: a KV or request-slot leak stops the scheduler and "
        "the server exits non-zero with the leak in its log (the tests run this way). Without it "
        "each distinct leak is logged once as an ERROR and the server keeps serving."))

    def __post_init__(self) -> None:
        self.resolve_defaults()
        self.check()

    # ------------------------------------------------------------------ defaults
    def resolve_defaults(self) -> None:
        if self.device == "auto":
            # The simulated accelerator keeps its (index-only) pools in host memory.
            self.device = "cpu" if self.simulated_device_forward_ms is not None else _default_device()
        if self.attention_backend is None:
            self.attention_backend = "triton" if self.device == "cuda" else "torch_native"
        if self.served_model_name is None:
            self.served_model_name = self.model_path or "engine-builtin"
        if self.mem_fraction_static is None:
            self.mem_fraction_static = 0.88 if self.device == "cuda" else 0.3
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = 8192 if self.device == "cuda" else 2048
        # On the CPU, decoding rides along with prefill chunks unless told not to: with prefill
        # first and a steady stream of arrivals, running requests otherwise stop for whole chunks
        # (measured on the Poisson workload of docs/benchmarks.md: ITL max 23 s without, 2 s with).
        # CUDA keeps SGLang's default (off).
        # A PD server has nothing to mix (no decoding on a prefill server, no prefill on a decode one).
        if (self.device == "cpu" and not self.disable_mixed_chunk and self.chunked_prefill_size is not None
                and self.chunked_prefill_size > 0 and self.disaggregation_mode == "null"):
            self.enable_mixed_chunk = True
        if self.disaggregation_mode == "decode" and not self.disable_radix_cache:
            # As SGLang: the decode side has no prefix sharing (prompts arrive by transfer).
            logger.info("--disaggregation-mode decode: the KV cache is a chunk cache (no radix cache).")
            self.disable_radix_cache = True

    def check(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ServerArgsError(msg)

        # Flags with a fixed set of values (argparse checks them too; ServerArgs is also built in code).
        # --device was resolved from auto above.
        for flag, value, names in (("--dtype", self.dtype, DTYPES),
                                   ("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPE_NAMES),
                                   ("--device", self.device, DEVICES[1:]),
                                   ("--attention-backend", self.attention_backend, ATTENTION_BACKENDS),
                                   ("--schedule-policy", self.schedule_policy, SCHEDULE_POLICIES),
                                   ("--load-balance-method", self.load_balance_method, LOAD_BALANCE_METHODS)):
            need(value in names, f"{flag} must be one of {', '.join(names)}, got {value!r}")
        need(self.quantization is None or self.quantization in QUANTIZATION_METHODS,
             f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}")
        need(not (self.kv_cache_dtype.startswith("fp8") and self.attention_backend == "flashinfer"),
             f"--kv-cache-dtype {self.kv_cache_dtype} is not supported by the flashinfer attention backend here "
             "(untested without a GPU); use --attention-backend triton or torch_native")
        need(not self.quantize_lm_head or self.quantization in (*ONLINE_QUANTIZATION, None, *PREQUANTIZED_4BIT),
             f"--quantize-lm-head quantizes the head with --quantization {' or '.join(ONLINE_QUANTIZATION)} or on a "
             f"4-bit checkpoint, got --quantization {self.quantization}")
        need(self.quantization is None or not (self.enable_lora or self.lora_paths),
             "--quantization is not supported yet with LoRA adapters (--enable-lora, --lora-paths)")
        need(
            not (self.device == "cpu" and self.attention_backend == "flashinfer"),
            "--attention-backend flashinfer needs --device cuda",
        )
        need(self.page_size >= 1 and (self.page_size & (self.page_size - 1)) == 0,
             f"--page-size must be a power of two >= 1, got {self.page_size}")
        need(1 <= self.port <= 65535, f"--port must be in [1, 65535], got {self.port}")
        need(self.tp_size >= 1, f"--tp-size must be >= 1, got {self.tp_size}")
        need(self.dp_size >= 1, f"--dp-size must be >= 1, got {self.dp_size}")
        need(self.ep_size >= 1 and self.tp_size % self.ep_size == 0,
             f"--ep-size must be >= 1 and divide --tp-size {self.tp_size}, got {self.ep_size}")
        need(self.nnodes >= 1, f"--nnodes must be >= 1, got {self.nnodes}")
        need(0 <= self.node_rank < self.nnodes,
             f"--node-rank must be in [0, --nnodes), got {self.node_rank} with --nnodes {self.nnodes}")
        need(self.nnodes == 1 or self.dist_init_addr is not None,
             "--dist-init-addr is required when --nnodes > 1")
        need(self.context_length is None or self.context_length > 0,
             f"--context-length must be > 0, got {self.context_length}")
        # resolve_defaults() filled these in.
        assert self.mem_fraction_static is not None and self.chunked_prefill_size is not None
        need(0.0 < self.mem_fraction_static < 1.0,
             f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        need(self.max_total_tokens is None or self.max_total_tokens >= 2 * self.page_size,
             f"--max-total-tokens must be >= 2 pages, got {self.max_total_tokens}")
        need(self.max_running_requests is None or self.max_running_requests >= 1,
             f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        need(self.max_queued_requests is None or self.max_queued_requests >= 1,
             f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        need(self.max_prefill_tokens >= 1, f"--max-prefill-tokens must be >= 1, got {self.max_prefill_tokens}")
        need(self.chunked_prefill_size == -1 or self.chunked_prefill_size >= self.page_size,
             f"--chunked-prefill-size must be -1 (off) or >= --page-size, got {self.chunked_prefill_size}")
        need(self.schedule_conservativeness > 0,
             f"--schedule-conservativeness must be > 0, got {self.schedule_conservativeness}")
        need(self.stream_interval >= 1, f"--stream-interval must be >= 1, got {self.stream_interval}")
        need(self.tokenizer_worker_num >= 1, f"--tokenizer-worker-num must be >= 1, got {self.tokenizer_worker_num}")
        for name in ("http_header_timeout", "http_body_timeout", "http_keep_alive_timeout"):
            need(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        need(self.http_max_header_bytes >= 1024,
             f"--http-max-header-bytes must be >= 1024, got {self.http_max_header_bytes}")
        need(self.http_max_connections is None or self.http_max_connections >= 1,
             f"--http-max-connections must be >= 1, got {self.http_max_connections}")
        need(self.tokenizer_worker_num == 1 or not self.enable_metrics,
             "--enable-metrics serves one process's counters: it cannot be combined with --tokenizer-worker-num > 1")
        self._check_custom_labels(need)
        need(self.decode_log_interval >= 1,
             f"--decode-log-interval must be >= 1, got {self.decode_log_interval}")
        need(self.watchdog_timeout > 0, f"--watchdog-timeout must be > 0, got {self.watchdog_timeout}")
        for name in ("health_check_timeout", "control_timeout", "weight_update_timeout", "startup_timeout",
                     "dist_timeout"):
            need(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        need(self.req_waiting_timeout >= 0,
             f"--req-waiting-timeout must be >= 0 (0: no limit), got {self.req_waiting_timeout}")
        need(self.threads_per_rank is None or self.threads_per_rank >= 1,
             f"--threads-per-rank must be >= 1, got {self.threads_per_rank}")
        need(self.log_level.lower() in ("debug", "info", "warning", "error", "critical"),
             f"--log-level must be debug|info|warning|error|critical, got {self.log_level!r}")
        need(self.grammar_timeout > 0, f"--grammar-timeout must be > 0, got {self.grammar_timeout}")
        need(self.grammar_backend in GRAMMAR_BACKENDS,
             f"--grammar-backend must be one of {', '.join(GRAMMAR_BACKENDS)}, got {self.grammar_backend!r}")
        need(self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
             f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")
        reasoning_error = None if self.reasoning_parser is None else reasoning_parser_error(self.reasoning_parser)
        need(reasoning_error is None, reasoning_error or "")
        need(self.priority_scheduling_preemption_threshold >= 0,
             "--priority-scheduling-preemption-threshold must be >= 0, got "
             f"{self.priority_scheduling_preemption_threshold}")
        need(not (self.enable_mixed_chunk and self.chunked_prefill_size == -1),
             "--enable-mixed-chunk needs chunked prefill (--chunked-prefill-size > 0)")
        need(not (self.enable_mixed_chunk and self.disable_mixed_chunk),
             "--enable-mixed-chunk and --disable-mixed-chunk contradict each other")
        check_disaggregation_server_args(self, need)
        self._check_simulated_device(need)
        if self.speculative_algorithm is not None:
            from engine.speculative.server_args_check import check_speculative_server_args

            check_speculative_server_args(self, need)
        self._check_lora(need)

    def _check_custom_labels(self, need: Any) -> None:
        from engine.tokenizer.metrics import custom_label_names_error

        labels = self.tokenizer_metrics_allowed_custom_labels
        if labels is None:
            return
        if isinstance(labels, str):  # a single name given in Python
            labels = self.tokenizer_metrics_allowed_custom_labels = [labels]
        error = custom_label_names_error(labels)
        need(error is None, f"--tokenizer-metrics-allowed-custom-labels: {error}")
        need(bool(self.tokenizer_metrics_custom_labels_header),
             "--tokenizer-metrics-custom-labels-header must not be empty with --tokenizer-metrics-allowed-custom-labels")

    def _check_simulated_device(self, need: Any) -> None:
        if self.simulated_device_forward_ms is None:
            return
        cost = self.simulated_device_cost()  # raises on a malformed value
        assert cost is not None
        # It replaces the accelerator: there is no device memory, no CUDA graph and no collective
        # to simulate. TP ranks would each sleep for a share of one forward that does not exist.
        need(self.device == "cpu", "--simulated-device-forward-ms replaces the accelerator: it runs with "
                                   f"--device cpu (or auto), got --device {self.device}")
        need(self.tp_size == 1 and self.nnodes == 1,
             "--simulated-device-forward-ms simulates one device: use --tp-size 1 and --nnodes 1 "
             "(--dp-size N runs N simulated replicas)")
        # It samples tokens and holds no K/V: nothing to pool into embeddings or to transfer.
        need(not self.is_embedding and self.disaggregation_mode == "null",
             "--simulated-device-forward-ms serves generation on a unified server: not with --is-embedding "
             "or --disaggregation-mode prefill|decode")

    def _check_lora(self, need: Any) -> None:
        if self.lora_paths:
            self.enable_lora = True
        if not self.enable_lora:
            return
        from engine.lora.lora_config import check_lora_server_args

        check_lora_server_args(self, need)

    def simulated_device_cost(self) -> Optional[tuple[float, float]]:
        """(ms per forward, ms per token) of --simulated-device-forward-ms, or None when it is off."""
        value = self.simulated_device_forward_ms
        if value is None:
            return None
        parts = [p.strip() for p in str(value).split(",")]
        try:
            numbers = [float(p) for p in parts]
        except ValueError:
            numbers = []
        if len(numbers) not in (1, 2) or not all(math.isfinite(x) and x >= 0 for x in numbers):
            raise ServerArgsError("--simulated-device-forward-ms must be 'A' or 'A,B' with finite numbers >= 0 "
                                  f"(A ms per forward, B ms per token), got {value!r}")
        return numbers[0], numbers[1] if len(numbers) == 2 else 0.0

    # ------------------------------------------------------------------ argparse
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field: its type from the annotation (Optional[X] takes an X, List[X] one or
        more, as SGLang's nargs="+"), a bool a switch, its help and choices from arg()."""
        hints = get_type_hints(ServerArgs)
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            kind = _unwrap_optional(hints[f.name])
            if kind is bool:
                parser.add_argument(flag, action="store_true", default=f.default, help=f.metadata["help"])
                continue
            many = get_origin(kind) in (list, List)
            parser.add_argument(flag, type=get_args(kind)[0] if many else kind, default=f.default,
                                help=f.metadata["help"], choices=f.metadata["choices"], nargs="+" if many else None)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names})

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _unwrap_optional(kind: Any) -> Any:
    """X for Optional[X] (Union[X, None]); anything else unchanged."""
    if get_origin(kind) is Union:
        members = [m for m in get_args(kind) if m is not type(None)]
        if len(members) == 1:
            return members[0]
    return kind


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # pragma: no cover - torch missing is a broken install
        return "cpu"
