"""PD network-facing attacks in miniature (docs/security.md): a client that makes the decode
server probe arbitrary addresses (SSRF, port scan), and peers that speak the PD control plane
without the shared secret or with oversized messages."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Iterator, List

import pytest
import torch

from engine.disaggregation.allowlist import PrefillAllowlist
from engine.disaggregation.base import FailureCause, KVPoll
from engine.disaggregation.bootstrap import BootstrapUnavailable, HttpBootstrapClient
from engine.disaggregation.conn_common import KVArgs, TransferConfig
from engine.disaggregation.conn_decode import DecodeKVManager, DecodeKVReceiver
from engine.disaggregation.kv_io import KVLayout
from engine.disaggregation.loopback import LoopbackNetwork
from engine.disaggregation.metadata import MetadataBuffers
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
