"""systemd's notify protocol (sd_notify(3)) as plain datagrams: READY=1, WATCHDOG=1, STOPPING=1.

`Notifier.from_environ()` reads NOTIFY_SOCKET (a path, or `@name` for the abstract namespace)
and WATCHDOG_USEC; without them every call is a no-op, so `monitord run` behaves the same under
systemd and in a terminal. Sending never raises: a failed datagram is reported through the
returned bool and logged by the caller, because a lost watchdog ping must not kill the daemon
that is trying to prove it is alive.

Callers: monitord.surface.daemon (READY=1 once the lock, the store, the listeners and the components
are up; WATCHDOG=1 from the main loop; STOPPING=1 when shutdown begins).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    """Sends notify datagrams to one socket address (or nowhere when `address` is None)."""

    def __init__(self, address: str | None, *, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        usec = env.get("WATCHDOG_USEC", "")
        watchdog_pid = env.get("WATCHDOG_PID", "")
        watchdog_for_us = not watchdog_pid or watchdog_pid == str(os.getpid())
        return cls(
            env.get("NOTIFY_SOCKET") or None,
            watchdog_usec=int(usec) if usec.isdigit() and watchdog_for_us else None,
        )

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_interval_s(self, default: float) -> float:
        """How often to ping: half the systemd watchdog timeout, else `default`."""
        if self.watchdog_usec:
            return min(default, self.watchdog_usec / 2_000_000)
        return default

    def notify(self, *fields: str) -> bool:
        """Send `KEY=VALUE` lines as one datagram; True if sent (or nothing to send to)."""
        if self.address is None:
            return True
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(fields).encode("utf-8"), target)
        except OSError:
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", f"MAINPID={os.getpid()}", *_status(status))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str = "") -> bool:
        return self.notify("STOPPING=1", *_status(status))

    def status(self, text: str) -> bool:
        return self.notify(*_status(text))


def _status(text: str) -> tuple[str, ...]:
    return (f"STATUS={text.replace(chr(10), ' ')}",) if text else ()
