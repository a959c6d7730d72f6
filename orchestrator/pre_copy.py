"""Whether a move pre-copies an area, and the copy timings that rule is judged on.

A pre-copy (monitord/remote/copy) sends an area's files while its source still runs, so
that after the stop only what changed moves. It has a fixed cost beyond its bytes — a
staging dir made, an SFTP session, the receiver's digest of what arrived — paid in wall
time for every area. For a small area that costs more than sending all of it after the
stop does, so the area is copied whole while stopped instead (docs/design.md, "Pre-copy").

- `CopyCosts`: a bounded window of what this process saw its copies cost in one direction:
  the rate at which their bytes went over (`throughput`, bytes/s, only from copies that sent
  at least MIN_SAMPLE_BYTES: a few KiB measure latency, not rate) and what each pre-copy
  took beyond sending its bytes (`fixed_cost`, s). Each estimate is the median of the last
  WINDOW samples: one outlier among two or more others moves it no further than they lie.
- `decide(size=, rule=, min_bytes=, costs=)`: pre-copy or not, and why (`Decision`):
  * an unknown size is always pre-copied (`size_unknown`);
  * `by_size`: below `min_bytes` (the configured `remote.pre_copy_min_bytes`) is skipped;
  * `adaptive`: skipped when sending the area takes less time than a pre-copy's fixed
    cost, i.e. below `fixed_cost × throughput` bytes — clamped to
    [min_bytes / RANGE, min_bytes × RANGE], so that no run of bad measurements can make
    it pre-copy every area or none; until both estimates exist it is `min_bytes`
    (`cold_start`). `min_bytes = 0` pre-copies every area under either rule.

- `ends_the_preflight(code)`: a pre-copy is best effort — a failure means a fuller copy after
  the stop — except a cause retrying cannot fix (rules.PARK_AT_ONCE_CODES, found before the
  source stops) and a lost link: going on would stop the source for a copy of everything
  while down, over a link just lost (the copy would most likely fail too, and the area
  have been down for nothing). The move fails its preflight instead, the source runs on,
  and the next try resumes the pre-copy from what reached the VPS.
- `another_round(sent)`: a live store changes while the first pass sends it, so the
  pre-copy goes over what changed again (as QEMU's live migration does) — while the rounds
  shrink: another one after a round that sent more than SETTLED_BYTES and at most SHRINK
  of the round before, up to MAX_ROUNDS in all. What the last round leaves is all that
  crosses after the stop; a store changing faster than the link can follow stops shrinking
  and ends the rounds instead of chasing it.

Pure: the runtime (monitord/engine/copy_timings.py) records the timings and asks
`decide()` in the preflight (monitord/engine/phase_actions.py); the upload's pre-copy
(monitord/remote/copy/transfer.py) asks `another_round()` after each round.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from orchestrator import rules
from orchestrator.errors import ErrorCode
from orchestrator.text_enum import TextEnum

WINDOW = 8  # samples kept per estimate (the most recent)
MIN_SAMPLE_BYTES = 64 * 1024  # a copy that sent less says nothing about throughput
RANGE = 16  # the adaptive threshold stays within min_bytes / RANGE .. min_bytes * RANGE
# Rounds of the pre-copy: a round that sent this little leaves less than that for after
# the stop (16 pages of 4 KiB: 0.1 s at 5 Mbit/s), so another round gains nothing.
SETTLED_BYTES = 64 * 1024
SHRINK = 0.5  # a round earns the next only if it sent at most half of the one before
MAX_ROUNDS = 5  # the first pass and at most four over what changed


class Rule(TextEnum):
    """How the threshold is chosen: `remote.pre_copy` in the configuration."""

    ADAPTIVE = "adaptive"
    BY_SIZE = "by_size"


class DecidedBy(TextEnum):
    """Which rule made a `Decision` (the `rule` of area_pre_copy_skipped / area_pre_copied)."""

    SIZE_UNKNOWN = "size_unknown"
    BY_SIZE = "by_size"
    COLD_START = "cold_start"  # adaptive, but no copy has been timed yet: min_bytes
    ADAPTIVE = "adaptive"


@dataclass(frozen=True, slots=True)
class CopyCosts:
    """The last WINDOW samples of one direction's copy throughput and pre-copy fixed cost."""

    throughputs: tuple[float, ...] = ()  # bytes/s
    fixed_costs: tuple[float, ...] = ()  # s

    def with_copy(self, *, sent_bytes: int, send_s: float) -> CopyCosts:
        """A copy (or pre-copy) sent `sent_bytes` in `send_s` seconds of sending."""
        if sent_bytes < MIN_SAMPLE_BYTES or not send_s > 0:
            return self
        rate = sent_bytes / send_s
        if not math.isfinite(rate):
            return self
        return replace(self, throughputs=_kept(self.throughputs, rate))

    def with_pre_copy(self, *, wall_s: float, send_s: float) -> CopyCosts:
        """A pre-copy took `wall_s` in all, `send_s` of it sending its files' bytes."""
        if not (math.isfinite(wall_s) and math.isfinite(send_s)) or wall_s < 0 or send_s < 0:
            return self
        return replace(self, fixed_costs=_kept(self.fixed_costs, max(0.0, wall_s - send_s)))

    @property
    def throughput(self) -> float | None:
        return statistics.median(self.throughputs) if self.throughputs else None

    @property
    def fixed_cost(self) -> float | None:
        return statistics.median(self.fixed_costs) if self.fixed_costs else None


