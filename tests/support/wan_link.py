"""The links a PBX meets on the way to its VPS, and the wire that makes one between namespaces.

A profile is a one-way delay, a line rate and a loss, the same each way (an office uplink to a
rented VPS is symmetric enough for the figures here):

- `lan`: no wire at all, the veth as the fault tier always had it (microseconds, gigabits);
- `wan`: 40 ms each way, 20 Mbit/s (an ordinary office line to a VPS in another country);
- `far`: 150 ms each way, 5 Mbit/s, 1 % of IP frames lost each way (another continent over a
  poor line).

`LinkProfile.named("wan")` or `LinkProfile.parse("delay=40ms,rate=20mbit,loss=0.5%")` gives
one. With a profile other than `lan`, tests/faults/netns_vps.py puts a third namespace between
the PBX's veth and the VPS's and runs `tests/support/wan_wire.py` there (`start_wire`): a
userspace bridge of whole frames, so TCP and SSH meet a real path — a line that serialises,
a bounded queue that drops at its tail (`queue_ms` of line time, 100 ms by default), a
propagation delay, seeded random loss — and the fault tier's cuts (`link_down`, `black_hole`)
work through it as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

WIRE_SCRIPT = Path(__file__).with_name("wan_wire.py")
WIRE_READY_TIMEOUT_S = 10.0
WIRE_STOP_TIMEOUT_S = 5.0
DEFAULT_QUEUE_MS = 100.0
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_FIELDS = ("delay", "rate", "loss", "queue")


class LinkError(ValueError):
    """A link profile that cannot be: an unknown name or a malformed spec."""


@dataclass(frozen=True)
class LinkProfile:
    name: str
    delay_ms: float = 0.0  # one way, each way
    rate_bit_s: float = 0.0  # each way; 0: the veth's own
    loss_pct: float = 0.0  # of IP frames, each way
    queue_ms: float = DEFAULT_QUEUE_MS

    @property
    def wired(self) -> bool:
        """Whether this link needs the wire (lan does not)."""
        return bool(self.delay_ms or self.rate_bit_s or self.loss_pct)

    @property
    def rtt_s(self) -> float:
        return 2 * self.delay_ms / 1000

    def transfer_floor_s(self, payload_bytes: int) -> float:
        """The least time `payload_bytes` can take to cross at the line rate (0: unlimited)."""
        return payload_bytes * 8 / self.rate_bit_s if self.rate_bit_s else 0.0

    @classmethod
    def named(cls, name: str) -> LinkProfile:
        try:
            return PROFILES[name]
        except KeyError:
            raise LinkError(f"unknown link {name!r}: one of {', '.join(PROFILES)}, or a spec "
                            "like delay=40ms,rate=20mbit,loss=1%") from None

    @classmethod
    def parse(cls, text: str) -> LinkProfile:
        """A profile's name, or `delay=Nms,rate=N(k|m|g)bit,loss=N%,queue=Nms` (any subset)."""
        if text in PROFILES:
            return PROFILES[text]
        parts = [part.strip().partition("=") for part in text.split(",")]
        if any(key not in _FIELDS or not sep for key, sep, _ in parts):
            cls.named(text)  # neither a name nor a spec: raises with the list of names
        fields = {key: _quantity(key, value) for key, _, value in parts}
        return cls(name=text, delay_ms=fields.get("delay", 0.0),
                   rate_bit_s=fields.get("rate", 0.0), loss_pct=fields.get("loss", 0.0),
                   queue_ms=fields.get("queue", DEFAULT_QUEUE_MS))


def _quantity(key: str, value: str) -> float:
    unit = {"delay": "ms", "queue": "ms", "loss": "%"}.get(key)
    if key == "rate":
        m = re.fullmatch(r"([0-9.]+)(kbit|mbit|gbit)", value)
        if m:
            return float(m[1]) * _UNITS[m[2]]
    elif unit is not None and value.endswith(unit):
        with contextlib.suppress(ValueError):
            return float(value[: -len(unit)])
    raise LinkError(f"bad link field {key}={value!r}")


PROFILES = {
    "lan": LinkProfile("lan"),
    "wan": LinkProfile("wan", delay_ms=40, rate_bit_s=20e6),
    "far": LinkProfile("far", delay_ms=150, rate_bit_s=5e6, loss_pct=1.0),
}


@dataclass
class Wire:
    """A running wire process; it answers SIGUSR1 with a line of counters on its stdout."""

    process: asyncio.subprocess.Process

    async def counters(self) -> dict[str, dict[str, float]]:
        """Each direction's counters now ({"a_to_b": …, "b_to_a": …}; a is the PBX's end)."""
        assert self.process.stdout is not None
        self.process.send_signal(signal.SIGUSR1)
        line = await asyncio.wait_for(self.process.stdout.readline(), WIRE_READY_TIMEOUT_S)
        counters: dict[str, dict[str, float]] = json.loads(line)
        return counters

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), WIRE_STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()


async def start_wire(netns_argv: list[str], *, a: str, b: str, link: LinkProfile,
                     seed: int = 1) -> Wire:
    """Start the wire between devices `a` (the PBX's end) and `b` inside the namespace that
    `netns_argv` enters (e.g. ["ip", "netns", "exec", NAME]); returns once it forwards."""
    argv = [*netns_argv, sys.executable, str(WIRE_SCRIPT), "--a", a, "--b", b,
            "--delay-ms", str(link.delay_ms), "--rate-kbit", str(link.rate_bit_s / 1000),
            "--loss-pct", str(link.loss_pct), "--queue-ms", str(link.queue_ms),
            "--seed", str(seed)]
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    wire = Wire(process)
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), WIRE_READY_TIMEOUT_S)
    except TimeoutError:
        line = b""
    if line.strip() != b"ready":
        await wire.stop()
        assert process.stderr is not None
        err = (await process.stderr.read()).decode(errors="replace")
        raise RuntimeError(f"the WAN wire did not start: {err[-2000:]}")
    return wire
