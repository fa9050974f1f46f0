"""The start-up checks and defaults of --speculative-algorithm and its flags (ServerArgs.check
calls `check_speculative_server_args`; kept here so the flag rules live beside the engine they
configure)."""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Protocol, Tuple

logger = logging.getLogger(__name__)

# --speculative-algorithm: what runs, and SGLang's names that are refused at start-up.
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
UNSUPPORTED_SPECULATIVE_ALGORITHMS: Tuple[str, ...] = ()
# SGLang's NEXTN (DeepSeek-V3's multi-token prediction layer) is EAGLE with that layer as the head; the
# draft path defaults to the target's checkpoint, which keeps the layer (models/deepseek_nextn.py).
NEXTN = "NEXTN"
# The algorithms whose drafts come from a draft model (--speculative-draft-model-path).
DRAFT_MODEL_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3")
# The algorithms whose head reads the target's features (kept on a PD prefill server, which sends them).
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3")
# (num_steps, eagle_topk, num_draft_tokens) when none is given: SGLang's STANDALONE default. Its
# EAGLE default for Llama is the tree (5, 4, 8); here chains stay the default for every algorithm,
# since on the CPU a tree's wider draft and verify forwards cost more than its extra acceptance
# brings (trees are chosen with --speculative-eagle-topk).
DEFAULT_DRAFT_MODEL_SPEC_PARAMS = (3, 1, 4)
# --speculative-batch-size-threshold's default on the CPU: past 4 requests a verify forward costs more
# than the tokens it typically adds (benchmarks/bench_speculative.py --verify-cost, docs/benchmarks.md:
# with 11 drafts x2.9 a decode forward at 4 requests, x4.2 at 8, x5.5 at 16).
CPU_SPECULATIVE_BATCH_SIZE_THRESHOLD = 4
# The most tokens one verify step checks per request, and the longest n-gram window (bounds the
# verify forward and the drafter's search).
MAX_SPECULATIVE_TOKENS = 64
# The widest tree (--speculative-eagle-topk): each drafting step ranks topk^2 candidates per request.
MAX_SPECULATIVE_TOPK = 16


class SpeculativeFlags(Protocol):
    """The ServerArgs fields the check reads and completes (a protocol: server_args.py imports
    this module, not the other way round)."""

    model_path: Optional[str]
    speculative_algorithm: Optional[str]
    speculative_draft_model_path: Optional[str]
    speculative_num_steps: Optional[int]
    speculative_eagle_topk: Optional[int]
    speculative_num_draft_tokens: Optional[int]
    speculative_ngram_min_match_window_size: int
    speculative_ngram_max_match_window_size: int
    speculative_batch_size_threshold: Optional[int]
    device: str
    tp_size: int
    nnodes: int
    disaggregation_mode: str
    enable_lora: bool
    lora_paths: Optional[List[str]]
    simulated_device_forward_ms: Optional[str]
    is_embedding: bool
    attention_backend: Optional[str]


def check_speculative_server_args(args: SpeculativeFlags, need: Callable[[bool, str], None]) -> None:
    algo = args.speculative_algorithm
    assert algo is not None  # ServerArgs calls this only with an algorithm
    if algo == NEXTN:
        # As SGLang: NEXTN runs as EAGLE, its head the MTP layer of the checkpoint (the target's unless given).
        algo = args.speculative_algorithm = "EAGLE"
        if args.speculative_draft_model_path is None:
            args.speculative_draft_model_path = args.model_path
    if args.disaggregation_mode == "prefill" and algo in SPECULATIVE_ALGORITHMS and algo not in EAGLE_ALGORITHMS:
        # A prefill server computes prompts and one token each: nothing to draft. The same flags can
        # be given to both servers of a PD pair; the decode server speculates. (EAGLE's are kept: the
        # prefill sends its decode server's head the target's features of each prompt.)
        logger.warning("--speculative-algorithm %s is ignored on a --disaggregation-mode prefill server: the "
                       "decode server speculates", algo)
        args.speculative_algorithm = None
        return
    need(algo not in UNSUPPORTED_SPECULATIVE_ALGORITHMS, f"--speculative-algorithm {algo} is not supported yet")
    need(algo in SPECULATIVE_ALGORITHMS,
         f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS + (NEXTN,))}, got {algo!r}")
    need(args.speculative_batch_size_threshold is None or args.speculative_batch_size_threshold >= 1,
         f"--speculative-batch-size-threshold must be >= 1, got {args.speculative_batch_size_threshold}")
    if args.speculative_batch_size_threshold is None and args.device == "cpu":
        args.speculative_batch_size_threshold = CPU_SPECULATIVE_BATCH_SIZE_THRESHOLD
    if algo in DRAFT_MODEL_ALGORITHMS:
        _check_draft_model_params(args, need)
    else:
        lo, hi = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
        need(1 <= lo <= hi <= MAX_SPECULATIVE_TOKENS,
             "--speculative-ngram-min-match-window-size and --speculative-ngram-max-match-window-size must "
             f"satisfy 1 <= min <= max <= {MAX_SPECULATIVE_TOKENS}, got {lo} and {hi}")
        if args.speculative_num_draft_tokens is None:
            args.speculative_num_draft_tokens = hi  # SGLang's NGRAM default
    assert args.speculative_num_draft_tokens is not None  # set by both branches
    need(2 <= args.speculative_num_draft_tokens <= MAX_SPECULATIVE_TOKENS,
         f"--speculative-num-draft-tokens must be in [2, {MAX_SPECULATIVE_TOKENS}] (the last token plus at least "
         f"one draft), got {args.speculative_num_draft_tokens}")
    # What the verify step does not handle yet: refused, never silently inexact.
    need(not (args.enable_lora or args.lora_paths),
         f"--speculative-algorithm {algo} is not supported yet with LoRA adapters (--enable-lora, "
         "--lora-paths): the verify and draft forwards do not apply them")
    need(args.simulated_device_forward_ms is None and not args.is_embedding,
         f"--speculative-algorithm {algo} needs a generative model: not with --simulated-device-forward-ms "
         "or --is-embedding")
    if args.disaggregation_mode == "prefill":
        # EAGLE on a prefill server: its forwards keep the target's features of each prompt for the
        # decode server's head (sent with the KV); it never drafts or verifies.
        return


