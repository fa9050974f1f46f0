"""Messages between a prefill rank and a decode rank (the same for the loopback and tcp backends).

Each message is a list of frames: a msgspec header (one tagged union), then the payload if any.

decode -> prefill rank:
  DstInfo   per request and decode rank: "I reserved room for these tokens, send them here".
  AbortMsg  the decode side gave up on a room: stop sending (frames still in flight are dropped
            by the receiver, which fences its writes).
prefill rank -> decode:
  KVFrame   tokens [token_offset, token_offset + num_tokens) of a room, with their CRC32.
  AuxFrame  the request's metadata row (first token, logprobs, room stamp); after the last KV frame.
  StatusMsg Success after the aux row, or Failed with a reason (at any time).
One PUSH -> PULL pipe per pair keeps this order; the decode side still counts the bytes and checks
the room stamp before it accepts Success.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Union

import msgspec


class DstInfo(msgspec.Struct, tag=True):
    room: int
    endpoint: str  # where the decode rank listens (tcp://ip:port or loopback://name)
    num_tokens: int  # tokens the decode side expects, from decode_prefix_len on
    decode_prefix_len: int
    aux_index: int  # the decode side's metadata row
    decode_tp_rank: int
    required_dst_num: int  # how many decode ranks of this request a prefill rank serves
    head_start: int  # within the prefill rank's KV heads
    num_heads: int


class AbortMsg(msgspec.Struct, tag=True):
    room: int
    endpoint: str
    reason: str = "aborted by the decode server"


class KVFrame(msgspec.Struct, tag=True):
    room: int
    token_offset: int
    num_tokens: int
    crc: int


class AuxFrame(msgspec.Struct, tag=True):
    room: int
    aux_index: int
    crc: int


class StatusMsg(msgspec.Struct, tag=True):
    room: int
    success: bool
    prefill_rank: int
    reason: str = ""
    cause: str = ""


Header = Union[DstInfo, AbortMsg, KVFrame, AuxFrame, StatusMsg]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Header)


def encode(header: Header, payload: Any = None) -> List[Any]:
    frames: List[Any] = [_encoder.encode(header)]
    if payload is not None:
        frames.append(payload)
    return frames


def decode(frames: Sequence[Any]) -> tuple[Header, Any]:
    """(header, payload or None); raises msgspec.DecodeError on a malformed message."""
    header = _decoder.decode(bytes(frames[0]))
    payload = frames[1] if len(frames) > 1 else None
    return header, payload


def kind(frames: Sequence[Any]) -> str:
    """The message type name (for loopback fault rules); "?" when undecodable."""
    try:
        return type(_decoder.decode(bytes(frames[0]))).__name__
    except msgspec.DecodeError:
        return "?"
