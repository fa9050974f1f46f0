"""SamplingBatchInfo: the sampling parameters of a batch as device tensors, one row per request.

Two kinds of state live here:

- Per-row parameters (temperatures, top_ps, top_ks, min_ps, seeds, logit_bias). They never
  change in place: `filter_batch` / `merge_batch` build new tensors at once, so a snapshot taken
  by `copy_for_forward` keeps seeing the rows it was taken with.
- Accumulated state (penalty counts, tokens generated so far) in the penalizer orchestrator,
  updated in place by the sampler after every step (`update_after_sample`). With the overlap
  scheduler that update runs on the forward thread while the scheduler thread filters and merges
  the same batch for the next step. So the scheduler never touches the orchestrator: its
  filters and merges are queued as "layout ops" and replayed, in order, by whoever next uses
  the state (the forward of the next step, which runs after the previous one finished because
  forwards run in launch order). The state is therefore only ever mutated by one thread at a time,
  and each step's update lands before the rows are rearranged for the next step.

The state is always touched under `torch.inference_mode()`, whether or not the caller is in it:
tensors made in that mode may only be updated in place in it, and mixing would fail at random.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from engine.constrained.vocab_mask import apply_vocab_mask
from engine.sampling.custom_logit_processor import apply_custom_logit_processors
from engine.sampling.penaltylib.base import SamplingReq
from engine.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator
from engine.sampling.sampling_params import SAMPLING_EPS

logger = logging.getLogger(__name__)

# A queued change of row layout: ("filter", keep_indices) or ("merge", other_orchestrator, other_ops).
LayoutOp = Tuple[Any, ...]

# Columns of `row_kinds`, a small CPU tensor that lets filter/merge recompute the batch flags
# exactly without a device sync.
_GREEDY, _TOP_K, _TOP_P, _MIN_P, _SEEDED = range(5)

_INT64_MASK = (1 << 64) - 1


def _to_int64(seed: int) -> int:
    """Fold an arbitrary Python int into the signed int64 range (same bits as seed mod 2**64)."""
    value = seed & _INT64_MASK
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [bs, 1] float32 (1.0 for greedy rows)
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64; vocab_size when top-k is off, 1 for greedy rows
    min_ps: torch.Tensor  # [bs] float32
    vocab_size: int
    device: torch.device
    is_all_greedy: bool
    need_top_p_sampling: bool
    need_top_k_sampling: bool
    need_min_p_sampling: bool
    row_kinds: torch.Tensor  # [bs, 5] bool on the CPU: greedy, top_k, top_p, min_p, seeded
    penalizer_orchestrator: BatchedPenalizerOrchestrator
    # Seeded rows: seeds [bs] int64 and seeded_mask [bs] bool, or both None when no row is seeded.
    seeds: Optional[torch.Tensor] = None
    seeded_mask: Optional[torch.Tensor] = None
    logit_bias: Optional[torch.Tensor] = None  # [bs, vocab] float32, or None
    # Constrained decoding: this step's int32 vocabulary bitmask (constrained/vocab_mask.py). Set
    # only on a forward snapshot, for one step, by whoever knows the matchers' current state.
    vocab_mask: Optional[torch.Tensor] = None
    pending_layout_ops: List[LayoutOp] = field(default_factory=list)
    # What this snapshot's replay read, kept with it: the ops (their index tensors, the merged
    # orchestrators) and the penalty state tensors the replay replaced. Some were made on the
    # scheduling thread's CUDA stream, and kernels queued on the forward stream read them; freed at
    # replay, their blocks went back to the scheduling stream's pool at once, and its next
    # allocation (the next step's keep indices, say) overwrote them before the forward stream read
    # them: an out-of-bounds index seen on an H200. The snapshot lives in the launched batch until
    # its result is processed, after the forward finished.
    replayed_layout_ops: List[LayoutOp] = field(default_factory=list)
    retired_state: List[torch.Tensor] = field(default_factory=list)
    # Custom logit processors: serialized processor -> its rows; per row the serialized processor
    # and the custom_params it is called with (plus "__req__"). All None when no row uses one.
    custom_logit_processor: Optional[Dict[str, List[int]]] = None
    custom_row_processors: Optional[List[Optional[str]]] = None
    custom_params: Optional[List[Optional[Dict[str, Any]]]] = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_reqs(
        cls, reqs: Sequence[SamplingReq], vocab_size: int, device: Union[str, torch.device] = "cpu"
    ) -> "SamplingBatchInfo":
        """Build from requests exposing `.sampling_params`, `.origin_input_ids`, `.output_ids`,
        `.eos_token_ids` and `.custom_logit_processor`. Penalty state is reconstructed from the tokens, so a batch rebuilt
        after retraction continues exactly where it left off."""
        device = torch.device(device)
        temps, top_ps, top_ks, min_ps, kinds = [], [], [], [], []
        seeds, seeded = [], []
        for req in reqs:
            params = req.sampling_params
            greedy = params.top_k == 1 or params.temperature < SAMPLING_EPS
            top_k = 1 if greedy else (vocab_size if params.top_k < 1 else min(params.top_k, vocab_size))
            temps.append(1.0 if greedy else float(params.temperature))
            top_ps.append(float(params.top_p))
            top_ks.append(top_k)
            min_ps.append(float(params.min_p))
            # Greedy rows take the argmax whatever the masks, so they never require one.
            kinds.append((greedy, not greedy and top_k < vocab_size, not greedy and params.top_p < 1.0,
                          not greedy and params.min_p > 0.0, params.sampling_seed is not None))
            seeded.append(params.sampling_seed is not None)
            seeds.append(_to_int64(params.sampling_seed) if params.sampling_seed is not None else 0)
        row_kinds = torch.tensor(kinds, dtype=torch.bool).view(-1, 5)
        info = cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device).view(-1, 1),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            vocab_size=vocab_size,
            device=device,
            is_all_greedy=True,
            need_top_p_sampling=False,
            need_top_k_sampling=False,
            need_min_p_sampling=False,
            row_kinds=row_kinds,
            penalizer_orchestrator=BatchedPenalizerOrchestrator.from_reqs(reqs, vocab_size, device),
            logit_bias=_build_logit_bias(reqs, vocab_size, device),
        )
        if any(seeded):
            info.seeds = torch.tensor(seeds, dtype=torch.int64, device=device)
            info.seeded_mask = torch.tensor(seeded, dtype=torch.bool, device=device)
        info._set_custom_rows([req.custom_logit_processor for req in reqs],
                              [_custom_params(req) for req in reqs])
        info._refresh_flags()
        return info

    @property
    def batch_size(self) -> int:
        return self.temperatures.shape[0]

    def _refresh_flags(self) -> None:
        any_kind = self.row_kinds.any(dim=0).tolist() if self.row_kinds.numel() else [False] * 5
        self.is_all_greedy = bool(self.row_kinds[:, _GREEDY].all())
        self.need_top_k_sampling = any_kind[_TOP_K]
        self.need_top_p_sampling = any_kind[_TOP_P]
        self.need_min_p_sampling = any_kind[_MIN_P]

    # ------------------------------------------------------------------ batch layout

    def filter_batch(self, keep_indices: List[int]) -> None:
        """Keep only the rows in `keep_indices` (in that order)."""
        keep = torch.tensor(keep_indices, dtype=torch.int64, device=self.device)
        self.temperatures = self.temperatures[keep]
        self.top_ps = self.top_ps[keep]
        self.top_ks = self.top_ks[keep]
        self.min_ps = self.min_ps[keep]
        self.row_kinds = self.row_kinds[torch.tensor(keep_indices, dtype=torch.int64)]
        if self.seeds is not None:
            assert self.seeded_mask is not None  # seeds and seeded_mask are set together
            self.seeds = self.seeds[keep]
            self.seeded_mask = self.seeded_mask[keep]
            # Back to the unseeded fast path once no seeded row is left (decided on the CPU: no sync).
            if not bool(self.row_kinds[:, _SEEDED].any()):
                self.seeds = self.seeded_mask = None
        if self.logit_bias is not None:
            self.logit_bias = self.logit_bias[keep]
        if self.custom_params is not None:
            assert self.custom_row_processors is not None  # _set_custom_rows sets both together
            self._set_custom_rows([self.custom_row_processors[i] for i in keep_indices],
                                  [self.custom_params[i] for i in keep_indices])
        self.pending_layout_ops.append(("filter", keep))
        self._refresh_flags()

    def merge_batch(self, other: "SamplingBatchInfo") -> None:
        """Append `other`'s rows after this batch's rows. `other` must not be used afterwards."""
        bs_self, bs_other = self.batch_size, other.batch_size
        self.temperatures = torch.cat([self.temperatures, other.temperatures])
        self.top_ps = torch.cat([self.top_ps, other.top_ps])
        self.top_ks = torch.cat([self.top_ks, other.top_ks])
        self.min_ps = torch.cat([self.min_ps, other.min_ps])
        self.row_kinds = torch.cat([self.row_kinds, other.row_kinds])
        if self.seeds is not None or other.seeds is not None:
            self.seeds = torch.cat([_or_zeros(self.seeds, bs_self, self.device, torch.int64),
                                    _or_zeros(other.seeds, bs_other, self.device, torch.int64)])
            self.seeded_mask = torch.cat([_or_zeros(self.seeded_mask, bs_self, self.device, torch.bool),
                                          _or_zeros(other.seeded_mask, bs_other, self.device, torch.bool)])
        if self.logit_bias is not None or other.logit_bias is not None:
            shape = (self.vocab_size,)
            self.logit_bias = torch.cat([
                _or_zeros(self.logit_bias, bs_self, self.device, torch.float32, shape),
                _or_zeros(other.logit_bias, bs_other, self.device, torch.float32, shape),
            ])
        if self.custom_params is not None or other.custom_params is not None:
            self._set_custom_rows((self.custom_row_processors or [None] * bs_self)
                                  + (other.custom_row_processors or [None] * bs_other),
                                  (self.custom_params or [None] * bs_self) + (other.custom_params or [None] * bs_other))
        # `other`'s own queued ops belong to its orchestrator; they are replayed before the concat.
        self.pending_layout_ops.append(("merge", other.penalizer_orchestrator, other.pending_layout_ops))
        other.pending_layout_ops = []
        self._refresh_flags()

    def copy_for_forward(self) -> "SamplingBatchInfo":
        """A snapshot for the forward thread. Per-row tensors are shared (they are never mutated
        in place); the orchestrator is shared and the queued layout ops move to the snapshot, so
        the forward thread brings the state to this batch's layout before using it."""
        snapshot = copy.copy(self)
        snapshot.pending_layout_ops = self.pending_layout_ops
        snapshot.replayed_layout_ops, snapshot.retired_state = [], []
        self.pending_layout_ops = []
        # Settled here, on the scheduling thread, if ever: no other stream reads them.
        self.replayed_layout_ops, self.retired_state = [], []
        return snapshot

    @torch.inference_mode()
    def _settle_layout(self) -> BatchedPenalizerOrchestrator:
        """Replay queued filters/merges on the shared state; returns the orchestrator."""
        ops, self.pending_layout_ops = self.pending_layout_ops, []
        _replay(self.penalizer_orchestrator, ops, self.retired_state)
        self.replayed_layout_ops.extend(ops)
        orchestrator = self.penalizer_orchestrator
        if orchestrator.batch_size != self.batch_size:
            raise RuntimeError(
                f"penalty state has {orchestrator.batch_size} rows but the batch has {self.batch_size}: "
                "a layout change bypassed filter_batch/merge_batch, or a snapshot was used out of order"
            )
        return orchestrator

    # ------------------------------------------------------------------ per step

    @property
    def output_lens(self) -> torch.Tensor:
        """Tokens generated so far per row ([bs] int64): the step counter of seeded sampling."""
        return self._settle_layout().output_lens

    @torch.inference_mode()
    def apply_logits_bias(self, logits: torch.Tensor) -> None:
        """Penalties, then min_new_tokens masking, then logit_bias, then the grammar's vocabulary
        mask, in place on [bs, >=vocab] logits: the mask comes last so that every sampling path,
        greedy included, picks only a token the grammar allows."""
        orchestrator = self._settle_layout()
        if logits.shape[1] > self.vocab_size:
            # Padded LM-head columns are not tokens; they must never be sampled.
            logits[:, self.vocab_size:] = float("-inf")
            logits = logits[:, : self.vocab_size]
        if orchestrator.is_required:
            orchestrator.apply(logits)
        if self.logit_bias is not None:
            logits.add_(self.logit_bias)
        if self.vocab_mask is not None:
            apply_vocab_mask(logits, self.vocab_mask)

    def apply_custom_logit_processors(self, logits: torch.Tensor) -> None:
        """Run the requests' custom logit processors on their rows (in place)."""
        if self.custom_logit_processor:
            assert self.custom_params is not None  # _set_custom_rows sets both together
            apply_custom_logit_processors(logits[:, : self.vocab_size], self.custom_logit_processor,
                                          self.custom_params)

    def _set_custom_rows(self, processors: List[Optional[str]], params: List[Optional[Dict[str, Any]]]) -> None:
        """New per-row lists (never mutated in place: snapshots keep the old ones)."""
        rows: Dict[str, List[int]] = {}
        for row, processor in enumerate(processors):
            if processor is not None:
                rows.setdefault(processor, []).append(row)
        self.custom_logit_processor = rows or None
        self.custom_row_processors = processors if rows else None
        self.custom_params = params if rows else None

    @torch.inference_mode()
    def update_after_sample(self, next_token_ids: torch.Tensor) -> None:
        """Account for the token just sampled for every row (penalty counts, step counters)."""
        self._settle_layout().cumulate(next_token_ids)

    @torch.inference_mode()
    def update_after_verify(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Account for the tokens a speculative verify step emitted: token_ids[j] for row rows[j],
        a row as many times as it emitted tokens (engine/speculative/)."""
        self._settle_layout().cumulate_at(rows, token_ids)

    @torch.inference_mode()
    def per_position(self, rows: List[int], gen_rows: List[int], gen_tokens: List[int]) -> "SamplingBatchInfo":
        """The sampling state at each position of a speculative verify step: position p is row
        rows[p] of this batch, with gen_tokens[j] counted as generated at position gen_rows[j] (the
        drafts before it, taken as accepted: penalties and min_new_tokens see them). This batch's
        own state is unchanged; the copy has no vocabulary mask (the caller sets the drafts')."""
        orchestrator = self._settle_layout()
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        positions = copy.copy(self)
        positions.temperatures = self.temperatures[index]
        positions.top_ps, positions.top_ks, positions.min_ps = self.top_ps[index], self.top_ks[index], self.min_ps[index]
        positions.row_kinds = self.row_kinds[torch.tensor(rows, dtype=torch.int64)]
        if self.seeds is not None:
            assert self.seeded_mask is not None  # seeds and seeded_mask are set together
            positions.seeds, positions.seeded_mask = self.seeds[index], self.seeded_mask[index]
        if self.logit_bias is not None:
            positions.logit_bias = self.logit_bias[index]
        if self.custom_params is not None:
            assert self.custom_row_processors is not None  # _set_custom_rows sets both together
            positions._set_custom_rows([self.custom_row_processors[r] for r in rows],
                                       [self.custom_params[r] for r in rows])
        positions.vocab_mask = None
        positions.pending_layout_ops, positions.replayed_layout_ops, positions.retired_state = [], [], []
        positions.penalizer_orchestrator = orchestrator.expanded(
            index, torch.tensor(gen_rows, dtype=torch.int64), torch.tensor(gen_tokens, dtype=torch.int64))
        return positions


def _custom_params(req: SamplingReq) -> Optional[Dict[str, Any]]:
    """What a request's processor sees, as in SGLang: its custom_params plus "__req__"."""
    if req.custom_logit_processor is None:
        return None
    return {**(req.sampling_params.custom_params or {}), "__req__": req}


def _replay(orchestrator: BatchedPenalizerOrchestrator, ops: List[LayoutOp], retired: List[torch.Tensor]) -> None:
    """Apply `ops` to `orchestrator`; the state tensors each op replaces go to `retired`."""
    for op in ops:
        retired.extend(orchestrator.state_tensors())
        if op[0] == "filter":
            orchestrator.filter(op[1])
        else:
            _, other, other_ops = op
            _replay(other, other_ops, retired)
            orchestrator.merge(other)


def _or_zeros(
    tensor: Optional[torch.Tensor],
    rows: int,
    device: torch.device,
    dtype: torch.dtype,
    trailing: Tuple[int, ...] = (),
) -> torch.Tensor:
    if tensor is not None:
        return tensor
    return torch.zeros((rows, *trailing), dtype=dtype, device=device)


def _build_logit_bias(reqs: Sequence[SamplingReq], vocab_size: int, device: torch.device) -> Optional[torch.Tensor]:
    if not any(req.sampling_params.logit_bias for req in reqs):
        return None
    rows, cols, values = [], [], []
    for row, req in enumerate(reqs):
        for key, value in (req.sampling_params.logit_bias or {}).items():
            token_id = int(key)
            if 0 <= token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
                values.append(float(value))
    bias = torch.zeros(len(reqs), vocab_size, dtype=torch.float32)
    bias[torch.tensor(rows, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64)] = torch.tensor(
        values, dtype=torch.float32
    )
    return bias.to(device)