def _check_draft_model_params(args: SpeculativeFlags, need: Callable[[bool, str], None]) -> None:
    """SGLang's rules: all three of steps / topk / draft tokens default together; a chain
    (topk 1) verifies num_steps + 1 tokens."""
    algo = args.speculative_algorithm
    need(args.speculative_draft_model_path is not None,
         f"--speculative-algorithm {algo} needs --speculative-draft-model-path (the draft model's directory)")
    if args.speculative_num_steps is None:
        need(args.speculative_eagle_topk is None and args.speculative_num_draft_tokens is None,
             "--speculative-eagle-topk and --speculative-num-draft-tokens need --speculative-num-steps "
             "(leave all three unset for the defaults 3, 1, 4)")
        (args.speculative_num_steps, args.speculative_eagle_topk,
         args.speculative_num_draft_tokens) = DEFAULT_DRAFT_MODEL_SPEC_PARAMS
    if args.speculative_eagle_topk is None:
        args.speculative_eagle_topk = 1
    need(1 <= args.speculative_num_steps < MAX_SPECULATIVE_TOKENS,
         f"--speculative-num-steps must be in [1, {MAX_SPECULATIVE_TOKENS - 1}], got {args.speculative_num_steps}")
    need(1 <= args.speculative_eagle_topk <= MAX_SPECULATIVE_TOPK,
         f"--speculative-eagle-topk must be in [1, {MAX_SPECULATIVE_TOPK}], got {args.speculative_eagle_topk}")
    if args.speculative_eagle_topk > 1:
        _check_tree_params(args, need)
        return
    if args.speculative_num_draft_tokens != args.speculative_num_steps + 1:
        if args.speculative_num_draft_tokens is not None:
            logger.warning("--speculative-num-draft-tokens is set to --speculative-num-steps + 1 = %d "
                           "with --speculative-eagle-topk 1", args.speculative_num_steps + 1)
        args.speculative_num_draft_tokens = args.speculative_num_steps + 1


def max_tree_drafts(num_steps: int, topk: int) -> int:
    """The candidates a tree drafting of this shape grows (speculative/tree.py)."""
    return topk + (num_steps - 1) * topk * topk


def _check_tree_params(args: SpeculativeFlags, need: Callable[[bool, str], None]) -> None:
    """Tree drafts (speculative/tree.py): the verified tree's size is explicit and at most the
    candidates the drafting grows (topk + (num_steps - 1) * topk^2) plus the root."""
    steps, topk, tokens = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    assert steps is not None and topk is not None  # set by the caller
    need(tokens is not None, f"--speculative-eagle-topk {topk} needs --speculative-num-draft-tokens (the tree's "
                             "size: the last token plus the drafts verified)")
    assert tokens is not None  # need() raised otherwise
    limit = min(max_tree_drafts(steps, topk) + 1, MAX_SPECULATIVE_TOKENS)
    need(2 <= tokens <= limit,
         f"--speculative-num-draft-tokens must be in [2, {limit}] with --speculative-num-steps {steps} and "
         f"--speculative-eagle-topk {topk} (at most topk + (num_steps - 1) * topk^2 drafts plus the last token, "
         f"and {MAX_SPECULATIVE_TOKENS}), got {tokens}")
    need((steps - 1) * topk <= MAX_SPECULATIVE_TOKENS,
         f"--speculative-num-steps {steps} with --speculative-eagle-topk {topk} feeds {(steps - 1) * topk} tree "
         f"nodes to the draft per step; at most {MAX_SPECULATIVE_TOKENS}")
    need(args.attention_backend != "flashinfer",
         "--speculative-eagle-topk > 1 needs the tree attention mask, which --attention-backend flashinfer does "
         "not apply here: use triton or torch_native")
