"""In-process PD pairs: a prefill and a decode Scheduler wired by a LoopbackNetwork.

`PDFakeWorker` is the fake worker with a real (tiny) KV pool: every forward writes each input
token's id into its slot's K (and minus it into V), and the next token is the sum of the request's
K over all its positions, so an output is right only if every KV entry (transferred, restored
after a retraction, or computed) is. `PDPair.step()` steps the prefill, pumps the network, steps
the decode and pumps again, then checks the invariants of reference/disaggregation.md §11.4.
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional

import torch

from engine.disaggregation.loopback import LoopbackNetwork
from engine.scheduler.tp_worker import GenerationBatchResult, worker_limits
from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from engine.mem_cache.memory_pool import MHATokenToKVPool
from engine.scheduler.overlap_utils import resolve_relay_input_ids, write_relay
from sched_utils import EOS, VOCAB, FakeWorker, ForwardRecord, Harness

BOOTSTRAP_HOST = "127.0.0.1"
BOOTSTRAP_PORT = 8998


class PDFakeWorker(FakeWorker):
    def __init__(self, max_total_tokens: int = 4096, page_size: int = 1, max_running: int = 32,
                 context_len: int = 2048, next_token: Optional[Callable[[int], int]] = None,
                 extra_rows: int = 0) -> None:
        super().__init__(max_total_tokens, page_size, max_running + extra_rows, context_len, next_token)
        self.max_running = max_running
        self.kv_pool = MHATokenToKVPool(max_total_tokens, page_size, torch.float32, head_num=1, head_dim=2,
                                        layer_num=2)
        if page_size == 1:
            self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_total_tokens, torch.float32, "cpu",
                                                                     self.kv_pool)
        else:
            self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(max_total_tokens, page_size, torch.float32,
                                                                          "cpu", self.kv_pool)
        self.custom_next = next_token
        # Stands in for the weights: every K and V written is scaled by it (an update changes it).
        self.kv_scale = 1.0

    def get_worker_info(self) -> Dict:
        info = worker_limits(self.max_total_tokens, self.context_len, self.req_to_token_pool.size,
                             self.max_running, VOCAB, self.page_size, "cpu", total_kv_heads=1)
        return info

    def forward_batch_generation(self, batch) -> GenerationBatchResult:
        ids = resolve_relay_input_ids(batch.input_ids, batch.relay_rows, self.output_tokens_buf)
        values = ids.to(torch.float32) * self.kv_scale
        for layer in range(self.kv_pool.layer_num):
            cache = torch.stack([values, values + layer], dim=1).view(-1, 1, 2)
            self.kv_pool.set_kv_buffer(layer, batch.out_cache_loc, cache, -cache)
        table = self.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices.tolist()
        if batch.forward_mode.is_extend():
            ends = torch.cumsum(torch.tensor(batch.extend_seq_lens), 0).tolist()
            last = [int(ids[e - 1]) for e in ends]
        else:
            last = ids.tolist()
        nxt = []
        for row, seq_len, last_token in zip(rows, batch.seq_lens_cpu, last):
            if self.custom_next is not None:
                nxt.append(self.custom_next(last_token))
                continue
            slots = table[row, :seq_len].to(torch.int64)
            kv_sum = int(self.kv_pool.k_buffer[0][slots, 0, 0].sum().item())
            nxt.append(kv_sum % (VOCAB - 1))
        self.records.append(ForwardRecord(batch.forward_mode.name, batch.batch_size, batch.extend_seq_lens, rows))
        next_ids = torch.tensor(nxt, dtype=torch.int64)
        write_relay(self.output_tokens_buf, batch.req_pool_indices, next_ids)
        return GenerationBatchResult(logits_output=None, next_token_ids=next_ids)


def pd_args(mode: str, **kwargs) -> dict:
    # Timeouts the fault tests step past with a fake clock (pd tests never wait for them).
    args = dict(disaggregation_mode=mode, disaggregation_transfer_backend="loopback",
                disaggregation_bootstrap_port=BOOTSTRAP_PORT, host=BOOTSTRAP_HOST, num_reserved_decode_tokens=4,
                disaggregation_bootstrap_timeout=30.0, disaggregation_waiting_timeout=30.0)
    args.update(kwargs)
    return args


def record_decode_backups(monkeypatch) -> List[str]:
    """The rids the decode side backs up when it retracts (DecodePreallocQueue.add_retracted), in order:
    tests that size the decode pool to force retraction check it happened."""
    from engine.disaggregation.decode_prealloc import DecodePreallocQueue

    backups: List[str] = []
    add_retracted = DecodePreallocQueue.add_retracted

    def counted(self, req):
        backups.append(req.rid)
        add_retracted(self, req)

    monkeypatch.setattr(DecodePreallocQueue, "add_retracted", counted)
    return backups


class PDPair:
    def __init__(self, prefill_worker=None, decode_worker=None, overlap_prefill: bool = False,
                 overlap_decode: bool = False, prefill_kwargs: Optional[dict] = None,
                 decode_kwargs: Optional[dict] = None, tokenizer=None, network: Optional[LoopbackNetwork] = None,
                 check_every_step: bool = True) -> None:
        self.net = network or LoopbackNetwork()
        decode_kwargs = dict(decode_kwargs or {})
        self.prefill = Harness(worker=prefill_worker or PDFakeWorker(), tokenizer=tokenizer, overlap=overlap_prefill,
                               transfer_network=self.net, **pd_args("prefill", **(prefill_kwargs or {})))
        self.decode = Harness(worker=decode_worker or PDFakeWorker(extra_rows=32), tokenizer=tokenizer,
                              overlap=overlap_decode, transfer_network=self.net, **pd_args("decode", **decode_kwargs))
        self.rooms = itertools.count(1000)
        # Re-bootstraps after pause(retract) reach the prefill as its bootstrap server posts them.
        self.net.recompute_sinks[f"{BOOTSTRAP_HOST}:{BOOTSTRAP_PORT}"] = self._recompute
        self.check_every_step = check_every_step
        self.steps = 0

    def submit(self, prompt: List[int], rid: Optional[str] = None, to_prefill: bool = True,
               to_decode: bool = True, **sampling) -> str:
        rid = rid or f"r{next(self.rooms)}"
        room = sampling.pop("bootstrap_room", None) or next(self.rooms)
        boot = dict(bootstrap_host=sampling.pop("bootstrap_host", BOOTSTRAP_HOST),
                    bootstrap_port=sampling.pop("bootstrap_port", BOOTSTRAP_PORT), bootstrap_room=room)
        if to_prefill:
            self.prefill.submit(prompt, rid=rid, **dict(sampling), **boot)
        if to_decode:
            self.decode.submit(prompt, rid=rid, **dict(sampling), **boot)
        return rid

    def _recompute(self, body: dict) -> bool:
        """The prefill's /generate of a re-bootstrap body (decode -> bootstrap server -> here)."""
        options = {k: body[k] for k in ("priority", "extra_key", "cache_salt") if body.get(k) is not None}
        self.prefill.submit(body["input_ids"], rid=body["rid"], bootstrap_host=body["bootstrap_host"],
                            bootstrap_port=body["bootstrap_port"], bootstrap_room=body["bootstrap_room"],
                            **options, **body["sampling_params"])
        return True

    def step(self) -> None:
        self.prefill.step()
        self.net.pump()
        self.decode.step()
        self.net.pump()
        self.steps += 1
        if self.check_every_step:
            check_decode_invariants(self.decode.scheduler)
            check_prefill_invariants(self.prefill.scheduler)

    def busy(self) -> bool:
        return (self.prefill.scheduler.has_work() or self.decode.scheduler.has_work()
                or bool(self.net.jobs) or bool(self.net.messages))

    def run_until_idle(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.busy():
                break
            self.step()
        else:
            raise AssertionError("the PD pair did not become idle")
        # One more step each: the idle memory self-check (strict) runs on both sides.
        self.step()
        check_idle(self)

    def run_counting_retractions(self, max_steps: int = 2000) -> int:
        """run_until_idle, returning the most requests the decode side held retracted at once."""
        retracted = 0
        for _ in range(max_steps):
            if not self.busy():
                break
            self.step()
            retracted = max(retracted, len(self.decode.scheduler.disagg.prealloc.retracted_queue))
        self.run_until_idle()
        return retracted

    def close(self) -> None:
        self.prefill.scheduler.shutdown()
        self.decode.scheduler.shutdown()


def _slots_held(kv_len: int, page: int) -> int:
    return -(-kv_len // page) * page


def check_decode_invariants(scheduler) -> None:
    """§11.4 on the decode side: rows, KV slots and metadata rows are all accounted for."""
    d = scheduler.disagg
    holders = [dr.req for dr in d.transfer.queue] + list(d.waiting) + list(scheduler.running_batch.reqs)
    live = [r for r in holders if r.req_pool_idx is not None]
    rows = [r.req_pool_idx for r in live]
    assert len(set(rows)) == len(rows), "a request row is held twice"
    pool = scheduler.req_to_token_pool
    assert pool.available_size() + len(rows) == pool.size, (pool.available_size(), len(rows), pool.size)
    page = scheduler.page_size
    held = sum(_slots_held(r.kv_allocated_len, page) for r in live)
    allocator = scheduler.token_to_kv_pool_allocator
    assert allocator.available_size() + held == scheduler.max_total_num_tokens, \
        (allocator.available_size(), held, scheduler.max_total_num_tokens)
    meta = d.memory.metadata_allocator
    in_transfer = [dr.metadata_buffer_index for dr in d.transfer.queue]
    assert meta.available_size() + len(in_transfer) == meta.size
    for index in meta.free_slots:
        assert d.memory.metadata.room(index) == 0, f"free metadata row {index} carries a room stamp"
    rooms = [dr.req.bootstrap_room for dr in d.prealloc.queue] + [dr.req.bootstrap_room for dr in d.transfer.queue]
    rooms += [r.bootstrap_room for r in d.waiting] + [r.bootstrap_room for r in scheduler.running_batch.reqs
                                                      if not r.finished()]
    assert len(set(rooms)) == len(rooms), "a room is in two queues"


def check_prefill_invariants(scheduler) -> None:
    p = scheduler.disagg
    meta = p.metadata_allocator
    assert meta.available_size() + len(p.inflight) == meta.size
    for index in meta.free_slots:
        assert p.metadata.room(index) == 0, f"free metadata row {index} carries a room stamp"
    rows = [pr.req.req_pool_idx for pr in p.inflight] + [pr.req.req_pool_idx for pr in p.tracked.values()
                                                         if pr.req.req_pool_idx is not None]
    assert len(set(rows)) == len(rows)
    assert scheduler.req_to_token_pool.available_size() + len(rows) == scheduler.req_to_token_pool.size
    assert scheduler.running_batch.is_empty(), "a PD prefill server never decodes"


def check_idle(pair: PDPair) -> None:
    """Both sides back at the empty-pool baseline; no transfer state left anywhere."""
    for side in (pair.prefill.scheduler, pair.decode.scheduler):
        assert side.is_fully_idle()
        assert side.req_to_token_pool.available_size() == side.req_to_token_pool.size
        free = side.token_to_kv_pool_allocator.available_size() + side.tree_cache.evictable_size()
        assert free == side.max_total_num_tokens and side.tree_cache.protected_size() == 0
        assert side.disagg.check_memory() is None, side.disagg.check_memory()
    prefill_manager = pair.prefill.scheduler.disagg.manager
    if prefill_manager is not None:
        assert prefill_manager.idle_state() == {"rooms": 0, "destinations": 0}, prefill_manager.idle_state()
    decode_manager = pair.decode.scheduler.disagg.manager
    if decode_manager is not None:
        assert decode_manager.idle_state() == {"rooms": 0, "statuses": 0}, decode_manager.idle_state()


def unified(worker=None, overlap: bool = False, tokenizer=None, **kwargs) -> Harness:
    return Harness(worker=worker or PDFakeWorker(), tokenizer=tokenizer, overlap=overlap, **kwargs)


__all__ = ["EOS", "VOCAB", "PDFakeWorker", "PDPair", "unified", "check_idle"]
