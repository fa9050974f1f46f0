"""PD network-facing attacks in miniature (docs/security.md): a client that makes the decode
server probe arbitrary addresses (SSRF, port scan), and peers that speak the PD control plane
without the shared secret or with oversized messages."""

from __future__ import annotations

import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Iterator, List

import pytest
import torch

from engine.disaggregation import auth
from engine.disaggregation import bootstrap
from engine.disaggregation import conn_prefill
from engine.disaggregation import protocol
from engine.disaggregation import wiring as setup
from engine.disaggregation.allowlist import PrefillAllowlist
from engine.disaggregation.base import FailureCause, KVPoll
from engine.disaggregation.bootstrap import BootstrapServer, BootstrapUnavailable, HttpBootstrapClient
from engine.disaggregation.conn_common import KVArgs, TransferConfig
from engine.disaggregation.conn_decode import DecodeKVManager, DecodeKVReceiver
from engine.disaggregation.kv_io import KVLayout, checksum, frame_token_count
from engine.disaggregation.loopback import LoopbackNetwork
from engine.disaggregation.metadata import MetadataBuffers
from engine.disaggregation.protocol import AbortMsg, DstInfo
from engine.disaggregation import transport as transport_module
from engine.disaggregation.transport import ZmqTransport
from engine.mem_cache.memory_pool import MHATokenToKVPool
from engine.utils.network_utils import get_free_port
from pd_utils import BOOTSTRAP_PORT, PDPair

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


# ---------------------------------------------------------------------------- item 10: allow-list
def test_allowlist_default_is_loopback_plus_own_addresses():
    default = PrefillAllowlist.parse(None, ("10.0.0.7", "0.0.0.0"))
    assert default.allows("127.0.0.1", 8998) and default.allows("127.5.0.1", 1) and default.allows("::1", 2)
    assert default.allows("[::1]", 2) and default.allows("localhost", 8998) and default.allows("LOCALHOST", 1)
    assert default.allows("10.0.0.7", 8998)
    # Not the rest of the network, not the cloud metadata address, not spellings that resolve to loopback.
    for host in ("10.0.0.8", "169.254.169.254", "example.com", "127.1", "2130706433", "0.0.0.0"):
        assert not default.allows(host, 8998), host


def test_allowlist_entries_networks_ports_and_wildcard():
    allow = PrefillAllowlist.parse("10.1.0.0/16, prefill-a:8998, [fd00::1]:9000, 192.168.0.5")
    assert allow.allows("10.1.200.3", 1) and not allow.allows("10.2.0.1", 1)
    assert allow.allows("Prefill-A", 8998) and not allow.allows("prefill-a", 8999)
    assert allow.allows("fd00::1", 9000) and not allow.allows("fd00::1", 9001)
    assert allow.allows("192.168.0.5", 22) and allow.allows("::ffff:192.168.0.5", 22)
    assert not allow.allows("127.0.0.1", 8998)  # an explicit list replaces the default
    assert PrefillAllowlist.parse("*").allows("203.0.113.9", 8080)
    for bad in ("", " , ", "a:b", "h:0", "h:70000", "http://x", "[::1"):
        with pytest.raises(ValueError):
            PrefillAllowlist.parse(bad)


def test_decode_refuses_a_prefill_outside_the_allowlist_without_contacting_it(make_pair):
    p: PDPair = make_pair()
    fetched: List[str] = []
    client = p.net.bootstrap_client()
    original = type(client).fetch

    def spy(self, addr):
        fetched.append(addr)
        return original(self, addr)

    type(client).fetch = spy
    try:
        rid = p.submit(PROMPT, max_new_tokens=4, to_prefill=False, bootstrap_host="169.254.169.254",
                       bootstrap_port=80)
        for _ in range(5):
            p.step()
        reason = p.decode.outputs[rid].finished_reason
        assert reason["status_code"] == 400 and "not an allowed prefill" in reason["message"]
        assert fetched == []  # refused before any network access
        # The allowed pair still works.
        ok = p.submit(PROMPT, max_new_tokens=4)
        p.run_until_idle()
        assert p.decode.outputs[ok].finished_reason["type"] == "length"
    finally:
        type(client).fetch = original


