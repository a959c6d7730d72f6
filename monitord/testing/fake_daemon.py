"""A fake messenger daemon: `python -m monitord.testing.fake_daemon --area A --data DIR
--side local|remote --generation N --heartbeat HOST:PORT [--heartbeat …] [--ignore-sigterm]
[--crash-after S] [--escape-child | --escape-child-clean]`.

It behaves like a messenger daemon where it matters to monitord:
- it keeps a small "session DB" (`session.db` in its data dir): one JSON record per line,
  each carrying the SHA-256 of the previous record, so a lost, truncated or torn copy is
  detected when the next daemon reads it at start (exit code 4, `session_db_broken`);
- every 100 ms it sends a heartbeat JSON line `{area, side, generation, pid, ts, seq,
  records, start_records}` over TCP to the split-brain detector, reconnecting when the
  connection drops (on the VPS the endpoint is a reverse-forwarded port): `records` is how
  many session records its DB holds now (it never reports more than it wrote),
  `start_records` how many it found when it started — so the detector can tell a start on
  data older than the newest any process of the area wrote;
- on SIGTERM it appends a last record, sends `{"event": "goodbye", …}` and exits 0, unless
  started with `--ignore-sigterm` (for stop-escalation tests); `--crash-after S` makes it
  exit with status 70 after S seconds (for crash-loop tests);
- `--escape-child` makes it fork, as it starts, a child that calls setsid() (as a daemon that
  daemonizes does: it is then in no process group a fence signals) and lives on doing
  nothing, its pid in `escaped.pid` in the data dir (for the tests of the cgroup fence);
  `--escape-child-clean` makes that child then exec a sleeper with an empty environment, so
  that not even its spawner's markers are left on it;
- `--store sqlite` keeps the records in a SQLite database in WAL mode (`session.sqlite`)
  instead, for the tests of warm copies, which only SQLite can take consistently;
  `--sqlite-pad-bytes N` gives each of its records N bytes of random padding (a `pad` field
  of hex digits in the payload, under the hash chain), so that the store grows as an
  account's does, for the benchmark of warm copies (benchmarks/warm_copies.py);
- `--churn-pages-per-s N` makes its data live as an account's SQLite store is: N random
  4 KiB pages of `media.bin` rewritten every second (fsynced), for the benchmarks of
  copies that must send changed pages only.
Service command templates expand {area}, {data_dir}, {generation} and {side}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

SESSION_DB = "session.db"
SQLITE_SESSION_DB = "session.sqlite"
CHURNED = "media.bin"
PAGE_BYTES = 4096
GENESIS = "0" * 64
EXIT_CRASH = 70
EXIT_DB_BROKEN = 4
ESCAPED_PID = "escaped.pid"


class SessionDbBroken(Exception):
    """The session DB's hash chain does not verify: the copy is torn or incomplete."""


def record_hash(prev: str, payload: dict[str, Any]) -> str:
    body = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256((prev + body).encode()).hexdigest()


def verify_session_db(path: Path) -> tuple[int, str]:
    """(records, last hash) of a valid chain; raises SessionDbBroken naming the bad line."""
    prev, count = GENESIS, 0
    if not path.exists():
        return 0, GENESIS
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                raise SessionDbBroken(f"{path}:{number}: truncated record")
            try:
                record = json.loads(raw)
                payload, claimed = record["payload"], record["hash"]
                linked = record["prev"] == prev
            except (ValueError, KeyError, TypeError) as e:
                raise SessionDbBroken(f"{path}:{number}: unreadable record ({e})") from e
            if not linked or record_hash(prev, payload) != claimed:
                raise SessionDbBroken(f"{path}:{number}: hash chain broken")
            prev, count = claimed, count + 1
    return count, prev


