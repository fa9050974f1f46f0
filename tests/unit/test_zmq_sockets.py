"""Every ZMQ socket of the runtime goes through get_zmq_socket: unlimited high-water marks (a slow
peer must never block the scheduling loop on a send) and zero linger (closing never waits)."""

from __future__ import annotations

import shutil

import pytest
import zmq

from engine.scheduler.process import _rank0_channels
from engine.port_args import PortArgs
from engine.server_args import ServerArgs
from engine.utils.zmq_utils import get_zmq_socket


class RecordingContext(zmq.Context):
    """A context that remembers every socket it creates."""

    # pyzmq treats unknown instance attributes as socket options: declare it on the class.
    created: list = []

    def __init__(self) -> None:
        super().__init__()
        self.created = []

    def socket(self, socket_type: int, **kwargs):  # type: ignore[override]
        sock = super().socket(socket_type, **kwargs)
        self.created.append(sock)
        return sock


def _assert_engine_options(sock: zmq.Socket) -> None:
    assert sock.getsockopt(zmq.LINGER) == 0
    if sock.type == zmq.PUSH:
        assert sock.getsockopt(zmq.SNDHWM) == 0
    elif sock.type == zmq.PULL:
        assert sock.getsockopt(zmq.RCVHWM) == 0
    else:
        pytest.fail(f"unexpected socket type {sock.type}")


@pytest.fixture
def port_args():
    args = PortArgs.init_new(ServerArgs(device="cpu"))
    yield args
    shutil.rmtree(args.ipc_dir, ignore_errors=True)


def test_rank0_scheduler_sockets_have_the_engine_options(port_args):
    context = RecordingContext()
    try:
        _rank0_channels(context, port_args, tp_size=1, dp_rank=None)
        kinds = sorted(s.type for s in context.created)
        assert kinds == sorted([zmq.PULL, zmq.PUSH, zmq.PUSH])  # tokenizer in; detokenizer, tokenizer out
        for sock in context.created:
            _assert_engine_options(sock)
    finally:
        context.destroy(linger=0)


def test_a_push_socket_never_refuses_because_its_peer_is_slow(port_args):
    """ZMQ's default high-water mark (1000 per side) makes a PUSH refuse (or block) once its peer
    stops reading; the engine's sockets queue instead, so the scheduler never waits on a peer."""
    context = zmq.Context()
    try:
        pull = get_zmq_socket(context, zmq.PULL, port_args.detokenizer_ipc_name, bind=True)
        push = get_zmq_socket(context, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False)
        assert push.poll(5000, zmq.POLLOUT)  # connected
        for i in range(5000):  # the peer reads none of them
            push.send(b"x", flags=zmq.NOBLOCK)
        assert pull.recv() == b"x"
    finally:
        context.destroy(linger=0)
