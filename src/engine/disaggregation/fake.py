"""The fake transfer (SGLang's `fake` backend): no prefill server, no bytes moved.

Used when a request's bootstrap_host is FAKE_BOOTSTRAP_HOST (health probes, warm-up) or when the
server runs with --disaggregation-transfer-backend fake (decode-only benchmarks). A fake receiver
is WaitingForInput at once and Success right after its destination was "published"; the first
token is synthetic (a hash of the rid) and the reserved KV slots keep whatever they held, so the
output is garbage with realistic timing. A fake sender is ready at once and done after send().
"""

from __future__ import annotations

import zlib
from typing import Optional, Tuple

import torch

from engine.disaggregation.base import FailureCause, KVPoll
from engine.disaggregation.conn_common import KVReceiver, KVSender, TransferTimes, now


def fake_first_token(rid: str, vocab_size: int) -> int:
    """A deterministic first token for a fake transfer (stable across processes, unlike hash())."""
    return zlib.crc32(rid.encode()) % vocab_size


class _FakeHandle:
    is_fake = True

    def __init__(self, room: int) -> None:
        self.room = room
        self.status = KVPoll.WaitingForInput
        self.reason: Optional[Tuple[str, FailureCause]] = None
        self.times = TransferTimes(created=now(), bootstrapped=now())

    def poll(self) -> KVPoll:
        return self.status

    def abort(self, reason: str, cause: FailureCause = FailureCause.ABORTED) -> None:
        if self.status != KVPoll.Success:
            self.status = KVPoll.Failed
            self.reason = (reason, cause)

    def failure(self) -> Optional[Tuple[str, FailureCause]]:
        return self.reason

    def clear(self) -> None:
        pass


class FakeKVSender(_FakeHandle, KVSender):
    def send(self, slots: torch.Tensor, aux: bytes) -> None:
        if self.status != KVPoll.Failed:
            self.status = KVPoll.Success


class FakeKVReceiver(_FakeHandle, KVReceiver):
    def send_metadata(self, slots: torch.Tensor, aux_index: int) -> None:
        if self.status != KVPoll.Failed:
            self.times.dst_sent = now()
            self.status = KVPoll.Success
