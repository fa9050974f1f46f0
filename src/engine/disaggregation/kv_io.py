"""The KV data path: what both sides must agree on, gathering KV into a frame and scattering it.

A KV frame carries tokens [offset, offset + n) of one request, all layers, each layer's planes (K then
V; an MLA pool's one latent row per token: MHATokenToKVPool.layer_planes):
`[num_layers, planes, n, heads, head_dim]` in the pool's dtype, contiguous. The prefill gathers it from
its pool slots; the decode side's listener thread copies it into the destination slots it
reserved (receiver-side scatter: nobody writes into another process's memory, so a frame that
arrives after an abort is simply dropped). Every frame carries a CRC32 of its payload.

With different TP sizes on the two sides a decode rank receives only the KV heads it holds; the
prefill rank that holds all of them slices its frames (`head_slice`).

Per-slot rows beside the KV ride in the same frames: with EAGLE / EAGLE3 the target's feature of
each prompt position (speculative/eagle.py), which the decode server's head reads to build its own
K/V of the prompt. A frame's payload is then the KV bytes followed by `[n, feature_size]` features
(replicated over TP ranks: every rank holds the whole feature). Both sides' layouts name the
features, so servers started with different speculation flags refuse to pair (`pair_ranks`).
"""

from __future__ import annotations

import warnings
import zlib
import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch

from engine.mem_cache.memory_pool import MHATokenToKVPool

# Tokens per KV frame are chosen so a frame stays around this size: big enough to amortise the
# per-message cost, small enough that an abort is noticed between frames.
TARGET_FRAME_BYTES = 4 << 20
# Bounds on a peer's feature layout (it sizes every frame): the widest feature (EAGLE3: 3 x hidden)
# and the element types a feature may have (the model's dtype).
MAX_FEATURE_SIZE = 3 * 65536
FEATURE_DTYPES = ("float32", "float16", "bfloat16")