def _kept(window: tuple[float, ...], sample: float) -> tuple[float, ...]:
    return (*window, sample)[-WINDOW:]


@dataclass(frozen=True, slots=True)
class Decision:
    pre_copy: bool
    decided_by: DecidedBy
    threshold_bytes: int | None = None  # None: no threshold applied (size unknown)
    throughput: float | None = None  # bytes/s, the adaptive rule's estimate
    fixed_cost: float | None = None  # s, the adaptive rule's estimate

    def facts(self) -> dict[str, object]:
        """The decision as event fields: the rule, its threshold and what it was based on."""
        facts: dict[str, object] = {"rule": self.decided_by.value,
                                    "threshold_bytes": self.threshold_bytes}
        if self.decided_by is DecidedBy.ADAPTIVE:
            assert self.throughput is not None and self.fixed_cost is not None
            facts["throughput_bytes_s"] = round(self.throughput)
            facts["fixed_cost_s"] = round(self.fixed_cost, 4)
        return facts


def bounds(min_bytes: int) -> tuple[int, int]:
    """The range the adaptive threshold stays in, for a configured `min_bytes`."""
    return min_bytes // RANGE, min_bytes * RANGE


def decide(*, size: int | None, rule: Rule, min_bytes: int, costs: CopyCosts) -> Decision:
    """Whether an area of `size` bytes (None: unknown) is pre-copied (the module doc)."""
    if size is None:
        return Decision(pre_copy=True, decided_by=DecidedBy.SIZE_UNKNOWN)
    if rule is Rule.BY_SIZE:
        return Decision(pre_copy=size >= min_bytes, decided_by=DecidedBy.BY_SIZE,
                        threshold_bytes=min_bytes)
    throughput, fixed_cost = costs.throughput, costs.fixed_cost
    if throughput is None or fixed_cost is None:
        return Decision(pre_copy=size >= min_bytes, decided_by=DecidedBy.COLD_START,
                        threshold_bytes=min_bytes)
    low, high = bounds(min_bytes)
    wanted = fixed_cost * throughput  # the bytes a pre-copy's fixed cost would send
    threshold = high if wanted >= high else low if wanted <= low else round(wanted)
    return Decision(pre_copy=size >= threshold, decided_by=DecidedBy.ADAPTIVE,
                    threshold_bytes=threshold, throughput=throughput, fixed_cost=fixed_cost)


def another_round(sent: Sequence[int]) -> bool:
    """After pre-copy rounds that sent `sent` bytes each (the first: the whole tree), is
    one more over what changed since worth it? (the module doc)"""
    if not sent or len(sent) >= MAX_ROUNDS or sent[-1] <= SETTLED_BYTES:
        return False
    return len(sent) == 1 or sent[-1] <= sent[-2] * SHRINK


# The codes of a pre-copy cut by the link (ssh_errors.py's table, the agent's client).
LINK_LOST_CODES = frozenset(
    {ErrorCode.SSH_UNREACHABLE, ErrorCode.SSH_TIMEOUT, ErrorCode.AGENT_UNREACHABLE})


def ends_the_preflight(code: str) -> bool:
    """Whether a pre-copy that failed with `code` fails its move's preflight (the module
    doc), rather than leaving the copy after the stop to send what it did not."""
    return code in rules.PARK_AT_ONCE_CODES or code in LINK_LOST_CODES
