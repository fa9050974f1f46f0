"""Attention that is not plain causal attention, on the native decode kernel (kernels/csrc/decode_attention.c):
sliding windows, Gemma 2's logit soft-cap, gpt-oss's sinks, and tree drafts' masks.

The decode kernel attends each query row over a list of pool slots, so any mask whose visible keys a
row can list is one call: every new token of an extend becomes a query row of its own. The rows of one
request share its table row and each reads its own stretch of it (`RowTables`): a window
(p - window, p] or the causal 0..p. A tree draft's rows each list the tree nodes they see, after the
request's keys before the tree, which all of them see: those form a cascade group (read once for all the
request's rows). The cap and the sinks are arguments of the kernel. windowed.py stays the torch path (and
the oracle of the tests) for what the kernel does not take: other dtypes, encoders, MLA.

A windowed layer's table holds only what its rows can see (the last `window` slots of a decoding request;
from the first new token's window on in an extend), so its cost does not grow with the context. Slots
are the layer's own (`kv_slots`: the hybrid pool keeps windowed layers' K/V apart); the tables are built
once per forward batch and kind of layer, at their first use, and shared by the layers of that kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from engine.kernels import attention as attention_kernels
from engine.kernels import library

if TYPE_CHECKING:
    from engine.layers.radix_attention import RadixAttention
    from engine.mem_cache.memory_pool import MHATokenToKVPool
    from engine.model_executor.forward_batch_info import ForwardBatch


@dataclass
class KernelTables:
    """decode_attention's tables for one kind of layer: q row b reads kv_indices[row_of[b]][starts[b]:]
    (its own row without `rows`) for lens[b] slots, after its cascade group's prefix if it has one."""

    kv_indices: torch.Tensor
    lens: torch.Tensor
    rows: Optional[attention_kernels.RowTables] = None
    cascade: Optional[attention_kernels.CascadeTables] = None


def kernel_takes(q: torch.Tensor, k_buf: torch.Tensor, layer: "RadixAttention") -> bool:
    """Whether the decode kernel computes this layer's attention: a causal layer (K and V of one size)
    whose q and pool dtypes it reads."""
    return layer.is_causal and layer.v_head_dim == layer.head_dim and attention_kernels.supports(q, k_buf)


class KernelRows:
    """One forward batch's tables (built at first use, shared by the layers of one window and slot map)."""

    def __init__(self, batch: "ForwardBatch") -> None:
        self.batch = batch
        self._tables: Dict[Tuple[str, int, bool], KernelTables] = {}

    def attend(self, q: torch.Tensor, layer: "RadixAttention", plain_decode: Optional[KernelTables] = None) -> torch.Tensor:
        """The layer's attention for every row of q ([rows, heads * head_dim]: one per request in a decode
        batch, one per new token in an extend); the K/V of this forward are in the pool already.
        plain_decode: a decode batch's full-attention tables (with its cascade), for unwindowed layers."""
        fb = self.batch
        pool = fb.token_to_kv_pool
        assert pool is not None  # ForwardBatch.init_new sets it
        tables = self._tables_for(layer, pool, plain_decode)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        return attention_kernels.decode_attention(
            q.reshape(q.shape[0], -1), k_buf, v_buf, tables.kv_indices, tables.lens, layer.tp_q_head_num,
            layer.tp_k_head_num, layer.head_dim, layer.scaling, cascade=tables.cascade, layer_id=layer.layer_id,
            kv_scales=pool.kv_scales(layer.layer_id), logit_cap=layer.logit_cap, sinks=layer.sinks,
            rows=tables.rows)

    def attend_last_rows(self, q_rows: torch.Tensor, layer: "RadixAttention") -> torch.Tensor:
        """The layer's attention for each request's last new token of an extend batch alone (q_rows
        [requests, heads * head_dim]), over the keys it sees: as a decode step of the whole sequence
        (forward_extend_last_rows; the batch's K/V are in the pool already)."""
        fb = self.batch
        pool = fb.token_to_kv_pool
        assert pool is not None  # ForwardBatch.init_new sets it
        tables = self._tables_for(layer, pool, None, last_rows=True)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        return attention_kernels.decode_attention(
            q_rows, k_buf, v_buf, tables.kv_indices, tables.lens, layer.tp_q_head_num, layer.tp_k_head_num,
            layer.head_dim, layer.scaling, layer_id=layer.layer_id, kv_scales=pool.kv_scales(layer.layer_id),
            logit_cap=layer.logit_cap, sinks=layer.sinks)

    def _tables_for(self, layer: "RadixAttention", pool: "MHATokenToKVPool", plain_decode: Optional[KernelTables],
                    last_rows: bool = False) -> KernelTables:
        fb = self.batch
        window = max(layer.sliding_window_size, 0)  # 0: none
        mapped = pool.slot_map(layer.layer_id) is not None
        if last_rows:
            kind = "last"  # each request's last token over its sequence's visible keys, as a decode row
        elif fb.spec_tree_mask is not None:
            kind = "tree"
        elif fb.forward_mode.is_decode():
            kind = "decode"
        else:
            kind = "extend"
        key = (kind, window, mapped)
        tables = self._tables.get(key)
        if tables is None:
            cascade = not _panel_phase(pool)
            if kind == "tree":
                tables = _tree_rows(fb, cascade, window)
            elif kind == "decode" and window == 0 and plain_decode is not None and (
                    cascade or plain_decode.cascade is None):
                tables = plain_decode
            elif kind in ("decode", "last"):
                tables = _decode_rows(fb, window)
            else:
                tables = _extend_rows(fb, window, cascade)
            if mapped:  # the layer's own slots (the same map for every windowed layer)
                tables = _translated(tables, pool, layer.layer_id)
            self._tables[key] = tables
        return tables


