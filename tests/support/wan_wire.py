"""The wire of a WAN link: a userspace bridge between two interfaces that delays, rate-limits
and loses frames, each way on its own, with a bounded queue.

Run inside a network namespace of its own that holds the two ends (`tests/support/wan_link.py`
builds it: the PBX's veth peer and the VPS's veth peer):

    python3 wan_wire.py --a DEV --b DEV --delay-ms 40 --rate-kbit 20000 --loss-pct 0 \
        --queue-ms 100 --seed 1

It works on whole Ethernet frames (AF_PACKET), below TCP, so the endpoints' TCP sees a real
path: its congestion control and SSH's flow control meet a line rate, a delay and a queue
that fills and drops at its tail, never an endless buffer. Each way, a frame that arrives:

- is lost with probability `loss-pct` (IP frames only: ARP is not what a WAN loses, and a
  lost ARP would stall a test for a second for no lesson), from a seeded RNG per direction;
- else waits behind the frames queued before it; if more than `queue-ms` of line rate is
  already waiting, it is dropped (tail drop);
- else leaves after its serialisation (`len * 8 / rate`) plus the one-way delay.

Offloads must be off on the veths whose frames this reads (ethtool: no TSO/GSO/GRO, no
checksum offload), or it would see 64 KiB segments with unfinished checksums.

Prints `ready` on stdout once both ends are open, then one line of JSON with each direction's
counters on SIGUSR1 and at exit (SIGTERM, SIGINT). Standard library only.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import random
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # a frame this host sent on the interface: our own, never forwarded
IP_ETHERTYPES = (b"\x08\x00", b"\x86\xdd")
MAX_FRAME = 65535
RCVBUF_BYTES = 8 * 1024 * 1024
RECV_BURST = 256  # frames read from one end before the other end and the due frames get a turn


class Direction:
    """One way of the wire: its queue of frames in flight and its counters."""

    def __init__(self, name: str, tx: socket.socket, *, delay_s: float, rate_bps: float,
                 queue_s: float, loss: float, seed: int) -> None:
        self.name = name
        self.tx = tx
        self.delay_s = delay_s
        self.rate_bps = rate_bps
        self.queue_s = queue_s
        self.loss = loss
        self.rng = random.Random(seed)
        self.in_flight: collections.deque[tuple[float, bytes]] = collections.deque()
        self.line_free_at = 0.0
        self.counts = {"frames": 0, "bytes": 0, "lost": 0, "tail_dropped": 0,
                       "send_errors": 0, "max_backlog_s": 0.0}

    def arrive(self, frame: bytes, now: float) -> None:
        if self.loss and frame[12:14] in IP_ETHERTYPES and self.rng.random() < self.loss:
            self.counts["lost"] += 1
            return
        start = max(now, self.line_free_at)
        backlog_s = start - now
        if self.rate_bps and backlog_s > self.queue_s:
            self.counts["tail_dropped"] += 1
            return
        self.counts["max_backlog_s"] = max(self.counts["max_backlog_s"], backlog_s)
        serialise_s = len(frame) * 8 / self.rate_bps if self.rate_bps else 0.0
        self.line_free_at = start + serialise_s
        # Due times never decrease (the line is FIFO), so the deque stays in order.
        self.in_flight.append((self.line_free_at + self.delay_s, frame))

    def deliver_due(self, now: float) -> None:
        while self.in_flight and self.in_flight[0][0] <= now:
            _, frame = self.in_flight.popleft()
            try:
                self.tx.send(frame)
            except OSError as e:  # the far end down (a cut link), or its queue full
                if e.errno not in (errno.ENETDOWN, errno.ENXIO, errno.ENOBUFS, errno.EAGAIN):
                    raise
                self.counts["send_errors"] += 1
                continue
            self.counts["frames"] += 1
            self.counts["bytes"] += len(frame)

    def next_due(self) -> float | None:
        return self.in_flight[0][0] if self.in_flight else None


def _open(dev: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
    s.bind((dev, 0))
    s.setblocking(False)
    return s


def _print_counters(directions: list[Direction]) -> None:
    print(json.dumps({d.name: d.counts for d in directions}), flush=True)


def _drain(rx: socket.socket, into: Direction) -> None:
    for _ in range(RECV_BURST):
        try:
            frame, address = rx.recvfrom(MAX_FRAME)
        except BlockingIOError:
            return
        except OSError as e:  # the interface went down under a cut link
            if e.errno in (errno.ENETDOWN, errno.ENXIO):
                return
            raise
        if address[2] != PACKET_OUTGOING:
            into.arrive(frame, time.monotonic())


def serve(args: argparse.Namespace) -> None:
    a, b = _open(args.a), _open(args.b)
    common = {"delay_s": args.delay_ms / 1000, "rate_bps": args.rate_kbit * 1000,
              "queue_s": args.queue_ms / 1000, "loss": args.loss_pct / 100}
    up = Direction("a_to_b", b, seed=args.seed, **common)
    down = Direction("b_to_a", a, seed=args.seed + 1, **common)
    directions = [up, down]
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    stop = []
    report = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGUSR1, lambda *_: report.append(1))
    print("ready", flush=True)
    while not stop:
        now = time.monotonic()
        for d in directions:
            d.deliver_due(now)
        dues = [t for t in (d.next_due() for d in directions) if t is not None]
        timeout = max(0.0, min(dues) - time.monotonic()) if dues else None
        readable, _, _ = select.select([a, b, wake_r], [], [], timeout)
        if a in readable:
            _drain(a, up)
        if b in readable:
            _drain(b, down)
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 64):
                        break
                except BlockingIOError:
                    break
        if report:
            report.clear()
            _print_counters(directions)
    _print_counters(directions)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="one end (the PBX's side)")
    parser.add_argument("--b", required=True, help="the other end (the VPS's side)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each way")
    parser.add_argument("--rate-kbit", type=float, default=0.0,
                        help="line rate each way, kbit/s (0: unlimited)")
    parser.add_argument("--loss-pct", type=float, default=0.0, help="IP frames lost, each way")
    parser.add_argument("--queue-ms", type=float, default=100.0,
                        help="most line time queued before the tail drops")
    parser.add_argument("--seed", type=int, default=1)
    serve(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