class SessionDb:
    """Append-only hash-chained records, fsynced one by one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count, self.last = verify_session_db(path)

    def append(self, payload: dict[str, Any]) -> None:
        digest = record_hash(self.last, payload)
        line = json.dumps({"prev": self.last, "hash": digest, "payload": payload}) + "\n"
        with self.path.open("ab") as f:
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())
        self.last, self.count = digest, self.count + 1


class SqliteSessionDb:
    """The same hash-chained records in a SQLite database in WAL mode (`session.sqlite`),
    one committed transaction each: a store a copy can only take consistently through
    SQLite (its pages and its WAL change together), as a messenger's is."""

    def __init__(self, path: Path, *, pad_bytes: int = 0) -> None:
        import sqlite3

        self.path = path
        self.pad_bytes = pad_bytes
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS records"
                         " (n INTEGER PRIMARY KEY, prev TEXT, hash TEXT, payload TEXT)")
        self.count, self.last = 0, GENESIS
        for n, prev, claimed, body in self._db.execute(
                "SELECT n, prev, hash, payload FROM records ORDER BY n"):
            payload = json.loads(body)
            if prev != self.last or record_hash(prev, payload) != claimed:
                raise SessionDbBroken(f"{path}: record {n}: hash chain broken")
            self.last, self.count = claimed, self.count + 1

    def append(self, payload: dict[str, Any]) -> None:
        if self.pad_bytes:
            payload = {**payload, "pad": os.urandom((self.pad_bytes + 1) // 2).hex()
                       [:self.pad_bytes]}
        digest = record_hash(self.last, payload)
        self._db.execute("INSERT INTO records (prev, hash, payload) VALUES (?, ?, ?)",
                         (self.last, digest, json.dumps(payload)))
        self.last, self.count = digest, self.count + 1


class HeartbeatSender:
    """One TCP connection to the detector, re-dialled (at most every 100 ms) when it drops."""

    def __init__(self, host: str, port: int) -> None:
        self._address = (host, port)
        self._sock: socket.socket | None = None
        self._next_dial = 0.0

    def send(self, message: dict[str, Any]) -> bool:
        if self._sock is None:
            if time.monotonic() < self._next_dial:
                return False
            self._next_dial = time.monotonic() + 0.1
            try:
                self._sock = socket.create_connection(self._address, timeout=0.5)
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                self._sock = None
                return False
        try:
            self._sock.sendall((json.dumps(message) + "\n").encode())
            return True
        except OSError:
            self.close()
            return False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Churn:
    """Rewrites random whole pages of one file, `per_tick` of them per tick on average."""

    def __init__(self, path: Path, per_tick: float) -> None:
        self.path = path
        self.per_tick = per_tick
        self.owed = 0.0

    def tick(self) -> None:
        self.owed += self.per_tick
        pages = int(self.owed)
        self.owed -= pages
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if not pages or size < PAGE_BYTES:
            return
        with self.path.open("r+b") as f:
            for _ in range(pages):
                f.seek(random.randrange(size // PAGE_BYTES) * PAGE_BYTES)
                f.write(os.urandom(PAGE_BYTES))
            f.flush()
            os.fsync(f.fileno())


def escape_child(data: Path, *, clean: bool) -> None:
    """Fork a child that leaves this process's session and process group and lives on until
    it is killed, its pid written (atomically) to `data/escaped.pid`; with `clean` it execs a
    sleeper with an empty environment."""
    if os.fork() != 0:
        return
    try:  # the child: nothing of the daemon's runs here
        os.setsid()
        staging = data / f".{ESCAPED_PID}.{os.getpid()}"
        staging.write_text(f"{os.getpid()}\n")
        os.replace(staging, data / ESCAPED_PID)
        if clean:
            os.execve(sys.executable, [sys.executable, "-c", _SLEEPER], {})
        while True:
            signal.pause()
    finally:
        os._exit(0)


_SLEEPER = "import signal\nwhile True: signal.pause()"


def run(args: argparse.Namespace) -> int:
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    if args.escape_child or args.escape_child_clean:
        escape_child(data, clean=args.escape_child_clean)
    try:
        db = SqliteSessionDb(data / SQLITE_SESSION_DB, pad_bytes=args.sqlite_pad_bytes) \
            if args.store == "sqlite" else SessionDb(data / SESSION_DB)
    except SessionDbBroken as e:
        print(json.dumps({"event": "session_db_broken", "detail": str(e)}), file=sys.stderr)
        return EXIT_DB_BROKEN
    terminate = False

    def _on_sigterm(signum: int, frame: FrameType | None) -> None:
        nonlocal terminate
        terminate = True

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else _on_sigterm)
    identity = {"area": args.area, "side": args.side, "generation": args.generation,
                "pid": os.getpid(), "start_records": db.count}
    db.append({**identity, "event": "start", "ts": time.time(), "records_before": db.count})
    senders = []
    for endpoint in args.heartbeat:
        host, _, port = endpoint.rpartition(":")
        senders.append(HeartbeatSender(host.strip("[]"), int(port)))
    started = time.monotonic()
    churn = Churn(data / CHURNED, args.churn_pages_per_s * args.interval) \
        if args.churn_pages_per_s else None
    seq = 0
    while not terminate:
        if args.crash_after is not None and time.monotonic() - started >= args.crash_after:
            for sender in senders:
                sender.close()  # no goodbye: a crash
            return EXIT_CRASH
        if seq % 10 == 0:  # written (fsynced) before it is reported
            db.append({**identity, "event": "tick", "ts": time.time(), "seq": seq})
        for sender in senders:
            sender.send({**identity, "ts": time.time(), "seq": seq, "records": db.count})
        if churn is not None:
            churn.tick()
        seq += 1
        time.sleep(args.interval)
    db.append({**identity, "event": "stop", "ts": time.time(), "seq": seq})
    for sender in senders:
        sender.send({**identity, "ts": time.time(), "seq": seq, "records": db.count,
                     "event": "goodbye"})
        sender.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fake_daemon", description=__doc__.splitlines()[0])
    parser.add_argument("--area", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--side", required=True, choices=("local", "remote"))
    parser.add_argument("--generation", type=int, required=True)
    parser.add_argument(
        "--heartbeat",
        required=True,
        action="append",
        help="detector HOST:PORT (repeatable: each heartbeat goes to every endpoint)",
    )
    parser.add_argument("--interval", type=float, default=0.1, help="heartbeat period, s")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--crash-after", type=float, default=None, help="exit 70 after S s")
    parser.add_argument("--escape-child", action="store_true",
                        help=f"leave a child behind in a session of its own ({ESCAPED_PID})")
    parser.add_argument("--escape-child-clean", action="store_true",
                        help="... which then execs a sleeper with an empty environment")
    parser.add_argument("--churn-pages-per-s", type=float, default=0.0,
                        help=f"rewrite this many random 4 KiB pages of {CHURNED} a second")
    parser.add_argument("--store", choices=("lines", "sqlite"), default="lines",
                        help=f"the session records in {SESSION_DB} (lines) or a SQLite"
                             f" database {SQLITE_SESSION_DB}")
    parser.add_argument("--sqlite-pad-bytes", type=int, default=0,
                        help="with --store sqlite, random padding of this many bytes in"
                             " every record")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
