"""Which prefill bootstrap servers a decode server may contact.

A request names its prefill (`bootstrap_host`, `bootstrap_port`) and the decode server fetches
from it: without a bound, any client could make the decode server probe hosts and ports of its
network (SSRF; the answers differ for open and closed ports). `--disaggregation-prefill-allowlist`
bounds it: comma-separated entries `host[:port]`, where host is an IP address, a CIDR network, a
host name (matched as written, case-insensitively) or `*` (anything: the old, open behaviour);
without a port every port of that host is allowed. IPv6 entries with a port are bracketed
(`[fd00::1]:8998`). Default: the loopback addresses plus this server's own --host and
--disaggregation-host, which covers one-machine deployments; prefills on other machines must be
listed.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]
LOOPBACK_ENTRIES = ("127.0.0.0/8", "::1", "localhost")
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
# The whole flag and each entry are bounded like any other input (it is read once at start-up).
MAX_ENTRIES = 1024


@dataclass(frozen=True)
class AllowEntry:
    network: Optional[IPNetwork]  # set for addresses and CIDR networks
    name: Optional[str]  # set for host names (lower case) and "*"
    port: Optional[int]  # None: any port

    def matches(self, host: str, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.name == "*":
            return True
        if self.network is not None:
            address = _address(host)
            return address is not None and address.version == self.network.version and address in self.network
        return host.lower() == self.name


class PrefillAllowlist:
    def __init__(self, entries: Sequence[AllowEntry]) -> None:
        self.entries = list(entries)

    @classmethod
    def parse(cls, spec: Optional[str], own_hosts: Sequence[Optional[str]] = ()) -> "PrefillAllowlist":
        """The flag's value, or (None) the default: loopback plus this server's own addresses.

        Raises ValueError with the offending entry."""
        if spec is None:
            items: List[str] = list(LOOPBACK_ENTRIES)
            items += [_bracket(h) for h in own_hosts if h and h not in WILDCARD_HOSTS]
        else:
            items = [item.strip() for item in spec.split(",") if item.strip()]
            if not items:
                raise ValueError("--disaggregation-prefill-allowlist is empty (use '*' to allow every prefill)")
        if len(items) > MAX_ENTRIES:
            raise ValueError(f"--disaggregation-prefill-allowlist has {len(items)} entries, at most {MAX_ENTRIES}")
        return cls([parse_entry(item) for item in items])

    def allows(self, host: str, port: int) -> bool:
        host = host.strip().strip("[]")
        return any(entry.matches(host, port) for entry in self.entries)


def parse_entry(item: str) -> AllowEntry:
    host, port = _split_host_port(item)
    if host == "*":
        return AllowEntry(network=None, name="*", port=port)
    try:
        return AllowEntry(network=ipaddress.ip_network(host, strict=False), name=None, port=port)
    except ValueError:
        pass
    if not host or len(host) > 253 or any(c in host for c in "/ @?#"):
        raise ValueError(f"bad --disaggregation-prefill-allowlist entry {item!r}: expected host[:port], "
                         "an IP address, a CIDR network or '*'")
    return AllowEntry(network=None, name=host.lower(), port=port)


def _split_host_port(item: str) -> tuple[str, Optional[int]]:
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if "]" not in item or (rest and not rest.startswith(":")):
            raise ValueError(f"bad --disaggregation-prefill-allowlist entry {item!r}")
    elif item.count(":") == 1:
        host, _, port_text = item.partition(":")
    else:
        host, port_text = item, ""  # a bare IPv6 address or network has no port
    if not port_text:
        return host, None
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"bad port in --disaggregation-prefill-allowlist entry {item!r}")
    return host, int(port_text)


def _address(host: str) -> Optional[Union[ipaddress.IPv4Address, ipaddress.IPv6Address]]:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # ::ffff:10.0.0.1 is 10.0.0.1
    return address


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
