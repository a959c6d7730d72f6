"""HOST:PORT strings as configuration and the agent's address file write them.
Standard library only: the VPS side reads them too."""

from __future__ import annotations


def split_hostport(value: str) -> tuple[str, int]:
    """'127.0.0.1:8224' -> ('127.0.0.1', 8224); brackets around IPv6 hosts are dropped."""
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)
