"""Rollback copy-back figures: what bringing the destination's data back adds to a rollback
after the destination ran, on a whole installation (`monitord.testing.stack.Stack`: real
`monitord run`, the in-process SSH VPS, the real agent, fake daemons, the split-brain
detector), for `CASES` (areas x bytes of data per area), each case on its own stack.

The figure: a move to the VPS is held at HEALTHCHECK_DESTINATION (`MONITORD_HOLD_AT`) while
every destination runs and writes session records for `DESTINATION_RUN_S`; then the operator
reverses (`PUT /v1/services/tg/placement {"location": "local"}`) and the hold is released. The
destination took the data over when it started, so the rollback fences it (stops the running
process), copies its data back to the PBX (staging, manifest, SHA-256 check, atomic rename:
the same `monitord.remote.copy` code as COPY, the other way; then the lineage record) and
only then restarts the source. The clock starts at the reversal request and stops when every
area has a local process alive that started after it (heartbeats seen by the detector) and
`GET /v1/status` lists no transaction. Each case runs on its own stack: first the
never-started reversal (below), then one figure per policy in POLICIES (monitord restarted on a
rewritten `rollback_data`), each one reversal.

The reference, and why it is this one: the question is what the copy-back ADDS to a rollback
that must happen anyway, so the reference is the same rollback without its copy step —
`reference_s` = wall time minus `copy_back_delay_s`, the time monitord's own log shows the copy
steps (each area's `fenced` -> `data_returned` record) held up the last area's end. That is
what this rollback costs when the source restarts on its own data, as it did before data
lineage. `ratio` = wall / reference: ratio - 1 is what the copy-back adds (0.2: 20 % longer).
The alternatives do not answer that question:
- `rollback_data = "discard"`: with the VPS reachable a discarding rollback copies the data back
  just the same — the policy only decides what happens when the copy-back FAILS. It is measured
  as a figure of its own (POLICIES) to show exactly that: same steps, same time.
- a rollback whose destination never started (held one phase earlier, at CREATE_DESTINATION:
  the data is on the VPS, nothing ran there, the source still holds the newest data, nothing
  comes back) is measured too, on the same stack before the figures, and reported as
  `never_started_s` / `ratio_to_never_started`. It is not the reference because it also skips
  stopping a RUNNING destination (`fence_s` against `never_started_fence_s`: a SIGTERM, the
  daemon's last record, its exit, through the agent), which every rollback after a running
  destination pays whatever `rollback_data` says; at small sizes that stop costs more than the
  copy, and the ratio would charge it to the copy-back.
- the plain time of moving the same bytes would say how efficient the copy is, not what it adds;
  `forward_copy_s` (the COPY step of the move just reversed: the same bytes the other way, the
  same code) and `copy_back_mib_per_s` answer that side.

Every run is also checked, never timed against a limit: the detector's split-brain overlaps and
data regressions (a process started on fewer session records than its area had written),
counted over the whole stack up to the end of the run, the never-started rollback included,
must be 0; `measure()` raises otherwise, with the figures in the message. `data_returned` =
areas and `data_discarded` = 0 say the copy-back ran in every figure, `rollbacks` = areas and
`step_retries` = 0 that nothing else happened on the way.

Called by `python -m benchmarks`; the unit smoke test calls `measure()` with its smallest case.
Not a test: no timing is pass/fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from monitord.testing.stack import Stack

KIB, MIB = 1024, 1024 * 1024
CASES = ((1, 256 * KIB), (1, 16 * MIB), (4, 256 * KIB), (4, 16 * MIB))  # (areas, bytes/area)
POLICIES = ("preserve", "discard")
MIN_UPTIME_S = 0.5
DESTINATION_RUN_S = 1.0  # how long the destination runs (and writes) before the reversal
SERVICE = "tg"
L2R = "local_to_remote"
POLL_S = 0.02


@dataclass
class _Steps:
    """A rollback's steps as monitord logged them (its own wall clock; None: not logged)."""

    fence_s: float | None  # reversal noticed -> destination fenced, of the area ended last
    copy_back_s: float | None  # fenced -> data returned: the longest of the areas
    copy_back_delay_s: float | None  # how much later the last area ended for the copy steps
    copy_back_span_s: float | None  # first area fenced -> last area's data returned
    forward_copy_s: float | None  # the COPY step of the move reversed, of the area ended last