def kv_heads_of_rank(total_kv_heads: int, tp_size: int, rank: int) -> List[int]:
    """The global KV head ids a TP rank holds (QKVParallelLinear's sharding and replication)."""
    if tp_size <= total_kv_heads:
        per_rank = total_kv_heads // tp_size
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    return [rank * total_kv_heads // tp_size]


@dataclass(frozen=True)
class KVLayout:
    """The KV cache shape of one TP rank of a server."""

    num_layers: int
    total_kv_heads: int
    head_dim: int
    dtype: str
    tp_size: int
    tp_rank: int
    # The per-slot features sent with the KV (FeatureStore): what they are ("" for none), their
    # width and element type.
    features: str = ""
    feature_size: int = 0
    feature_dtype: str = ""
    # The buffers per layer and token (pool.kv_planes): 2 (K and V), or 1 (an MLA pool's latent row).
    planes: int = 2

    @classmethod
    def of_pool(cls, pool: MHATokenToKVPool, total_kv_heads: int, tp_size: int, tp_rank: int,
                features: Optional["FeatureStore"] = None) -> "KVLayout":
        layout = cls(num_layers=pool.layer_num, total_kv_heads=total_kv_heads, head_dim=pool.head_dim,
                     dtype=str(pool.dtype).removeprefix("torch."), tp_size=tp_size, tp_rank=tp_rank,
                     planes=pool.kv_planes)
        if features is None:
            return layout
        name, size, dtype = features.feature_layout()
        return dataclasses.replace(layout, features=name, feature_size=size,
                                   feature_dtype=str(dtype).removeprefix("torch."))

    def heads(self) -> List[int]:
        return kv_heads_of_rank(self.total_kv_heads, self.tp_size, self.tp_rank)

    def element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def kv_bytes_per_token(self, num_heads: Optional[int] = None) -> int:
        heads = len(self.heads()) if num_heads is None else num_heads
        return self.planes * self.num_layers * heads * self.head_dim * self.element_size()

    def feature_bytes_per_token(self) -> int:
        if not self.feature_size:
            return 0
        return self.feature_size * torch.empty((), dtype=getattr(torch, self.feature_dtype)).element_size()

    def bytes_per_token(self, num_heads: Optional[int] = None) -> int:
        """A frame's bytes per token: the KV of `num_heads` heads (default: this rank's) and the features."""
        return self.kv_bytes_per_token(num_heads) + self.feature_bytes_per_token()

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "KVLayout":
        layout = cls(**{k: data[k] for k in ("num_layers", "total_kv_heads", "head_dim", "dtype", "tp_size",
                                              "tp_rank")})
        planes = data.get("planes", 2)
        if planes not in (1, 2):
            raise ValueError(f"malformed KV layout: {planes!r} planes per layer (1 or 2)")
        layout = dataclasses.replace(layout, planes=planes)
        features = {k: data[k] for k in ("features", "feature_size", "feature_dtype") if k in data}
        if not (isinstance(features.get("features", ""), str) and isinstance(features.get("feature_size", 0), int)
                and features.get("feature_dtype", "") in ("",) + FEATURE_DTYPES):
            raise ValueError(f"malformed feature layout {features!r}")
        if not 0 <= features.get("feature_size", 0) <= MAX_FEATURE_SIZE:
            raise ValueError(f"feature width {features.get('feature_size')} outside [0, {MAX_FEATURE_SIZE}]")
        return dataclasses.replace(layout, **features)


class FeatureStore(Protocol):
    """Per-slot rows of a server that travel with the KV (an EAGLE head's target features,
    speculative/eagle.py). The store owns them; the transfer reads and writes through it."""

    def feature_layout(self) -> Tuple[str, int, torch.dtype]:
        """(what the features are, their width, their element type): both servers must agree."""

    def gather_features(self, slots: torch.Tensor) -> torch.Tensor:
        """The features of `slots` as one contiguous CPU tensor [n, width]."""

    def scatter_features(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store received features (`rows`, [n, width]) at `slots` of this server."""


def pair_ranks(prefill: KVLayout, decode: KVLayout) -> Tuple[int, int, int]:
    """For a decode rank: (prefill rank to pull from, first head index within that rank, heads).

    Raises ValueError when the layouts cannot be paired (different model shapes, or a decode
    rank whose heads are not all held by one prefill rank).
    """
    for name in ("num_layers", "total_kv_heads", "head_dim", "dtype", "planes"):
        if getattr(prefill, name) != getattr(decode, name):
            raise ValueError(f"KV layouts differ in {name}: prefill {getattr(prefill, name)}, "
                             f"decode {getattr(decode, name)} (serve the same model with the same --dtype and "
                             "--kv-cache-dtype)")
    theirs = (prefill.features, prefill.feature_size, prefill.feature_dtype)
    ours = (decode.features, decode.feature_size, decode.feature_dtype)
    if theirs != ours:
        raise ValueError(f"the speculative features sent with the KV differ: prefill {_describe(theirs)}, decode "
                         f"{_describe(ours)} (an EAGLE / EAGLE3 decode server's head reads the target's features of "
                         "the prompt, which the prefill sends: start both servers with the same "
                         "--speculative-algorithm and --speculative-draft-model-path)")
    wanted = decode.heads()
    for rank in range(prefill.tp_size):
        held = kv_heads_of_rank(prefill.total_kv_heads, prefill.tp_size, rank)
        if wanted[0] in held:
            start = held.index(wanted[0])
            if held[start:start + len(wanted)] != wanted:
                break
            return rank, start, len(wanted)
    raise ValueError(f"decode TP rank {decode.tp_rank}/{decode.tp_size} needs KV heads {wanted}, which no single "
                     f"prefill rank of TP size {prefill.tp_size} holds")


def _describe(features: Tuple[str, int, str]) -> str:
    name, size, dtype = features
    return f"{name} ({size} x {dtype} per token)" if name else "none"


def frame_token_count(bytes_per_token: int) -> int:
    return max(1, TARGET_FRAME_BYTES // max(bytes_per_token, 1))


def layer_slots(pool: MHATokenToKVPool, slots: torch.Tensor) -> List[torch.Tensor]:
    """Per layer, the rows of its buffers that hold `slots`: the slots themselves, except on the windowed
    layers of the hybrid sliding-window pool (swa_pool.py), whose map sends positions that left the
    window to the padding row (read: junk no receiver reads back; written: nobody reads it). Taken when
    the copy is queued, not when it runs: a slot freed meanwhile loses its windowed mapping at once."""
    index = slots.to(device=pool.k_buffer[0].device, dtype=torch.int64)
    return [pool.kv_slots(layer, index) for layer in range(pool.layer_num)]


def gather_kv(pool: MHATokenToKVPool, slots: torch.Tensor, head_start: int = 0,
              num_heads: Optional[int] = None, rows: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
    """The KV planes of `slots` (all layers) as one contiguous CPU tensor [layers, planes, n, heads, dim];
    `rows`: layer_slots of them, taken earlier."""
    heads = pool.head_num if num_heads is None else num_heads
    rows = layer_slots(pool, slots) if rows is None else rows
    out = torch.empty((pool.layer_num, pool.kv_planes, slots.numel(), heads, pool.head_dim), dtype=pool.dtype)
    for layer in range(pool.layer_num):
        layer_index = rows[layer]
        for plane, source in enumerate(pool.layer_planes(layer)):
            if heads != pool.head_num:
                source = source[:, head_start:head_start + heads]
            torch.index_select(source, 0, layer_index, out=out[layer, plane])
    return out


def scatter_kv(pool: MHATokenToKVPool, slots: torch.Tensor, data: torch.Tensor,
               rows: Optional[List[torch.Tensor]] = None) -> None:
    """Write a frame gathered by `gather_kv` into `slots` of this pool (`rows`: as for gather_kv)."""
    rows = layer_slots(pool, slots) if rows is None else rows
    data = data.to(pool.k_buffer[0].device)
    if data.dtype != pool.dtype:
        raise ValueError(f"KV frame of {data.dtype} for a pool of {pool.dtype}")
    # As bytes: the elements are copied as they are (CPU index_copy_ has no fp8 kernel).
    data = data.view(torch.uint8) if pool.is_fp8 else data
    for layer in range(pool.layer_num):
        for plane, buf in enumerate(pool.layer_planes(layer)):
            (buf.view(torch.uint8) if pool.is_fp8 else buf).index_copy_(0, rows[layer], data[layer, plane])


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    # numpy's stubs declare ndarray's buffer protocol (__buffer__) only for Python >= 3.12.
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def from_bytes(buffer: Any, layout: KVLayout, num_tokens: int, num_heads: int) -> torch.Tensor:
    """The tensor view of a received frame payload (zero-copy when the buffer allows it)."""
    dtype = getattr(torch, layout.dtype)
    return _frombuffer(buffer).view(dtype).reshape(layout.num_layers, layout.planes, num_tokens, num_heads,
                                                   layout.head_dim)


def _frombuffer(buffer: Any) -> torch.Tensor:
    if not len(buffer):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # Received frames are read-only; the tensor is only read (copied into the pool).
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8)


def frame_payload(kv: torch.Tensor, features: Optional[torch.Tensor]) -> memoryview:
    """A frame's payload: the KV bytes, then the features' (when the server sends features)."""
    if features is None:
        return as_bytes(kv)
    parts = [t.contiguous().view(torch.uint8).reshape(-1) for t in (kv, features)]
    return as_bytes(torch.cat(parts))


def split_payload(buffer: Any, layout: KVLayout, num_tokens: int, num_heads: int
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the KV, the features or None) of a received frame payload; ValueError when its size is not
    what the layout says."""
    view = memoryview(buffer).cast("B")
    kv_bytes = num_tokens * layout.kv_bytes_per_token(num_heads)
    expected = kv_bytes + num_tokens * layout.feature_bytes_per_token()
    if view.nbytes != expected:
        raise ValueError(f"KV frame of {view.nbytes} bytes for {num_tokens} tokens, expected {expected}")
    kv = from_bytes(view[:kv_bytes], layout, num_tokens, num_heads)
    if not layout.feature_size:
        return kv, None
    features = _frombuffer(view[kv_bytes:]).view(getattr(torch, layout.feature_dtype))
    return kv, features.reshape(num_tokens, layout.feature_size)


def checksum(buffer: Any) -> int:
    return zlib.crc32(buffer) & 0xFFFFFFFF
