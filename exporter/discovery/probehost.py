"""Where a discovered server is probed: only where the server is (loopback of our own network
namespace, or an address of the process's own), never a link-local or metadata address,
whatever its command line says."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence

from exporter.trust.safeio import read_regular

MAX_NET_BYTES = 4 << 20
# Cloud metadata services: never probed, whatever a command line says.
_METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254")
)


def local_addresses(base: str) -> list[str]:
    """The addresses local to a process's network namespace, loopback excluded: IPv4 from
    fib_trie, IPv6 from if_inet6."""
    addresses: dict[str, None] = {}  # ordered, each once (Main and Local tables repeat them)
    try:
        lines = read_regular(f"{base}/net/fib_trie", MAX_NET_BYTES).decode("ascii", "replace")
    except OSError:
        lines = ""
    current = ""
    for line in lines.splitlines():
        text = line.strip()
        if text.startswith("|-- "):
            current = text[4:]
        elif text.startswith("/32 host LOCAL") and current and not current.startswith("127."):
            addresses[current] = None
    try:
        inet6 = read_regular(f"{base}/net/if_inet6", MAX_NET_BYTES).decode("ascii", "replace")
    except OSError:
        inet6 = ""
    for line in inet6.splitlines():
        digits = line.split()[0] if line.split() else ""
        if len(digits) == 32:
            ip = ipaddress.ip_address(int(digits, 16).to_bytes(16, "big"))
            if not ip.is_loopback:
                addresses[str(ip)] = None
    return list(addresses)


def probe_host(
    host: str, same_netns: bool, addresses: Sequence[str] | Callable[[], Sequence[str]]
) -> tuple[str, bool, str]:
    """(address to probe, reachable from here, why that address) for a server's listen host.

    Only where the server is: loopback of our own namespace, or an address of the process's
    network namespace (`addresses`, asked only when needed); never link-local or a metadata
    service. An IPv4-mapped address is its IPv4 address, so `::ffff:127.0.0.1` is loopback.
    """
    local = addresses if not callable(addresses) else None

    def namespace_addresses() -> Sequence[str]:
        nonlocal local
        if local is None:
            local = addresses() if callable(addresses) else addresses
        return local

    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(
            "127.0.0.1" if host == "localhost" else host.strip("[]")
        )
    except ValueError:
        ip = None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    loopback = "::1" if ip is not None and ip.version == 6 else "127.0.0.1"
    if ip is not None and (ip.is_link_local or ip in _METADATA):
        return str(ip), False, "a link-local or metadata address: never probed"
    if ip is not None and ip.is_loopback:
        if same_netns:
            return str(ip), True, ""
        return str(ip), False, "listens on loopback in its own network namespace: not reachable"
    if ip is not None and not ip.is_unspecified:
        if str(ip) in namespace_addresses():
            return str(ip), True, ""
        return str(ip), False, "not an address of the server's network namespace: not probed"
    if same_netns:
        why = "listens on every interface" if ip is not None else f"{host!r} is a host name"
        return loopback, True, f"{why}: probed on loopback"
    usable = [a for a in namespace_addresses() if not ipaddress.ip_address(a).is_link_local]
    if usable:
        return usable[0], True, "in its own network namespace: probed on that namespace's address"
    return loopback, False, "in its own network namespace with no address reachable from here"


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