@dataclass
class _Run:
    """One reversal: its wall time, its steps, and what it left behind."""

    wall_s: float
    steps: _Steps
    rollbacks: int
    step_retries: int
    data_returned: int
    data_discarded: int
    overlaps: int  # over the whole stack so far
    regressions: int  # over the whole stack so far
    problems: list[str] = field(default_factory=list)  # the new ones, described


def _logged_at(record: dict[str, Any]) -> float:
    stamp = str(record["timestamp"]).replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


def _records(stack: Stack, since: int, until: int | None = None) -> list[dict[str, Any]]:
    """monitord's JSON log records from line `since` (to `until`)."""
    found = []
    for line in stack.log_lines[since:until]:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and "event" in record:
                found.append(record)
    return found


def _phase_at(records: list[dict[str, Any]], area: str, **match: str) -> float | None:
    """When the first `transaction_phase` of `area` matching all of `match` was logged."""
    for r in records:
        if r["event"] == "transaction_phase" and r.get("area") == area and all(
            r.get(k) == v for k, v in match.items()
        ):
            return _logged_at(r)
    return None


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def _steps(*, moved: list[dict[str, Any]], rolled: list[dict[str, Any]], areas: list[str]
           ) -> _Steps:
    """Read the step durations out of the move's (`moved`) and the rollback's log records."""
    ended: dict[str, float] = {}
    fenced: dict[str, float] = {}
    returned: dict[str, float] = {}
    for area in areas:
        found = {
            "ended": _phase_at(rolled, area, phase="ROLLED_BACK"),
            "fenced": _phase_at(rolled, area, outcome="fenced"),
            "returned": _phase_at(rolled, area, outcome="data_returned")
            or _phase_at(rolled, area, outcome="data_discarded"),
        }
        for into, key in ((ended, "ended"), (fenced, "fenced"), (returned, "returned")):
            if (at := found[key]) is not None:
                into[area] = at
    if not (len(ended) == len(fenced) == len(returned) == len(areas)):
        # Not every area logged a copy-back (the never-started reference): the fence only.
        last = max(ended, key=ended.__getitem__, default=areas[0])
        return _Steps(fence_s=_span(_phase_at(rolled, last, outcome="reverse_requested"),
                                    fenced.get(last)),
                      copy_back_s=None, copy_back_delay_s=None, copy_back_span_s=None,
                      forward_copy_s=None)
    copies = {area: returned[area] - fenced[area] for area in areas}
    last = max(areas, key=ended.__getitem__)
    # Without any copy step each area's rollback would have ended earlier by its own
    # copy-back; the delay is how much later the last one ended than the latest of those.
    without_copy = max(ended[area] - copies[area] for area in areas)
    return _Steps(
        fence_s=_span(_phase_at(rolled, last, outcome="reverse_requested"), fenced[last]),
        copy_back_s=max(copies.values()),
        copy_back_delay_s=ended[last] - without_copy,
        copy_back_span_s=max(returned.values()) - min(fenced.values()),
        forward_copy_s=_span(_phase_at(moved, last, phase="COPY", previous="SUPPRESS_SOURCE"),
                             _phase_at(moved, last, previous="COPY", outcome="ok")),
    )


async def _hold_at(stack: Stack, point: str) -> None:
    """Restart monitord so that every move to the VPS waits at `point` until released."""
    if await stack.stop_monitord() != 0:
        raise RuntimeError("monitord did not stop cleanly")
    await stack.start_monitord(env={"MONITORD_HOLD_AT": f"{L2R}:{point}"})