def _kv_args() -> KVArgs:
    pool = MHATokenToKVPool(32, 1, torch.float32, head_num=2, head_dim=4, layer_num=2)
    layout = KVLayout.of_pool(pool, total_kv_heads=2, tp_size=1, tp_rank=0)
    return KVArgs(pool=pool, metadata=MetadataBuffers(4), layout=layout, page_size=1)


class _NotBootstrap(BaseHTTPRequestHandler):
    """Some other web service on the probed host."""

    def do_GET(self) -> None:  # noqa: N802
        data = b"<html>hello</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt: str, *args: object) -> None:
        pass


@pytest.fixture
def probe_targets() -> Iterator[dict]:
    """A closed port, an open non-bootstrap web server, and a port that accepts but never answers."""
    closed = get_free_port()
    web = HTTPServer(("127.0.0.1", 0), _NotBootstrap)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        yield {"closed": closed, "web": web.server_address[1], "silent": silent.getsockname()[1]}
    finally:
        web.shutdown()
        web.server_close()
        silent.close()


def test_unreachable_closed_and_foreign_targets_give_one_error(probe_targets):
    net = LoopbackNetwork()
    config = TransferConfig(ensure_info_retries=2, ensure_info_interval=0.0)
    manager = DecodeKVManager(_kv_args(), net.transport("decode"), net.runner(), net.runner(),
                              HttpBootstrapClient(timeout=0.3), config, PrefillAllowlist.parse("127.0.0.1"))
    messages = {}
    try:
        for name, port in probe_targets.items():
            receiver = DecodeKVReceiver(manager, room=port, addr=f"127.0.0.1:{port}")
            for _ in range(10):
                if receiver.poll() == KVPoll.Failed:
                    break
                net.pump()
            assert receiver.poll() == KVPoll.Failed, name
            reason, cause = receiver.failure()
            assert cause == FailureCause.BOOTSTRAP
            messages[name] = reason.replace(str(port), "PORT")
            receiver.clear()
    finally:
        manager.close()
    assert len(set(messages.values())) == 1, messages
    assert "is not reachable" in messages["closed"]


def test_a_refused_address_raises_before_any_lookup():
    net = LoopbackNetwork()
    manager = DecodeKVManager(_kv_args(), net.transport("decode"), net.runner(), net.runner(),
                              net.bootstrap_client(), TransferConfig(), PrefillAllowlist.parse(None))
    try:
        assert manager.refusal("10.0.0.1", BOOTSTRAP_PORT) is not None
        assert manager.refusal("127.0.0.1", BOOTSTRAP_PORT) is None
        with pytest.raises(BootstrapUnavailable, match="not an allowed prefill"):
            manager.peer(f"10.0.0.1:{BOOTSTRAP_PORT}", since=0.0)
        assert not net.jobs  # no lookup was queued
    finally:
        manager.close()