def _panel_phase(pool: "MHATokenToKVPool") -> bool:
    """Whether the kernel's cascade reads a bf16 pool's prefixes as packed panels (attend_step.h, on
    AVX512-BF16 CPUs): a path these rows are not tested on (no such CPU where they were written), so
    they take no cascade there: each row lists its prefix itself."""
    lib = library.attention()
    return (pool.dtype == torch.bfloat16 and lib is not None
            and lib.kept_prefix_elems(1, pool.head_num, pool.head_dim) != 0)


def _translated(tables: KernelTables, pool: "MHATokenToKVPool", layer_id: int) -> KernelTables:
    cascade = tables.cascade
    if cascade is not None:
        cascade = attention_kernels.CascadeTables(
            cascade.group_offsets, cascade.members, pool.kv_slots(layer_id, cascade.prefix_indices).contiguous(),
            cascade.prefix_lens, cascade.group_of)  # no kept panels: those are of full-pool slots
    return KernelTables(pool.kv_slots(layer_id, tables.kv_indices).contiguous(), tables.lens, tables.rows, cascade)


def _decode_rows(fb: "ForwardBatch", window: int) -> KernelTables:
    """Each request's last min(window, seq_len) slots (all of them with window 0)."""
    assert fb.req_to_token_pool is not None  # ForwardBatch.init_new sets it
    table = fb.req_to_token_pool.req_to_token
    seq_lens = fb.seq_lens.long()
    spans = seq_lens.clamp(max=window) if window > 0 else seq_lens
    width = int(spans.max())
    offsets = torch.arange(width, device=seq_lens.device)
    cols = (seq_lens - spans).unsqueeze(1) + offsets
    valid = offsets.unsqueeze(0) < spans.unsqueeze(1)
    slots = table[fb.req_pool_indices.long().unsqueeze(1), cols.clamp(max=table.shape[1] - 1)].long()
    return KernelTables(torch.where(valid, slots, torch.zeros_like(slots)).contiguous(), spans.contiguous())


def _extend_rows(fb: "ForwardBatch", window: int, cascade: bool = True) -> KernelTables:
    """One row per new token, at position p: the keys (p - window, p] (0..p without a window) of its
    request's table row, which starts at its first new token's first visible key."""
    # ForwardBatch.init_new sets these for an extend batch.
    assert fb.req_to_token_pool is not None and fb.extend_seq_lens_cpu is not None
    assert fb.extend_prefix_lens_cpu is not None
    table = fb.req_to_token_pool.req_to_token
    device = fb.seq_lens.device
    live = [i for i, n in enumerate(fb.extend_seq_lens_cpu) if n > 0]
    ext = torch.tensor([fb.extend_seq_lens_cpu[i] for i in live], dtype=torch.long, device=device)
    prefix = torch.tensor([fb.extend_prefix_lens_cpu[i] for i in live], dtype=torch.long, device=device)
    seq = prefix + ext
    first = (prefix - window + 1).clamp(min=0) if window > 0 else torch.zeros_like(prefix)
    width = int((seq - first).max())
    cols = first.unsqueeze(1) + torch.arange(width, device=device)
    pool_rows = fb.req_pool_indices.long()[torch.tensor(live, dtype=torch.long, device=device)]
    slots = table[pool_rows.unsqueeze(1), cols.clamp(max=table.shape[1] - 1)].long()
    kv_indices = torch.where(cols < seq.unsqueeze(1), slots, torch.zeros_like(slots)).contiguous()
    row_of = torch.repeat_interleave(torch.arange(len(live), device=device), ext)
    token_starts = torch.cumsum(ext, 0) - ext
    positions = prefix[row_of] + torch.arange(int(ext.sum()), device=device) - token_starts[row_of]
    visible_from = (positions - window + 1).clamp(min=0) if window > 0 else torch.zeros_like(positions)
    if window > 0 or not cascade or not any(n > 0 for n in prefix.tolist()):
        rows = attention_kernels.RowTables(row_of.contiguous(), (visible_from - first[row_of]).contiguous())
        return KernelTables(kv_indices, (positions + 1 - visible_from).contiguous(), rows)
    # Unwindowed with a cached prefix: every new token of a request sees its whole prefix, a cascade
    # group read once per KV head for all of them; each row then reads its new tokens up to itself.
    groups = [i for i, n in enumerate(prefix.tolist()) if n > 0]
    members = [torch.arange(int(token_starts[i]), int(token_starts[i] + ext[i])) for i in groups]
    prefixes = [kv_indices[i, :int(prefix[i])] for i in groups]
    groups_table = _request_groups(members, prefixes, int(ext.sum()))
    rows = attention_kernels.RowTables(row_of.contiguous(), prefix[row_of].contiguous())
    return KernelTables(kv_indices, (positions + 1 - prefix[row_of]).contiguous(), rows, groups_table)


