"""PD building blocks without a scheduler: the status table rules, metadata rows and their
allocator, the KV data path, pairing of TP layouts, the wire messages, the admission budget, the
bootstrap server and its client, the ZMQ transport, and the request fields at the edge."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.disaggregation import protocol
from engine.disaggregation import base
from engine.disaggregation.base import (
    UNKNOWN_FAILURE,
    FailureCause,
    KVPoll,
    StatusTable,
    agreed_failures,
    poll_and_all_reduce,
    validate_bootstrap_fields,
)
from engine.disaggregation.bootstrap import BootstrapServer, BootstrapUnavailable, HttpBootstrapClient
from engine.disaggregation.decode import AdmissionState, DecodeMemory, RetractedReq, allocatable_tokens, fits
from engine.disaggregation.kv_io import (
    KVLayout,
    as_bytes,
    checksum,
    from_bytes,
    gather_kv,
    kv_heads_of_rank,
    pair_ranks,
    scatter_kv,
)
from engine.disaggregation.metadata import (
    METADATA_ROW_BYTES,
    FirstTokenMetadata,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
)
from engine.disaggregation.transport import ZmqTransport
from engine.scheduler.req import Req
from engine.mem_cache.allocator import TokenToKVPoolAllocator
from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from engine.sampling.sampling_params import SamplingParams
from engine.utils.network_utils import get_free_port


# ---------------------------------------------------------------------------- status table
def test_status_moves_forward_only_and_failed_is_sticky():
    table = StatusTable()
    table.register(7)
    assert table.update(7, KVPoll.Transferring)
    assert not table.update(7, KVPoll.WaitingForInput)  # never backwards
    assert table.get(7) == KVPoll.Transferring
    assert table.fail(7, "first", FailureCause.TIMEOUT)
    assert table.fail(7, "second", FailureCause.CORRUPT)  # still live, but the first reason stays
    assert not table.update(7, KVPoll.Success)
    assert table.get(7) == KVPoll.Failed and table.failure(7) == ("first", FailureCause.TIMEOUT)


class _Failure:
    def __init__(self, failure):
        self._failure = failure

    def failure(self):
        return self._failure


def test_failure_reason_is_none_until_recorded():
    table = StatusTable()
    table.register(3)
    assert table.failure(3) is None
    table.fail(3, "lost", FailureCause.PEER_DEAD)
    assert table.failure(3) == ("lost", FailureCause.PEER_DEAD)


def test_agreed_failures_take_the_reason_another_rank_recorded(monkeypatch):
    # The polls are reduced: rank 0 fails a request that only rank 1 saw fail (its heartbeat fired
    # first). Rank 0's client must still get rank 1's reason, not "the state was cleared".
    heartbeat = ("the prefill server at h:1 missed 2 heartbeats", FailureCause.PEER_DEAD)
    timeout = ("waiting timeout", FailureCause.TIMEOUT)
    rank1 = [heartbeat, None]
    monkeypatch.setattr(base, "all_gather_objects", lambda local: [local, rank1])
    reasons = agreed_failures([_Failure(None), _Failure(timeout)])
    assert reasons == [heartbeat, timeout]  # the lowest rank with a reason wins
    monkeypatch.setattr(base, "all_gather_objects", lambda local: [local, [None]])
    assert agreed_failures([_Failure(None)]) == [UNKNOWN_FAILURE]


def test_agreed_failures_on_one_rank_make_no_collective_for_nothing():
    assert agreed_failures([]) == []
    assert agreed_failures([_Failure(("x", FailureCause.CORRUPT))]) == [("x", FailureCause.CORRUPT)]


def test_cleared_room_is_never_resurrected():
    table = StatusTable()
    table.register(9)
    table.clear(9)
    assert not table.update(9, KVPoll.Success)
    assert not table.fail(9, "late", FailureCause.PEER_DEAD)  # a late failure poisons nothing
    assert 9 not in table and len(table) == 0
    table.register(9)  # the room number comes back for a new request: a clean state
    assert table.get(9) == KVPoll.Bootstrapping


def test_poll_reduction_is_the_identity_on_one_rank():
    class Source:
        def __init__(self, value):
            self.value = value

        def poll(self):
            return self.value

    values = [KVPoll.Success, KVPoll.Failed, KVPoll.Transferring]
    assert poll_and_all_reduce(Source(v) for v in values) == values


@pytest.mark.parametrize("host, port, room, needle", [
    (None, 8998, 5, "bootstrap_host"),
    ("h", None, None, "bootstrap_port, bootstrap_room"),
    ("h", 8998, 0, "[1, 2^63)"),
    ("h", 70000, 3, "[1, 65535]"),
    ("", 8998, 3, "must not be empty"),
])
def test_bootstrap_fields_are_checked(host, port, room, needle):
    assert needle in validate_bootstrap_fields(host, port, room)


def test_valid_bootstrap_fields_pass():
    assert validate_bootstrap_fields("10.0.0.1", 8998, 2**63 - 1) is None


# ---------------------------------------------------------------------------- metadata
def test_metadata_row_round_trip_and_reset():
    table = MetadataBuffers(4)
    meta = FirstTokenMetadata(room=123, output_id=42, cached_tokens=3, logprob=-0.5, top_val=[-0.5, -1.5],
                              top_idx=[42, 7])
    table.set_buf(2, meta)
    assert table.get_buf(2) == meta
    other = MetadataBuffers(4)
    data = table.row_bytes(2)
    assert len(data) == METADATA_ROW_BYTES
    other.write_row_bytes(1, data)
    assert other.get_buf(1) == meta and other.room(1) == 123
    other.reset(1)
    assert other.room(1) == 0 and other.get_buf(1).output_id == 0


def test_metadata_allocator_reuses_rows_and_refuses_double_free():
    alloc = ReqToMetadataIdxAllocator(2)
    a, b = alloc.alloc(), alloc.alloc()
    assert alloc.alloc() is None
    alloc.free(a)
    assert alloc.alloc() == a
    alloc.free(b)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)


# ---------------------------------------------------------------------------- KV data path
def _pool(size=32, heads=2, dtype=torch.float32):
    return MHATokenToKVPool(size, 1, dtype, head_num=heads, head_dim=4, layer_num=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scatter_moves_kv_bit_for_bit(dtype):
    src, dst = _pool(dtype=dtype), _pool(dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for buffers in (src.k_buffer, src.v_buffer):
        for layer in buffers:
            layer.copy_(torch.randn(layer.shape, generator=gen).to(dtype))
    src_slots, dst_slots = torch.tensor([3, 9, 4, 20]), torch.tensor([30, 1, 17, 2])
    layout = KVLayout.of_pool(src, total_kv_heads=2, tp_size=1, tp_rank=0)
    payload = as_bytes(gather_kv(src, src_slots))
    assert payload.nbytes == 4 * layout.bytes_per_token()
    scatter_kv(dst, dst_slots, from_bytes(bytes(payload), layout, 4, 2))
    for layer in range(3):
        assert torch.equal(dst.k_buffer[layer][dst_slots], src.k_buffer[layer][src_slots])
        assert torch.equal(dst.v_buffer[layer][dst_slots], src.v_buffer[layer][src_slots])
    assert checksum(payload) == checksum(bytes(payload))


def test_gather_of_a_head_slice():
    pool = _pool(heads=2)
    for layer in pool.k_buffer:
        layer.copy_(torch.arange(layer.numel(), dtype=torch.float32).view(layer.shape))
    part = gather_kv(pool, torch.tensor([5]), head_start=1, num_heads=1)
    assert torch.equal(part[1, 0, 0, 0], pool.k_buffer[1][5, 1])


@pytest.mark.parametrize("total, tp, rank, heads", [(4, 1, 0, [0, 1, 2, 3]), (4, 2, 1, [2, 3]), (2, 4, 3, [1]),
                                                    (2, 4, 0, [0])])
def test_kv_heads_of_a_rank_follow_the_qkv_sharding(total, tp, rank, heads):
    assert kv_heads_of_rank(total, tp, rank) == heads


def _layout(tp, rank, total=4, **kw):
    return KVLayout(num_layers=2, total_kv_heads=total, head_dim=8, dtype="float32", tp_size=tp, tp_rank=rank, **kw)


def test_pairing_decode_ranks_with_prefill_ranks():
    assert pair_ranks(_layout(1, 0), _layout(1, 0)) == (0, 0, 4)
    # tp=2 decode pulls half of the heads each from a tp=1 prefill.
    assert pair_ranks(_layout(1, 0), _layout(2, 0)) == (0, 0, 2)
    assert pair_ranks(_layout(1, 0), _layout(2, 1)) == (0, 2, 2)
    assert pair_ranks(_layout(2, 0), _layout(2, 1)) == (1, 0, 2)
    with pytest.raises(ValueError, match="no single prefill rank"):
        pair_ranks(_layout(2, 0), _layout(1, 0))  # one decode rank would need two prefill ranks
    with pytest.raises(ValueError, match="num_layers"):
        pair_ranks(KVLayout(3, 4, 8, "float32", 1, 0), _layout(1, 0))


# ---------------------------------------------------------------------------- wire messages
def test_messages_round_trip():
    payload = b"\x01\x02\x03"
    for header in (protocol.KVFrame(room=1, token_offset=4, num_tokens=2, crc=99),
                   protocol.AuxFrame(room=1, aux_index=3, crc=7),
                   protocol.StatusMsg(room=1, success=False, prefill_rank=0, reason="r", cause="timeout"),
                   protocol.AbortMsg(room=5, endpoint="tcp://x:1"),
                   protocol.DstInfo(room=2, endpoint="e", num_tokens=3, decode_prefix_len=0, aux_index=1,
                                    decode_tp_rank=0, required_dst_num=1, head_start=0, num_heads=2)):
        frames = protocol.encode(header, payload if isinstance(header, (protocol.KVFrame, protocol.AuxFrame)) else None)
        decoded, data = protocol.decode(frames)
        assert decoded == header and protocol.kind(frames) == type(header).__name__
        assert data == (payload if len(frames) > 1 else None)
    assert protocol.kind([b"garbage"]) == "?"


# ---------------------------------------------------------------------------- admission budget
def _req(prompt, outputs=0, max_new=16):
    req = Req("r", list(range(1, prompt + 1)), SamplingParams(max_new_tokens=max_new))
    req.output_ids = [1] * outputs
    return req


def _memory(total, reserve):
    allocator = TokenToKVPoolAllocator(total, torch.float32, "cpu")
    return DecodeMemory(req_to_token_pool=ReqToTokenPool(8, 64), allocator=allocator, tree_cache=None,
                        metadata=MetadataBuffers(8), metadata_allocator=ReqToMetadataIdxAllocator(8),
                        max_total_num_tokens=total, num_reserved_decode_tokens=reserve)


@pytest.mark.parametrize("case", [
    # empty pool: everything is allocatable
    dict(total=100, taken=0, running=[], transferring=0, waiting=0, retracted=[], expect=100),
    # a full pool
    dict(total=100, taken=100, running=[], transferring=0, waiting=0, retracted=[], expect=0),
    # reserve per live request (running + transferring + waiting)
    dict(total=100, taken=20, running=[(10, 2, 16)], transferring=1, waiting=1, retracted=[], expect=80 - 3 * 8),
    # the hungriest running request dominates the reserve
    dict(total=200, taken=12, running=[(10, 2, 100)], transferring=0, waiting=0, retracted=[], expect=188 - 98),
    # a retracted backlog is set aside first
    dict(total=100, taken=0, running=[], transferring=0, waiting=0, retracted=[20, 5], expect=100 - (20 + 8) - (5 + 8)),
])
def test_allocatable_tokens_table(case):
    memory = _memory(case["total"], reserve=8)
    if case["taken"]:
        memory.allocator.alloc(case["taken"])
    running = [_req(p, o, m) for p, o, m in case["running"]]
    retracted = [RetractedReq(req=_req(4), kv_backup=None, committed_len=c) for c in case["retracted"]]
    state = AdmissionState(running=running, num_transferring=case["transferring"], num_waiting=case["waiting"])
    assert allocatable_tokens(memory, state, retracted, admitted_now=0) == case["expect"]


def test_fits_needs_the_reserve_and_the_whole_lifetime():
    memory = _memory(100, reserve=8)
    state = AdmissionState()
    assert fits(memory, state, _req(20, max_new=60), required=20, allocatable=80)
    assert not fits(memory, state, _req(20, max_new=70), required=20, allocatable=80)  # lifetime 90 > 80
    assert not fits(memory, state, _req(75, max_new=1), required=75, allocatable=80)  # 75 + 8 > 80
    # Running requests could all be retracted: their tokens count for the lifetime rule.
    running = AdmissionState(running=[_req(30, 10)])
    assert fits(memory, running, _req(20, max_new=70), required=20, allocatable=80)


# ---------------------------------------------------------------------------- bootstrap server
def test_bootstrap_server_routes_and_client():
    port = get_free_port()
    server = BootstrapServer("127.0.0.1", port, tp_size=2)
    client = HttpBootstrapClient()
    addr = f"127.0.0.1:{port}"
    try:
        session = client.session(addr)
        assert session == server.session_id
        info = {"attn_tp_size": 2, "attn_tp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 1, "endpoint": "tcp://a:1",
                "page_size": 1, "kv_cache_dtype": "float32", "metadata_schema_version": 1, "kv_layout": {}}
        client.register(addr, info)
        assert client.fetch(addr) is None  # 503 until every rank registered
        client.register(addr, {**info, "attn_tp_rank": 1, "endpoint": "tcp://a:2"})
        full = client.fetch(addr)
        assert full["attn_tp_size"] == 2 and full["ranks"]["1"]["endpoint"] == "tcp://a:2"
        assert full["session_id"] == session
        with pytest.raises(RuntimeError, match="refused"):
            client.register(addr, {**info, "attn_tp_size": 4})
        status, body = client._call("GET", f"http://{addr}/route?target_tp_rank=1")
        assert status == 200 and body["endpoint"] == "tcp://a:2"
    finally:
        server.close()
    with pytest.raises(BootstrapUnavailable):
        client.fetch(addr)
    assert client.session(addr) is None


def test_zmq_transport_exchanges_multipart_messages():
    received = []
    done = threading.Event()
    a, b = ZmqTransport("127.0.0.1"), ZmqTransport("127.0.0.1")

    def on_message(frames):
        received.append([bytes(f) for f in frames])
        done.set()

    try:
        b.start(on_message)
        a.start(lambda frames: None)
        payload = as_bytes(torch.arange(1000, dtype=torch.float32))
        a.send(b.endpoint, protocol.encode(protocol.KVFrame(room=3, token_offset=0, num_tokens=1,
                                                            crc=checksum(payload)), payload))
        assert done.wait(30)
        header, data = protocol.decode(received[0])
        assert header.room == 3 and checksum(data) == header.crc
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------------------- request fields
def test_one_room_for_several_sub_requests_becomes_consecutive_rooms():
    from engine.tokenizer.tokenizer_manager import GenerateReqInput

    obj = GenerateReqInput(input_ids=[[1, 2], [3, 4]], sampling_params={"n": 2}, bootstrap_host="h",
                           bootstrap_port=8998, bootstrap_room=100)
    obj.normalize()  # as SGLang: both servers of a pair expand it the same way
    assert obj.bootstrap_room == [100, 101, 102, 103] and obj.bootstrap_host == ["h"] * 4
    listed = GenerateReqInput(input_ids=[[1], [2]], bootstrap_room=[7, 9], bootstrap_host=["a", "b"],
                              bootstrap_port=[1, 2])
    listed.normalize()
    assert (listed.bootstrap_room, listed.bootstrap_host, listed.bootstrap_port) == ([7, 9], ["a", "b"], [1, 2])


def test_a_list_of_rooms_cannot_fan_out():
    from engine.errors import EngineRequestError
    from engine.tokenizer.tokenizer_manager import GenerateReqInput

    with pytest.raises(EngineRequestError, match="n > 1 needs a single bootstrap_room"):
        GenerateReqInput(input_ids=[[1], [2]], sampling_params={"n": 2}, bootstrap_room=[7, 9]).normalize()


@pytest.mark.parametrize("field, value, needle", [("bootstrap_port", 0, "bootstrap_port"),
                                                  ("bootstrap_room", -1, "bootstrap_room"),
                                                  ("bootstrap_room", 2**63, "bootstrap_room")])
def test_out_of_range_fields_are_refused_at_the_edge(field, value, needle):
    from pydantic import ValidationError

    from engine.entrypoints.openai.protocol import CompletionRequest, GenerateRequest

    with pytest.raises(ValidationError, match=needle):
        GenerateRequest.model_validate({"text": "a", field: value})
    with pytest.raises(ValidationError, match=needle):
        CompletionRequest.model_validate({"prompt": "a", field: value})


def test_pd_server_args():
    from engine.server_args import ServerArgs, ServerArgsError

    assert ServerArgs(device="cpu", disaggregation_mode="decode").disable_radix_cache  # as SGLang
    assert not ServerArgs(device="cpu", disaggregation_mode="prefill").disable_radix_cache
    with pytest.raises(ServerArgsError, match="--disaggregation-mode must be one of"):
        ServerArgs(device="cpu", disaggregation_mode="both")
    with pytest.raises(ServerArgsError, match="--dp-size 1 only"):
        ServerArgs(device="cpu", disaggregation_mode="decode", dp_size=2)
    with pytest.raises(ServerArgsError, match="must differ from --port"):
        ServerArgs(device="cpu", disaggregation_mode="prefill", port=8998)
    with pytest.raises(ServerArgsError, match="--disaggregation-transfer-backend must be one of"):
        ServerArgs(device="cpu", disaggregation_transfer_backend="rdma")
