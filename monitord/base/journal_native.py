"""Log entries to the systemd journal through its native protocol, standard library only.

The journal's socket (`/run/systemd/journal/socket`, a Unix datagram socket) takes one entry
per datagram: `KEY=VALUE` lines, or, for a value holding a newline, `KEY\\n`, its length as a
64-bit little-endian number, the value and `\\n` (systemd.journal-fields(7), "native protocol").
Each field becomes an entry field that `journalctl` can match on
(`journalctl MONITORD_AREA=1a2b…`); the PBX's structlog set-up (monitord.base.logs) and the
VPS agent's event log (monitord.vps.event_log) send their lines this way when their stderr is
the journal, with `MESSAGE` the same JSON line stderr would carry.

`MONITORD_JOURNAL_SOCKET` names another socket path (a container with the journal elsewhere,
or a test's own socket). A send that fails (no socket, journald restarting, an entry larger
than a datagram) returns False: the caller writes the line to stderr instead, so nothing is
lost that stderr would have kept.

Runs on the VPS too (Python >= 3.9).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import sys
import threading
from collections.abc import Mapping
from typing import IO

DEFAULT_SOCKET = "/run/systemd/journal/socket"
SOCKET_ENV = "MONITORD_JOURNAL_SOCKET"

# Our fields of an entry: event field name -> journal field name.
FIELDS: Mapping[str, str] = {
    "service": "MONITORD_SERVICE",
    "area": "MONITORD_AREA",
    "error_code": "MONITORD_CODE",
    "transaction_id": "MONITORD_TXN",
    "event": "MONITORD_EVENT",
}
# Level (structlog method or logging level name) -> syslog priority (sd-daemon(3)).
PRIORITIES: Mapping[str, int] = {
    "debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "exception": 3,
    "critical": 2, "fatal": 2,
}


def stderr_is_journal(
    environ: Mapping[str, str] = os.environ, stream: IO[str] | None = None
) -> bool:
    """True when `stream` (stderr) is the journal: `JOURNAL_STREAM` is its `st_dev:st_ino`.

    Comparing device and inode (not just the variable's presence) matters: a child whose
    stderr was redirected inherits the variable, and must not prefix lines going to a file.
    """
    dev, _, ino = environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat((stream or sys.stderr).fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError):  # unset, malformed, or a stream without a descriptor
        return False


def encode(fields: Mapping[str, str]) -> bytes:
    """One entry in the native protocol. Field names must be upper-case letters, digits and
    `_` (not first); a value with a newline gets the length-prefixed form."""
    parts = []
    for key, value in fields.items():
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            parts.append(key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n")
        else:
            parts.append(key.encode() + b"=" + data + b"\n")
    return b"".join(parts)


def entry_fields(
    *, message: str, level: str, identifier: str, event: Mapping[str, object]
) -> dict[str, str]:
    """MESSAGE, PRIORITY, SYSLOG_IDENTIFIER and the MONITORD_* fields of one log event
    (a field the event does not carry, or carries empty, is left out)."""
    fields = {
        "MESSAGE": message,
        "PRIORITY": str(PRIORITIES.get(level, 6)),
        "SYSLOG_IDENTIFIER": identifier,
    }
    for name, journal_name in FIELDS.items():
        value = event.get(name)
        if value is not None and value != "":
            fields[journal_name] = str(value)
    return fields


class JournalSocket:
    """A datagram socket to the journal; `send` is safe from several threads."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    @classmethod
    def open(cls, environ: Mapping[str, str] = os.environ) -> JournalSocket | None:
        """The journal's socket when it can be reached now, else None."""
        journal = cls(environ.get(SOCKET_ENV) or DEFAULT_SOCKET)
        with journal._lock:
            if not journal._connect():
                return None
        return journal

    def _connect(self) -> bool:
        self._close()
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            return False
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            return False
        self._sock = sock
        return True

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def send(self, fields: Mapping[str, str]) -> bool:
        """Send one entry; False when it could not be (the caller falls back to stderr).
        A journald that restarted is reconnected to once per entry."""
        data = encode(fields)
        with self._lock:
            for _ in range(2):
                if self._sock is None and not self._connect():
                    return False
                assert self._sock is not None
                try:
                    self._sock.send(data)
                    return True
                except OSError as e:
                    if e.errno == errno.EMSGSIZE:
                        return False  # too large for one datagram: stderr takes it
                    self._close()
            return False

    def close(self) -> None:
        with self._lock:
            self._close()
