"""Authentication of the PD control and data planes with a shared secret (docs/security.md).

Every ZMQ message and every bootstrap HTTP request carries an HMAC-SHA256 over its content keyed
with `--disaggregation-secret` (or the ENGINE_DISAGGREGATION_SECRET environment variable, which
keeps it off the command line); receivers compare in constant time and drop what does not match.
The MAC gives integrity and origin (a holder of the secret), not confidentiality or replay
protection: run PD planes on a private network.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from typing import Iterable, Optional

SECRET_ENV = "ENGINE_DISAGGREGATION_SECRET"
MAC_BYTES = 32
HTTP_HEADER = "X-Engine-PD-Auth"
# Domain separation: a MAC made for one plane is never valid on the other.
_ZMQ_DOMAIN = b"engine-pd-zmq-v1\0"
_HTTP_DOMAIN = b"engine-pd-http-v1\0"


def resolve_secret(flag: Optional[str]) -> Optional[str]:
    """The flag if given, else the environment variable; None (open) when neither is set."""
    value = flag if flag else os.environ.get(SECRET_ENV)
    return value or None


def frames_mac(secret: bytes, sender: bytes, frames: Iterable[object]) -> bytes:
    """HMAC over the sender's endpoint and every frame, each length-prefixed (no ambiguity)."""
    mac = hmac.new(secret, _ZMQ_DOMAIN, hashlib.sha256)
    mac.update(len(sender).to_bytes(8, "little"))
    mac.update(sender)
    for frame in frames:
        view = memoryview(frame)  # type: ignore[arg-type]  # bytes, memoryviews and zmq buffers
        mac.update(view.nbytes.to_bytes(8, "little"))
        mac.update(view)
    return mac.digest()


def http_mac(secret: bytes, method: str, path: str, body: bytes) -> str:
    mac = hmac.new(secret, _HTTP_DOMAIN, hashlib.sha256)
    for part in (method.upper().encode(), path.encode(), body):
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.hexdigest()


def check_http(secret: bytes, method: str, path: str, body: bytes, header: Optional[str]) -> bool:
    return header is not None and hmac.compare_digest(http_mac(secret, method, path, body).encode(),
                                                      header.strip().encode())


def is_loopback(host: Optional[str]) -> bool:
    """Whether binding `host` keeps a socket on this machine (a wildcard or a name does not)."""
    if host is None or host in ("", "0.0.0.0", "::"):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
