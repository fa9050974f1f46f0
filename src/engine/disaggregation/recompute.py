"""Re-bootstrap after pause_generation(mode="retract"): a decode server asks the prefill to
recompute a request's KV with the prefill's current weights (SGLang's PD true-retraction path).

SGLang's decode server POSTs the tokens to the prefill's HTTP `/generate`. Ours sends the same
content to the prefill's bootstrap server (`POST /recompute`), which carries the PD secret's MAC
like every other bootstrap request, so the decode server needs neither the prefill's API key nor
its HTTP port; the bootstrap server (in the prefill's main process) posts it to its own server's
`/generate` on loopback, with the server's API key, as an ordinary PD prefill request of
`max_new_tokens` 1 under the same bootstrap room. The prefill needs no other code for it: it
computes the KV of every token, sends it into the slots the decode server published for the room,
and its handoff token is dropped (the decode server keeps the token it had already emitted).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import msgspec

from engine.disaggregation.base import MAX_BOOTSTRAP_ROOM

# Bounds of a recompute request, checked by the bootstrap server before anything is queued: the
# tokens (prompt + output so far) of one request, whose context is far below this; the request id
# and cache namespace strings as the HTTP edge bounds them.
MAX_RECOMPUTE_TOKENS = 1 << 20
MAX_RECOMPUTE_BODY_BYTES = 16 << 20  # the tokens as JSON integers (at most ~11 bytes each) fit
MAX_ID_CHARS = 1024
RID_SUFFIX = "-pd-recompute"


class RecomputeReq(msgspec.Struct, forbid_unknown_fields=True):
    """What the prefill needs to recompute one request's KV (decode -> prefill's bootstrap server)."""

    rid: str
    room: int
    input_ids: List[int]  # the prompt and every output token whose KV the decode side expects
    priority: Optional[int] = None
    extra_key: Optional[str] = None  # the request's cache namespace, so its KV stays in it
    cache_salt: Optional[str] = None


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(RecomputeReq)


def encode(req: RecomputeReq) -> bytes:
    return _encoder.encode(req)


def decode(body: bytes) -> RecomputeReq:
    """The request in `body`; ValueError when it is malformed or out of bounds."""
    if len(body) > MAX_RECOMPUTE_BODY_BYTES:
        raise ValueError(f"a recompute request is at most {MAX_RECOMPUTE_BODY_BYTES} bytes")
    try:
        req = _decoder.decode(body)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a recompute request: {e}") from None
    if not 0 < req.room < MAX_BOOTSTRAP_ROOM:
        raise ValueError(f"room must be in [1, 2^63), got {req.room}")
    if not 1 <= len(req.input_ids) <= MAX_RECOMPUTE_TOKENS:
        raise ValueError(f"input_ids must hold 1 to {MAX_RECOMPUTE_TOKENS} tokens, got {len(req.input_ids)}")
    for name, value in (("rid", req.rid), ("extra_key", req.extra_key), ("cache_salt", req.cache_salt)):
        if value is not None and len(value) > MAX_ID_CHARS:
            raise ValueError(f"{name} is at most {MAX_ID_CHARS} characters")
    return req


def generate_body(req: RecomputeReq, bootstrap_host: str, bootstrap_port: int) -> Dict[str, Any]:
    """The prefill's /generate body that recomputes `req`'s KV under its room (token ids,
    vocabulary range and context are checked there, as for any request)."""
    return {
        "rid": req.rid + RID_SUFFIX, "input_ids": list(req.input_ids),
        # Greedy and one token: the handoff token is dropped by the decode side.
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "priority": req.priority, "extra_key": req.extra_key, "cache_salt": req.cache_salt,
        "bootstrap_host": bootstrap_host, "bootstrap_port": bootstrap_port, "bootstrap_room": req.room,
    }