def _tree_rows(fb: "ForwardBatch", cascade: bool = True, window: int = 0) -> KernelTables:
    """One row per new token: the tree nodes its mask shows, after the request's keys before the tree
    block, which every row of the request sees: a cascade group per request (read once for its rows;
    without `cascade`, listed in each row). With a window, a row at position p sees the keys before the
    block from p - window + 1 on, listed in each row; its visible nodes (its ancestors, less than a
    window away: the speculator refuses trees deeper than a window) all of them."""
    # ForwardBatch.init_new sets these for an extend batch; set_tree_mask the widths.
    assert fb.req_to_token_pool is not None and fb.extend_seq_lens_cpu is not None
    assert fb.spec_tree_widths_cpu is not None
    table = fb.req_to_token_pool.req_to_token
    pool_rows: List[int] = fb.req_pool_indices.tolist()
    lists: List[torch.Tensor] = []
    counts: List[torch.Tensor] = []
    members: List[torch.Tensor] = []
    prefixes: List[torch.Tensor] = []
    first_row = 0
    for i, (row, seq_len, ext_len) in enumerate(zip(pool_rows, fb.seq_lens_cpu, fb.extend_seq_lens_cpu)):
        if ext_len == 0:
            continue
        block = fb.tree_mask_block(i)
        assert block is not None  # a tree batch has one per request
        width = block.shape[1]
        nodes = table[row, seq_len - width:seq_len].long()
        positions = torch.arange(width, device=block.device)
        # Each row's visible nodes first, in order: the positions of hidden ones sort past them.
        order = torch.where(block, positions, width).sort(dim=1).values.clamp(max=width - 1)
        count = block.sum(1)
        listed = torch.where(positions < count.unsqueeze(1), nodes[order], 0)
        if window > 0:
            # Row j (at position p) lists the keys before the block from p - window + 1 on, then its nodes.
            before_len = seq_len - width
            before = table[row, :before_len].long()
            firsts = (fb.positions[first_row:first_row + ext_len] - window + 1).clamp(min=0, max=before_len).tolist()
            per_row = [torch.cat([before[f:], listed[j, :int(count[j])]]) for j, f in enumerate(firsts)]
            count = torch.tensor([r.numel() for r in per_row], dtype=torch.long, device=block.device)
            listed = torch.nn.utils.rnn.pad_sequence(per_row, batch_first=True)
        elif not cascade and seq_len > width:
            before = table[row, :seq_len - width].long()
            listed = torch.cat([before.expand(ext_len, -1), listed], dim=1)
            count = count + before.numel()
        lists.append(listed)
        counts.append(count)
        if cascade and window == 0 and seq_len > width:
            members.append(torch.arange(first_row, first_row + ext_len))
            prefixes.append(table[row, :seq_len - width].long())
        first_row += ext_len
    width = max(t.shape[1] for t in lists)
    kv_indices = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in lists]).contiguous()
    lens = torch.cat(counts).long().contiguous()
    return KernelTables(kv_indices, lens, None, _request_groups(members, prefixes, first_row) if members else None)


def _request_groups(members: List[torch.Tensor], prefixes: List[torch.Tensor], rows: int
                    ) -> attention_kernels.CascadeTables:
    """Cascade groups: group g's rows `members[g]` all see the slots `prefixes[g]` first."""
    sizes = torch.tensor([m.numel() for m in members], dtype=torch.long)
    prefix_lens = torch.tensor([p.numel() for p in prefixes], dtype=torch.long)
    prefix = torch.zeros(len(prefixes), int(prefix_lens.max()), dtype=torch.long)
    group_of = torch.full((rows,), -1, dtype=torch.long)
    for g, (m, p) in enumerate(zip(members, prefixes)):
        prefix[g, :p.numel()] = p
        group_of[m] = g
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    return attention_kernels.CascadeTables(offsets, torch.cat(members).long(), prefix, prefix_lens, group_of)
