"""TCP port numbers for servers a test or the demo starts later (`free_port()`).

A port is chosen now and bound later (by sshd, nats-server, a `monitord run`), so the number
must not be handed to anyone else in between. Asking the kernel for port 0 and closing the
socket does not ensure that: the kernel hands the same ephemeral ports to the next port-0
bind and to the local end of every outgoing connection, and parallel test processes
(pytest-xdist) each get them. So the ports come from below the kernel's ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`), which the kernel never picks by itself:

- the range [PORTS_LOW, ephemeral low) is cut into blocks of PORT_BLOCK ports, one per
  pytest-xdist worker (`PYTEST_XDIST_WORKER=gwN` takes block N + 1; a run without workers,
  and the demo, block 0), so parallel workers never pick the same number;
- inside a block the ports are taken round in turn, from a counter in a file every process
  shares (under flock; a worker's subprocesses use the same block), so a number comes back
  only after the whole block has gone round;
- a port something is bound to (a bind without SO_REUSEADDR fails, also on a port still in
  TIME_WAIT) is passed over.

Where the counter file cannot be used the turn is kept per process, from a random start.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

PORTS_LOW = 20000
PORT_BLOCK = 1000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768  # Linux's default ip_local_port_range starts here
COUNTER_PREFIX = "monitord-test-ports."

_own_turn: dict[int, int] = {}  # block -> next offset, where the counter file cannot be used


class NoFreePort(RuntimeError):
    """Every port of this process's block is bound."""


def ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def worker_slot() -> int:
    """0 without pytest-xdist, N + 1 in worker gwN."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        return int(worker[2:]) + 1
    return 0


def block_range() -> range:
    """This process's block of ports: below the ephemeral range, by worker."""
    blocks = (ephemeral_low() - PORTS_LOW) // PORT_BLOCK
    if blocks < 1:
        raise NoFreePort(f"no room below the ephemeral range ({EPHEMERAL_RANGE}) "
                         f"from port {PORTS_LOW}")
    start = PORTS_LOW + (worker_slot() % blocks) * PORT_BLOCK
    return range(start, start + PORT_BLOCK)


def _next_offset(block: range) -> int:
    """The block's next turn: from the shared counter file, else this process's own."""
    path = Path(tempfile.gettempdir()) / f"{COUNTER_PREFIX}{block.start}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return _own_next(block)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.read(fd, 32).decode("ascii", "replace").strip()
        offset = int(raw) % len(block) if raw.isdigit() else 0
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, str((offset + 1) % len(block)).encode("ascii"))
        return offset
    except OSError:
        return _own_next(block)
    finally:
        os.close(fd)  # releases the flock


def _own_next(block: range) -> int:
    offset = _own_turn.get(block.start, random.randrange(len(block)))
    _own_turn[block.start] = (offset + 1) % len(block)
    return offset


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` nobody is bound to, and that nobody else gets from here soon."""
    block = block_range()
    for _ in range(len(block)):
        port = block[_next_offset(block)]
        if _bindable(host, port):
            return port
    raise NoFreePort(f"every port of {block.start}-{block.stop - 1} is in use on {host}")

