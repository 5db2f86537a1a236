"""The one rule every listener applies (launch.py, the coordinator's server, the HTTP front-end, the workers'
address): an interface other hosts can reach needs a key; loopback does not."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 in brackets or not) is reachable from this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_loopback_endpoint(address: str) -> bool:
    """A ZMQ endpoint only this host can reach: ipc/inproc, or tcp on a loopback address (not '*' or an interface)."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    return scheme == "tcp" and is_loopback(rest.rsplit(":", 1)[0])


def key_refusal(host: str, key: str | None, flag: str) -> str | None:
    """Why listening on ``host`` without a key is refused (naming ``flag``, the option that gives one), or None."""
    if key or is_loopback(host):
        return None
    return f"listening on the non-loopback host {host!r} needs {flag}"
