"""Telling the prefill about requests the decode server refused before taking them.

A PD request goes to both servers at once. When the decode side refuses it (a prompt its KV pool
can never hold, a bad constraint, a full queue...), the client gets its 4xx at once, but the
prefill half would sit in its bootstrap queue until --disaggregation-bootstrap-timeout (300 s by
default), since no destination will ever come. SGLang's decode leaves it so; we look the prefill
up like any transfer and send it an abort for the room, so it drops its half as soon as it is
found. The notice holds no decode memory: only a receiver (a room entry) until it is sent or the
lookup gives up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List

from engine.disaggregation.base import FailureCause, KVPoll, poll_and_all_reduce
from engine.disaggregation.conn_common import KVReceiver

logger = logging.getLogger(__name__)

# Each notice holds a room entry for at most the prefill lookup (15 attempts a second apart). A
# flood of refused requests beyond this many waiting notices is not told: those prefill halves
# end at their bootstrap timeout, as in SGLang.
MAX_PENDING_NOTICES = 1024


@dataclass
class _Notice:
    receiver: KVReceiver
    reason: str


class RefusalNotices:
    def __init__(self) -> None:
        self.pending: List[_Notice] = []

    def can_take(self) -> bool:
        return len(self.pending) < MAX_PENDING_NOTICES

    def add(self, receiver: KVReceiver, reason: str) -> None:
        assert self.can_take(), "the caller checks can_take() before it creates a receiver"
        self.pending.append(_Notice(receiver, reason))

    def send_ready(self) -> None:
        """Abort the rooms whose prefill is known now; drop those whose lookup failed.

        The polls are reduced over the TP ranks like every queue's, so the ranks keep the same
        list (each rank tells its own prefill peer).
        """
        if not self.pending:
            return
        polls = poll_and_all_reduce(n.receiver for n in self.pending)
        kept: List[_Notice] = []
        for notice, poll in zip(self.pending, polls):
            if poll == KVPoll.Bootstrapping:
                kept.append(notice)
                continue
            if poll != KVPoll.Failed:  # found: the abort goes to the prefill (no destination was sent)
                logger.debug("Telling the prefill that room %d was refused here", notice.receiver.room)
                notice.receiver.abort(f"refused by the decode server: {notice.reason}", FailureCause.BAD_REQUEST)
            notice.receiver.clear()
        self.pending = kept

    def __len__(self) -> int:
        return len(self.pending)

