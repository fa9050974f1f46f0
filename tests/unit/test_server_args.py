"""ServerArgs validation: out-of-range flags fail at construction with a message naming the flag."""

from __future__ import annotations

import pytest

from engine.server_args import ServerArgs, ServerArgsError


@pytest.mark.parametrize("interval", [0, -1])
def test_decode_log_interval_below_one_is_refused(interval):
    # The scheduler logs every `decode_log_interval`-th decode batch (a modulo): 0 would divide
    # by zero at the first decode, deep inside a running server.
    with pytest.raises(ServerArgsError, match=r"--decode-log-interval must be >= 1, got " + str(interval)):
        ServerArgs(device="cpu", decode_log_interval=interval)


def test_decode_log_interval_of_one_is_accepted():
    assert ServerArgs(device="cpu", decode_log_interval=1).decode_log_interval == 1
