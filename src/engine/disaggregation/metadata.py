"""Metadata buffers: one fixed-size row per request in transfer (SGLang's "aux data").

The prefill fills a row after sampling the first output token (token id, its logprob and top
logprobs, the cached-token count) and stamps it with the bootstrap room; the row travels after
the KV. The decode side reads it at commit time. The room stamp is the metadata gate: a row whose
stamp is 0 has not arrived yet, and a freed row must be reset to 0 before its next owner uses it.

Rows are one numpy structured dtype shared by both sides (METADATA_SCHEMA_VERSION names it in the
bootstrap information, so two servers with different layouts refuse to pair).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol

import numpy as np

METADATA_SCHEMA_VERSION = 1
# The most top logprobs a row carries (the HTTP edge allows at most 20).
MAX_TOP_LOGPROBS = 20

METADATA_DTYPE = np.dtype([
    ("room", "<i8"),
    ("output_id", "<i4"),
    ("cached_tokens", "<i4"),
    ("logprob", "<f4"),
    ("top_n", "<i4"),
    ("top_val", "<f4", (MAX_TOP_LOGPROBS,)),
    ("top_idx", "<i4", (MAX_TOP_LOGPROBS,)),
])
METADATA_ROW_BYTES = METADATA_DTYPE.itemsize


@dataclass
class FirstTokenMetadata:
    """What a metadata row says about one request."""

    room: int
    output_id: int
    cached_tokens: int = 0
    logprob: float = 0.0
    top_val: List[float] = field(default_factory=list)
    top_idx: List[int] = field(default_factory=list)


class MetadataBuffers:
    def __init__(self, size: int) -> None:
        self.size = size
        self.rows = np.zeros(size, dtype=METADATA_DTYPE)

    def set_buf(self, index: int, meta: FirstTokenMetadata) -> None:
        row = self.rows[index]
        n = min(len(meta.top_val), MAX_TOP_LOGPROBS)
        row["output_id"] = meta.output_id
        row["cached_tokens"] = meta.cached_tokens
        row["logprob"] = meta.logprob
        row["top_n"] = n
        row["top_val"][:] = 0.0
        row["top_idx"][:] = 0
        row["top_val"][:n] = meta.top_val[:n]
        row["top_idx"][:n] = meta.top_idx[:n]
        row["room"] = meta.room  # last: a reader that sees the stamp sees the rest

    def get_buf(self, index: int) -> FirstTokenMetadata:
        row = self.rows[index].copy()
        n = int(row["top_n"])
        return FirstTokenMetadata(
            room=int(row["room"]), output_id=int(row["output_id"]), cached_tokens=int(row["cached_tokens"]),
            logprob=float(row["logprob"]), top_val=[float(v) for v in row["top_val"][:n]],
            top_idx=[int(i) for i in row["top_idx"][:n]])

    def room(self, index: int) -> int:
        return int(self.rows["room"][index])

    def row_bytes(self, index: int) -> bytes:
        return self.rows[index:index + 1].tobytes()

    def write_row_bytes(self, index: int, data: bytes) -> None:
        """Store a row received from the other side (the room stamp comes with it)."""
        if len(data) != METADATA_ROW_BYTES:
            raise ValueError(f"metadata row of {len(data)} bytes, expected {METADATA_ROW_BYTES}")
        # One row copy under the GIL: the scheduler thread never sees half a row.
        self.rows[index] = np.frombuffer(data, dtype=METADATA_DTYPE, count=1)[0]

    def reset(self, index: int) -> None:
        self.rows[index] = np.zeros((), dtype=METADATA_DTYPE)


class ReqToMetadataIdxAllocator:
    """Free list of metadata rows."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free_slots: List[int] = list(range(size))
        self._is_free = [True] * size

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> Optional[int]:
        if not self.free_slots:
            return None
        index = self.free_slots.pop(0)
        self._is_free[index] = False
        return index

    def free(self, index: int) -> None:
        if not 0 <= index < self.size:
            raise ValueError(f"metadata row {index} is not a row of this table (0..{self.size - 1})")
        if self._is_free[index]:
            raise ValueError(f"metadata row {index} is already free (double free)")
        self._is_free[index] = True
        self.free_slots.append(index)


class _TransferManager(Protocol):
    def idle_state(self) -> Dict[str, int]: ...


def idle_leaks(metadata: MetadataBuffers, allocator: ReqToMetadataIdxAllocator,
               manager: Optional[_TransferManager]) -> Optional[str]:
    """What a PD side still holds when it should hold nothing (the idle memory check), or None."""
    problems = []
    if allocator.available_size() != allocator.size:
        problems.append(f"metadata rows free {allocator.available_size()}/{allocator.size}")
    if bool((metadata.rows["room"] != 0).any()):
        problems.append("a free metadata row still carries a room stamp")
    if manager is not None and manager.idle_state()["rooms"]:
        problems.append(f"transfer rooms left: {manager.idle_state()}")
    return "; ".join(problems) or None