def _set_policy(stack: Stack, policy: str) -> None:
    """Rewrite `[monitord] rollback_data` in the stack's monitord.toml (read at the next start)."""
    text = stack.config_path.read_text()
    lines = [n for n, line in enumerate(text.splitlines()) if line.startswith("rollback_data =")]
    if len(lines) != 1:
        raise RuntimeError(f"expected one rollback_data line in {stack.config_path}")
    rewritten = text.splitlines()
    rewritten[lines[0]] = f"rollback_data = {json.dumps(policy)}"
    stack.config_path.write_text("\n".join(rewritten) + "\n")


async def _serving_locally(stack: Stack, areas: list[str], *, after: float,
                           timeout_s: float) -> None:
    """Poll (cheaply: the detector first) until every area has a local process alive that
    started after `after` (detector clock) and no transaction is active."""
    deadline = time.monotonic() + timeout_s

    def all_local() -> bool:
        for area in areas:
            alive = set(stack.detector.alive(area))
            if not any(life.key in alive and life.key.side == "local" and life.first_seen > after
                       for life in stack.detector.lives(area)):
                return False
        return True

    async def no_transaction() -> bool:
        code, body = await stack.request("GET", "/v1/status")
        return code == 200 and not body["transactions"]

    while not all_local() or not await no_transaction():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(areas)} areas not serving locally within {timeout_s} s")
        await asyncio.sleep(POLL_S)  # poll interval of a deadline loop


async def _reversal(stack: Stack, *, hold: str, destination_runs: bool) -> _Run:
    """Move every area to the VPS, held at `hold`; reverse; time until local again."""
    areas = stack.areas[SERVICE]
    await _hold_at(stack, hold)
    since = len(stack.log_lines)
    await stack.place(SERVICE, "remote")
    await stack.wait_until(
        lambda: sum(r["event"] == "hold_point" for r in _records(stack, since)) >= len(areas),
        timeout_s=60 + 10 * len(areas), what=f"every area held at {hold}",
    )
    if destination_runs:
        await stack.wait_until(
            lambda: all(any(k.side == "remote" for k in stack.detector.alive(a)) for a in areas),
            timeout_s=30, what="every destination runs on the VPS",
        )
        await asyncio.sleep(DESTINATION_RUN_S)  # the VPS copies write what the source never saw
    overlaps_before = set(stack.detector.overlaps())
    regressions_before = len(stack.detector.regressions())
    mark = len(stack.log_lines)
    after = time.time()  # the detector's clock
    clock = time.perf_counter()
    await stack.place(SERVICE, "local")  # the operator reverses: a rollback
    stack.release_hold()
    await _serving_locally(stack, areas, after=after, timeout_s=120 + 20 * len(areas))
    wall_s = time.perf_counter() - clock

    rolled = _records(stack, mark)

    def count(event: str, **match: str) -> int:
        return sum(r["event"] == event and all(r.get(k) == v for k, v in match.items())
                   for r in rolled)

    overlaps, regressions = stack.detector.overlaps(), stack.detector.regressions()
    run = _Run(
        wall_s=wall_s,
        steps=_steps(moved=_records(stack, since, mark), rolled=rolled, areas=areas),
        rollbacks=count("transaction_phase", phase="ROLLED_BACK"),
        step_retries=count("step_retry"),
        data_returned=count("transaction_phase", outcome="data_returned"),
        data_discarded=count("transaction_phase", outcome="data_discarded"),
        overlaps=len(overlaps),
        regressions=len(regressions),
        problems=[o.describe() for o in overlaps if o not in overlaps_before]
        + [r.describe() for r in regressions[regressions_before:]],
    )
    # Settled local again (cleanup of the VPS leftovers done) before the next reversal.
    await stack.wait_settled(expect={SERVICE: "local"}, timeout_s=60 + 10 * len(areas))
    return run