# ---------------------------------------------------------------------------- item 9: ZMQ plane
def _wait_for(cond, seconds: float = 20.0) -> bool:
    """A bounded poll (no sleeps as synchronisation: each round waits on the condition's event)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


class _Inbox:
    def __init__(self) -> None:
        self.messages: List[List[bytes]] = []
        self.event = threading.Event()

    def __call__(self, frames) -> None:
        self.messages.append([bytes(f) for f in frames])
        self.event.set()


def _kv_message(room: int, nbytes: int = 64) -> list:
    payload = bytes(nbytes)
    return protocol.encode(protocol.KVFrame(room=room, token_offset=0, num_tokens=1, crc=checksum(payload)), payload)


def test_zmq_messages_without_the_secret_are_dropped():
    inbox = _Inbox()
    receiver = ZmqTransport("127.0.0.1", secret="s3cret")
    forger, wrong, peer = ZmqTransport("127.0.0.1"), ZmqTransport("127.0.0.1", secret="other"), \
        ZmqTransport("127.0.0.1", secret="s3cret")
    try:
        receiver.start(inbox)
        forger.send(receiver.endpoint, _kv_message(1))
        wrong.send(receiver.endpoint, _kv_message(2))
        assert _wait_for(lambda: receiver.rejected == 2)
        peer.send(receiver.endpoint, _kv_message(3))
        assert inbox.event.wait(20)
        assert [protocol.decode(m)[0].room for m in inbox.messages] == [3]  # only the secret holder's
    finally:
        for t in (receiver, forger, wrong, peer):
            t.close()


def test_zmq_decode_side_accepts_only_prefills_learnt_from_bootstrap():
    inbox = _Inbox()
    receiver = ZmqTransport("127.0.0.1", secret="k", known_senders_only=True)
    stranger, prefill = ZmqTransport("127.0.0.1", secret="k"), ZmqTransport("127.0.0.1", secret="k")
    try:
        receiver.start(inbox)
        stranger.send(receiver.endpoint, _kv_message(1))
        prefill.send(receiver.endpoint, _kv_message(2))
        assert _wait_for(lambda: receiver.rejected == 2) and not inbox.messages
        receiver.allow_peer(prefill.endpoint)
        prefill.send(receiver.endpoint, _kv_message(3))
        assert inbox.event.wait(20)
        assert [protocol.decode(m)[0].room for m in inbox.messages] == [3]
        receiver.forget(prefill.endpoint)  # a dead prefill is no longer trusted
        prefill.send(receiver.endpoint, _kv_message(4))
        assert _wait_for(lambda: receiver.rejected == 3)
    finally:
        for t in (receiver, stranger, prefill):
            t.close()


def test_zmq_frames_above_the_largest_kv_frame_are_refused():
    inbox = _Inbox()
    receiver = ZmqTransport("127.0.0.1", max_frame_bytes=1 << 20)
    big, small = ZmqTransport("127.0.0.1"), ZmqTransport("127.0.0.1")
    try:
        receiver.start(inbox)
        big.send(receiver.endpoint, _kv_message(1, nbytes=8 << 20))  # ZMQ disconnects the sender
        small.send(receiver.endpoint, _kv_message(2, nbytes=(1 << 20) - 1024))
        assert inbox.event.wait(20)
        assert not _wait_for(lambda: len(inbox.messages) > 1, seconds=1.0)
        assert [protocol.decode(m)[0].room for m in inbox.messages] == [2]
    finally:
        for t in (receiver, big, small):
            t.close()


def test_decode_frame_limit_follows_the_largest_legitimate_kv_frame():
    kv_args = _kv_args()
    decode_limit = setup.max_frame_bytes(kv_args, "decode")
    tokens = frame_token_count(kv_args.layout.bytes_per_token())
    assert tokens * kv_args.layout.bytes_per_token() <= decode_limit < 8 << 20
    assert setup.max_frame_bytes(kv_args, "prefill") == setup.CONTROL_FRAME_BYTES


# ---------------------------------------------------------------------------- item 9: prefill control plane
def _dst(room: int, endpoint: str, rank: int = 0, required: int = 1) -> DstInfo:
    return DstInfo(room=room, endpoint=endpoint, num_tokens=8, decode_prefix_len=0, aux_index=0, decode_tp_rank=rank,
                   required_dst_num=required, head_start=0, num_heads=2)


def test_spoofed_destination_and_abort_cannot_take_over_another_room(make_pair):
    p: PDPair = make_pair()
    manager = p.prefill.scheduler.disagg.manager
    manager.add_sender(77)
    manager._on_message(protocol.encode(_dst(77, "loopback://decode-real")))
    assert manager.status.get(77) == KVPoll.WaitingForInput
    # A second sender cannot redirect the KV, nor add destinations beyond the request's ranks.
    manager._on_message(protocol.encode(_dst(77, "tcp://attacker:1")))
    manager._on_message(protocol.encode(_dst(77, "tcp://attacker:1", rank=5, required=1)))
    assert [d.endpoint for d in manager.destinations(77)] == ["loopback://decode-real"]
    # Nor fail the room with an abort that names another endpoint.
    manager._on_message(protocol.encode(AbortMsg(room=77, endpoint="tcp://attacker:1")))
    assert manager.status.get(77) == KVPoll.WaitingForInput
    manager._on_message(protocol.encode(AbortMsg(room=77, endpoint="loopback://decode-real")))
    assert manager.status.get(77) == KVPoll.Failed
    manager.clear(77)


def test_orphan_destinations_are_bounded(make_pair, monkeypatch):
    monkeypatch.setattr(conn_prefill, "MAX_ORPHAN_ROOMS", 50)
    p: PDPair = make_pair()
    manager = p.prefill.scheduler.disagg.manager
    for room in range(1, 1001):
        manager._on_message(protocol.encode(_dst(room, "tcp://flood:1")))
    assert manager.idle_state()["destinations"] == 50
    assert manager.destinations(1000) and not manager.destinations(1)  # the oldest went first
    for room in range(951, 1001):
        manager.clear(room)
    assert manager.idle_state()["destinations"] == 0


# ---------------------------------------------------------------------------- item 9: bootstrap server
_INFO = {"attn_tp_size": 1, "attn_tp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 1, "endpoint": "tcp://real:1",
         "page_size": 1, "kv_cache_dtype": "float32", "metadata_schema_version": 1, "kv_layout": {}}


def _raw_http(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        return s.recv(65536)


def test_bootstrap_server_needs_the_secret():
    server = BootstrapServer("127.0.0.1", 0, tp_size=1, secret="k")
    addr = f"127.0.0.1:{server.port}"
    try:
        HttpBootstrapClient(secret="k").register(addr, _INFO)
        attacker = HttpBootstrapClient(secret="guess")
        with pytest.raises(RuntimeError, match="401"):
            attacker.register(addr, {**_INFO, "endpoint": "tcp://attacker:1"})
        assert HttpBootstrapClient().session(addr) is None  # no MAC, no answer
        with pytest.raises(BootstrapUnavailable):
            attacker.fetch(addr)
        full = HttpBootstrapClient(secret="k").fetch(addr)
        assert full["ranks"]["0"]["endpoint"] == "tcp://real:1"
        assert HttpBootstrapClient(secret="k").session(addr) == server.session_id
    finally:
        server.close()


@pytest.mark.slow  # idle connections held to the bootstrap server's deadline
def test_bootstrap_server_bounds_bodies_and_idle_connections(monkeypatch):
    monkeypatch.setattr(bootstrap, "CONNECTION_TIMEOUT_S", 0.5)  # the silent clients drop out sooner
    server = BootstrapServer("127.0.0.1", 0, tp_size=1)
    addr = f"127.0.0.1:{server.port}"
    idle: List[socket.socket] = []
    threads_before = threading.active_count()
    try:
        answer = _raw_http(server.port, b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 400000000\r\n\r\n{")
        assert answer.startswith(b"HTTP/1.0 413") or answer.startswith(b"HTTP/1.1 413")
        assert _raw_http(server.port, b"PUT /route HTTP/1.1\r\nHost: x\r\n\r\n").split(b" ")[1] == b"411"
        for _ in range(40):  # clients that connect and say nothing
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        assert threading.active_count() - threads_before <= bootstrap.HTTP_WORKERS
        # The silent ones time out (CONNECTION_TIMEOUT_S each, HTTP_WORKERS at a time); a real
        # client is still served within a bounded time.
        client = HttpBootstrapClient(timeout=60)
        assert client.session(addr) == server.session_id
    finally:
        for s in idle:
            s.close()
        server.close()


# ---------------------------------------------------------------------------- item 9: defaults
def test_pd_server_beyond_loopback_without_a_secret_warns(monkeypatch, caplog):
    from engine.server_args import ServerArgs

    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="engine.disaggregation.server_args_check"):
        ServerArgs(device="cpu", disaggregation_mode="prefill", host="127.0.0.1")
        assert "SECURITY" not in caplog.text
        ServerArgs(device="cpu", disaggregation_mode="prefill", host="0.0.0.0")
        assert "without --disaggregation-secret" in caplog.text
        caplog.clear()
        monkeypatch.setenv(auth.SECRET_ENV, "from-env")
        ServerArgs(device="cpu", disaggregation_mode="decode", host="0.0.0.0")
        assert "SECURITY" not in caplog.text
    assert auth.resolve_secret(None) == "from-env" and auth.resolve_secret("flag") == "flag"


def test_zmq_push_sockets_are_bounded(monkeypatch):
    monkeypatch.setattr(transport_module, "MAX_PUSH_SOCKETS", 4)
    sender = ZmqTransport("127.0.0.1")
    try:
        for port in range(1, 21):  # destinations that name ever new endpoints
            sender.send(f"tcp://127.0.0.1:{get_free_port()}", _kv_message(port))
        assert len(sender._push) == 4
    finally:
        sender.close()


def test_recompute_route_needs_the_secret_and_bounds_its_body():
    """POST /recompute (a decode server's re-bootstrap): only with the MAC, only well-formed and
    bounded requests reach the prefill, as the /generate body of the room's recompute."""
    from engine.disaggregation import recompute

    posted: List[dict] = []
    accept = [True]

    def submit(body: dict) -> bool:
        posted.append(body)
        return accept[0]

    server = BootstrapServer("127.0.0.1", 0, tp_size=1, secret="k", submit=submit)
    addr = f"127.0.0.1:{server.port}"
    good = recompute.RecomputeReq(rid="r1", room=77, input_ids=[5, 6, 7], priority=3, cache_salt="s")
    try:
        with pytest.raises(BootstrapUnavailable, match="401"):
            HttpBootstrapClient(secret="guess").recompute(addr, good)
        with pytest.raises(BootstrapUnavailable, match="400"):
            HttpBootstrapClient(secret="k").recompute(addr, recompute.RecomputeReq(rid="r", room=0, input_ids=[1]))
        with pytest.raises(BootstrapUnavailable, match="400"):
            HttpBootstrapClient(secret="k").recompute(addr, recompute.RecomputeReq(rid="r", room=1, input_ids=[]))
        with pytest.raises(BootstrapUnavailable, match="400"):
            HttpBootstrapClient(secret="k").recompute(addr, recompute.RecomputeReq(rid="x" * 2000, room=1,
                                                                                   input_ids=[1]))
        assert posted == []
        HttpBootstrapClient(secret="k").recompute(addr, good)
        assert posted == [{"rid": "r1" + recompute.RID_SUFFIX, "input_ids": [5, 6, 7],
                           "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "priority": 3,
                           "extra_key": None, "cache_salt": "s", "bootstrap_host": "127.0.0.1",
                           "bootstrap_port": server.port, "bootstrap_room": 77}]
        accept[0] = False  # the forwarder's pending bound
        with pytest.raises(BootstrapUnavailable, match="503"):
            HttpBootstrapClient(secret="k").recompute(addr, good)
        big = b"POST /recompute HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{" % (
            recompute.MAX_RECOMPUTE_BODY_BYTES + 1)
        assert _raw_http(server.port, big).split(b" ")[1] == b"413"
    finally:
        server.close()
    unwired = BootstrapServer("127.0.0.1", 0, tp_size=1)
    try:  # a bootstrap server without a forwarder (in-process tests) takes none
        with pytest.raises(BootstrapUnavailable, match="503"):
            HttpBootstrapClient().recompute(f"127.0.0.1:{unwired.port}", good)
    finally:
        unwired.close()


def test_recompute_request_decoding_refuses_what_it_does_not_know():
    from engine.disaggregation import recompute

    with pytest.raises(ValueError, match="not a recompute request"):
        recompute.decode(b'{"rid": "r", "room": 1, "input_ids": [1], "sampling_params": {}}')  # unknown field
    with pytest.raises(ValueError, match="not a recompute request"):
        recompute.decode(b'{"rid": "r", "room": 1, "input_ids": ["1"]}')
    with pytest.raises(ValueError, match="at most"):
        recompute.decode(b" " * (recompute.MAX_RECOMPUTE_BODY_BYTES + 1))
    req = recompute.decode(recompute.encode(recompute.RecomputeReq(rid="r", room=(1 << 63) - 1, input_ids=[0])))
    assert req.room == (1 << 63) - 1