def _figure(run: _Run, never_started: _Run, *, areas: int, data_bytes: int, policy: str
             ) -> dict[str, Any]:
    def r(value: float | None, digits: int = 3) -> float | None:
        return None if value is None else round(value, digits)

    steps = run.steps
    if steps.copy_back_s is None or steps.copy_back_span_s is None or (
        steps.copy_back_delay_s is None
    ):
        raise RuntimeError(f"no copy-back step in monitord's log for the {policy} rollback")
    reference_s = run.wall_s - steps.copy_back_delay_s
    return {
        "benchmark": "rollback_copy_back",
        "areas": areas,
        "data_bytes_per_area": data_bytes,
        "rollback_data": policy,
        "destination_ran_s": DESTINATION_RUN_S,
        "wall_s": r(run.wall_s),
        "reference": "the same rollback without its copy-back steps (each area's "
                     "fenced -> data_returned step, from monitord's log, taken out)",
        "reference_s": r(reference_s),
        "ratio": round(run.wall_s / reference_s, 2),
        "copy_back_s": r(steps.copy_back_s),
        "copy_back_delay_s": r(steps.copy_back_delay_s),
        "copy_back_span_s": r(steps.copy_back_span_s),
        "copy_back_mib_per_s": round(areas * data_bytes / steps.copy_back_span_s / MIB, 1),
        "forward_copy_s": r(steps.forward_copy_s),
        "fence_s": r(steps.fence_s),
        "never_started_s": r(never_started.wall_s),
        "never_started_fence_s": r(never_started.steps.fence_s),
        "ratio_to_never_started": round(run.wall_s / never_started.wall_s, 2),
        "data_returned": run.data_returned,
        "data_discarded": run.data_discarded,
        "rollbacks": run.rollbacks,
        "never_started_rollbacks": never_started.rollbacks,
        "step_retries": run.step_retries + never_started.step_retries,
        "split_brain_overlaps": run.overlaps,
        "data_regressions": run.regressions,
    }


async def _one_case(root: Path, *, areas: int, data_bytes: int,
                    policies: tuple[str, ...]) -> tuple[list[dict[str, Any]], list[str]]:
    from monitord.testing.stack import Stack, StackOptions

    options = StackOptions(services={SERVICE: areas}, data_bytes=data_bytes,
                           min_uptime_s=MIN_UPTIME_S, rollback_data="preserve")
    figures, problems = [], []
    async with Stack(root, options) as stack:
        await stack.wait_settled(expect={SERVICE: "local"}, timeout_s=60 + areas)
        never_started = await _reversal(stack, hold="CREATE_DESTINATION",
                                        destination_runs=False)
        problems += never_started.problems
        current = "preserve"
        for policy in policies:
            if policy != current:
                _set_policy(stack, policy)  # read at the restart _reversal begins with
                current = policy
            run = await _reversal(stack, hold="HEALTHCHECK_DESTINATION", destination_runs=True)
            problems += run.problems
            figures.append(_figure(run, never_started, areas=areas, data_bytes=data_bytes,
                                   policy=policy))
    return figures, problems


async def measure(
    tmp: Path, *, cases: tuple[tuple[int, int], ...] = CASES,
    policies: tuple[str, ...] = POLICIES,
) -> list[dict[str, Any]]:
    """One figure per (areas, bytes per area) case and policy, each case on its own stack.

    Raises AssertionError if any run saw a split-brain overlap or a data regression."""
    figures: list[dict[str, Any]] = []
    problems: list[str] = []
    for areas, data_bytes in cases:
        found, seen = await _one_case(tmp / f"r{areas}x{data_bytes}", areas=areas,
                                      data_bytes=data_bytes, policies=policies)
        figures += found
        problems += seen
    unsafe = [f for f in figures if f["split_brain_overlaps"] or f["data_regressions"]]
    if unsafe or problems:
        raise AssertionError(
            "rollback runs with overlaps or data regressions: "
            + "; ".join(problems) + " | figures: " + json.dumps(figures, sort_keys=True)
        )
    return figures


def run() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-rollback-") as tmp:
        return asyncio.run(measure(Path(tmp)))
