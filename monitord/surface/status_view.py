"""Human rendering of the status document for `monitord status` and `place --wait`.

Called by `monitord.surface.client_commands` and monitord.surface.demo. Pure formatting over
the JSON document the daemon serves, so what an operator reads in a terminal is what the API
says.

Every text in that document may come from outside (a quarantined entry's uuid is whatever
custom_config.json holds, an error detail may quote the VPS), so nothing is ever read as
rich markup: lines are printed with `markup=False` and table cells are `Text` values. A
`[/x]` shows as `[/x]` instead of raising MarkupError and ending the command. Nor is any
control character passed to the terminal (`_shown`): ESC, CSI or a carriage return in a
title would clear the screen, retitle the window or forge the line it is on.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from monitord.base import outside_text

MIB = 1024 * 1024


def _when(at: Any) -> str:
    if isinstance(at, int | float):
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
    return str(at or "")


def _phases(status: dict[str, Any], service: str) -> str:
    phases = {
        str(tx.get("phase", ""))
        for tx in status.get("transactions", [])
        if tx.get("service") == service
    }
    return ", ".join(sorted(phases))


def services_table(status: dict[str, Any]) -> Table:
    """One row per service; the error column holds the stable code (details follow the table)."""
    table = Table(title="services", expand=False)
    columns = ("service", "desired", "state", "phase", "local", "remote", "migrating", "orphan",
               "error")
    for column in columns:
        table.add_column(column, no_wrap=True,
                         justify="right" if column in ("local", "remote", "migrating", "orphan")
                         else "left")
    for name, svc in sorted(status.get("services", {}).items()):
        counts = svc.get("counts", {})
        error = svc.get("last_error") or {}
        cells = (
            name,
            str(svc.get("desired", "")),
            str(svc.get("state", "")),
            _phases(status, name),
            str(counts.get("local", 0)),
            str(counts.get("remote", 0)),
            str(counts.get("migrating", 0)),
            str(counts.get("orphan", 0)),
            str(error.get("code", "")) if isinstance(error, dict) else str(error),
        )
        table.add_row(*(Text(_shown(cell)) for cell in cells))  # literal text, never markup
    return table


def areas_table(status: dict[str, Any], *, now: float | None = None) -> Table:
    """One row per area: where it is placed and how its daemon does there (the status
    document's `services.*.areas[].process`, orchestrator/area_health.py)."""
    now = time.time() if now is None else now
    table = Table(title="areas", expand=False)
    for column in ("service", "area", "side", "health", "pid", "uptime", "restarts 1h",
                   "last exit"):
        table.add_column(column, no_wrap=True,
                         justify="right" if column in ("pid", "uptime", "restarts 1h")
                         else "left")
    for name, svc in sorted(status.get("services", {}).items()):
        for area in svc.get("areas", []):
            process = area.get("process") or {}
            started = process.get("started_at")
            uptime = _duration(now - started) if isinstance(started, int | float) else ""
            recent = process.get("restarts_1h")
            exit_status = process.get("last_exit_status")
            uuid8 = str(area.get("uuid", ""))[:8]
            cells = (
                name, f"{area['title']} ({uuid8})" if area.get("title") else uuid8,
                str(process.get("side", "")),
                str(process.get("health", "")) + (
                    f" ({process['failures']} in a row)" if process.get("failures") else ""),
                str(process.get("pid") or ""), uptime,
                "" if recent is None else str(recent),
                "" if exit_status is None else str(exit_status),
            )
            table.add_row(*(Text(_shown(cell)) for cell in cells))  # a title is text, never markup
    return table


def area_rows(
    status: dict[str, Any], *, service: str | None = None, now: float | None = None
) -> list[dict[str, Any]]:
    """One flat row per area (of `service`, or of all), for `monitord areas`: where it is
    and how its daemon does there, and the downtime it had in its service's last move."""
    now = time.time() if now is None else now
    rows = []
    for name, svc in sorted(status.get("services", {}).items()):
        if service is not None and name != service:
            continue
        move = svc.get("last_move") if isinstance(svc.get("last_move"), dict) else {}
        downtimes = move.get("area_downtime_s") or {}
        for area in svc.get("areas", []):
            process = area.get("process") or {}
            started = process.get("started_at")
            warm = area.get("warm_copy") if isinstance(area.get("warm_copy"), dict) else {}
            taken = warm.get("taken_at")
            rows.append({
                "service": name,
                "uuid": area.get("uuid"),
                "title": area.get("title"),
                "location": area.get("location"),
                "desired": area.get("desired"),
                "phase": area.get("phase"),
                "side": process.get("side", area.get("location")),
                "health": process.get("health"),
                "state": process.get("state"),
                "pid": process.get("pid"),
                "started_at": started,
                "uptime_s": round(now - started, 1) if isinstance(started, int | float)
                else None,
                "restarts": process.get("restarts"),
                "restarts_1h": process.get("restarts_1h"),
                "failures": process.get("failures"),
                "last_exit_status": process.get("last_exit_status"),
                "last_downtime_s": downtimes.get(area.get("uuid")),
                "last_move_finished_at": move.get("finished_at")
                if area.get("uuid") in downtimes else None,
                # a remote area's warm copy: what a give-up would lose (None: no copies)
                "warm_copy_taken_at": taken,
                "warm_copy_age_s": round(max(0.0, now - taken), 1)
                if isinstance(taken, int | float) else None,
                "warm_copy_overdue": now > warm["overdue_at"]
                if isinstance(warm.get("overdue_at"), int | float) else None,
                "warm_copy_error": (warm.get("error") or {}).get("code"),
            })
    return rows


def areas_listing(rows: list[dict[str, Any]]) -> Table:
    """`monitord areas`: the rows of `area_rows` as a table."""
    # No box: the full UUID (what `monitord logs` takes) and ten more columns fit in 120
    # columns; a long title folds within its own column.
    table = Table(box=None, expand=False, pad_edge=False)
    right = ("pid", "uptime", "restarts", "1h", "downtime", "warm")
    for column in ("service", "area", "title", "side", "health", "pid", "uptime", "restarts",
                   "1h", "exit", "downtime", "warm"):
        table.add_column(column, no_wrap=column != "title", overflow="fold",
                         min_width=10 if column == "title" else None,
                         justify="right" if column in right else "left")
    for row in rows:
        health = str(row["health"] or "")
        if row.get("failures"):
            health += f" ({row['failures']} in a row)"
        downtime = row["last_downtime_s"]
        table.add_row(
            # a title is the operator's text: shown as written, never read as markup
            row["service"], str(row["uuid"]), Text(_shown(row["title"] or "")),
            str(row["side"] or ""),
            health, str(row["pid"] or ""),
            "" if row["uptime_s"] is None else _duration(row["uptime_s"]),
            "" if row["restarts"] is None else str(row["restarts"]),
            "" if row["restarts_1h"] is None else str(row["restarts_1h"]),
            "" if row["last_exit_status"] is None else str(row["last_exit_status"]),
            "" if downtime is None else f"{downtime:.2f} s",
            _warm_cell(row),
        )
    return table


def _warm_cell(row: dict[str, Any]) -> str:
    """A remote area's warm copy as its age ('none yet' before the first), marked '!' once
    overdue, with the last failure's code; empty for an area without warm copies."""
    if row.get("warm_copy_overdue") is None:
        return ""
    age = row.get("warm_copy_age_s")
    cell = "none yet" if age is None else _duration(age)
    if row.get("warm_copy_overdue"):
        cell += " !"
    if row.get("warm_copy_error"):
        cell += f" {row['warm_copy_error']}"
    return cell


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _size(n: int) -> str:
    if n < MIB:
        return f"{n / 1024:.0f} KiB"
    if n < 1024 * MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / (1024 * MIB):.2f} GiB"


def copy_words(copy: dict[str, Any]) -> str:
    """A copy in flight as one phrase: 'pre-copy 12.0 MiB of 100.0 MiB, 2.3 MiB/s, 0m34s
    left' (the status document's `copy`, orchestrator/copy_progress.py). Without a rate yet
    it says nothing of one; with nothing moving in the last seconds, 'stalled'."""
    stage = "pre-copy" if copy.get("stage") == "pre_copy" else "copy"
    total = copy.get("bytes_total")
    if not isinstance(total, int):
        return f"{stage} starting"  # (still listing what it copies)
    words = f"{stage} {_size(int(copy.get('bytes_done') or 0))} of {_size(total)}"
    rate, eta = copy.get("rate_bytes_s"), copy.get("eta_s")
    if rate == 0:
        return f"{words}, stalled"
    if isinstance(rate, int | float):
        words += f", {_size(int(rate))}/s"
        if isinstance(eta, int | float):
            words += f", {_duration(eta)} left"
    return words


def service_copy(status: dict[str, Any], service: str) -> dict[str, Any] | None:
    """The copies `service`'s transactions have in flight, summed into one: what
    `place --wait` shows for a service (None: no copy runs)."""
    copies: list[dict[str, Any]] = [
        tx["copy"] for tx in status.get("transactions", [])
        if tx.get("service") == service and isinstance(tx.get("copy"), dict)]
    if not copies:
        return None
    if len(copies) == 1:
        return copies[0]
    if any(not isinstance(c.get("bytes_total"), int) for c in copies):
        return {"stage": copies[0].get("stage"), "bytes_total": None}  # one is still listing
    done = sum(int(c.get("bytes_done") or 0) for c in copies)
    total = sum(int(c["bytes_total"]) for c in copies)
    rates = [c["rate_bytes_s"] for c in copies if isinstance(c.get("rate_bytes_s"), int | float)]
    rate = sum(rates) if rates else None
    stages = {c.get("stage") for c in copies}
    return {"stage": stages.pop() if len(stages) == 1 else "copy", "bytes_done": done,
            "bytes_total": total, "rate_bytes_s": rate,
            "eta_s": (total - done) / rate if rate else None}


def error_lines(status: dict[str, Any]) -> list[str]:
    """Each service's last error in full: code, phase, area, time, detail, recommended action."""
    lines = []
    for name, svc in sorted(status.get("services", {}).items()):
        err = svc.get("last_error")
        if not err:
            continue
        if not isinstance(err, dict):
            lines.append(f"{name}: {err}")
            continue
        where = "".join(
            (
                f" in phase {err['phase']}" if err.get("phase") else "",
                f" (area {err['area']})" if err.get("area") else "",
                f" at {_when(err['at'])}" if err.get("at") else "",
            )
        )
        lines.append(f"{name}: {err.get('code', '')}{where}: {err.get('detail', '')}")
        if err.get("action"):
            lines.append(f"  recommended: {err['action']}")
    return lines


def last_move_lines(status: dict[str, Any]) -> list[str]:
    """Each service's last move: direction, areas and outcomes, when, per-area downtime."""
    lines = []
    for name, svc in sorted(status.get("services", {}).items()):
        move = svc.get("last_move")
        if not isinstance(move, dict):
            continue
        outcomes = ", ".join(
            f"{outcome} {count}" for outcome, count in (move.get("outcomes") or {}).items()
            if count
        )
        downtime = move.get("downtime_s")
        down = (
            f"downtime max {downtime['max']:.2f} s, p50 {downtime['p50']:.2f} s"
            f" ({downtime['measured']} measured)"
            if isinstance(downtime, dict) else "downtime not measured"
        )
        in_flight = f", {move['in_flight']} in flight" if move.get("in_flight") else ""
        lines.append(
            f"{name}: last move {str(move.get('direction', '')).replace('_', ' ')}"
            f", {move.get('areas', 0)} areas ({outcomes}){in_flight}"
            f", ended {_when(move.get('finished_at'))}, {down}"
        )
    return lines


def _vps_memory_lines(memory: Any) -> list[str]:
    """`vps memory: 612 MiB available of 1024 MiB`, while the agent's last inventory said it."""
    if not isinstance(memory, dict) or not isinstance(memory.get("available_bytes"), int):
        return []
    total = memory.get("total_bytes")
    of = f" of {round(total / MIB)} MiB" if isinstance(total, int) else ""
    return [f"vps memory: {round(memory['available_bytes'] / MIB)} MiB available{of}"]


def summary_lines(status: dict[str, Any]) -> list[str]:
    tunnel = status.get("tunnel") or {}
    counts = status.get("counts", {})
    cleanup = status.get("cleanup", {})
    drift = status.get("drift", {})
    lines = [
        f"tunnel: {tunnel.get('state', 'not configured')}"
        # A past error is history once the tunnel is up again; show it only while down.
        + (
            f" ({tunnel['last_error']})"
            if tunnel.get("last_error") and not tunnel.get("connected")
            else ""
        )
        + f", attempts {tunnel.get('attempts', 0)}",
        *_vps_memory_lines(status.get("vps_memory")),
        "areas: "
        + ", ".join(f"{k} {counts.get(k, 0)}" for k in ("local", "remote", "migrating", "orphan")),
        f"cleanup backlog: {cleanup.get('backlog', 0)} (stuck {cleanup.get('stuck', 0)})"
        f", drift: {drift.get('after', drift.get('current', 0))}",
    ]
    error = status.get("config_error")
    if error:
        lines.append(f"{error['code']}: {error['detail']}")
    for entry in status.get("quarantined", []):
        lines.append(f"quarantined entry {entry['position']}: {entry['code']}: {entry['detail']}")
    for entry in status.get("held", []):
        lines.append(f"held {entry['service']}/{entry['area']}: {entry['detail']}")
    for tx in status.get("transactions", []):
        copy = tx.get("copy")
        lines.append(
            f"  tx {tx.get('transaction_id', '')[:8]} {tx.get('service')}/{tx.get('area', '')[:8]}"
            f" {tx.get('source')}->{tx.get('destination')} {tx.get('phase')}"
            f" attempt {tx.get('attempt')}"
            + (f": {copy_words(copy)}" if isinstance(copy, dict) else "")
        )
    return lines


def loop_lines(status: dict[str, Any]) -> list[str]:
    """One line per root loop that ever failed an iteration (the status document's `loops`)."""
    lines = []
    loops = status.get("loops") or {}
    for name in sorted(loops):
        loop = loops[name] if isinstance(loops[name], dict) else {}
        last = loop.get("last_error")
        if not isinstance(last, dict):
            continue
        errors = loop.get("errors", 0)
        now = f", failing now ({loop.get('failing')} in a row)" if loop.get("failing") else ""
        lines.append(f"loop {name}: {errors} failed iteration{'s' if errors != 1 else ''}{now};"
                     f" last {last.get('code')}: {last.get('detail')} at {_when(last.get('at'))}")
    return lines


def _shown(text: object) -> str:
    """Text as a terminal may be given it: a control character (ESC, CSI, BEL, CR — which
    a terminal would obey) or a lone surrogate from wherever the text came (a UI's title,
    an old record) shows as U+FFFD (outside_text.clean)."""
    return outside_text.clean(str(text), limit=_SHOWN_LIMIT)


_SHOWN_LIMIT = 64 << 10


def _print(console: Console, line: str) -> None:
    """One line as written: never markup, never highlighted, no control character."""
    console.print(_shown(line), highlight=False, soft_wrap=True, markup=False)


def print_status(status: dict[str, Any], *, console: Console | None = None) -> None:
    console = console or Console()
    for line in (*summary_lines(status), *loop_lines(status)):
        _print(console, line)
    console.print(services_table(status))
    if any(svc.get("areas") for svc in status.get("services", {}).values()):
        console.print(areas_table(status))
    for line in (*last_move_lines(status), *error_lines(status)):
        _print(console, line)


class LiveLine:
    """One line that follows a wait: on a terminal it is rewritten in place as it changes
    (bytes, rate, ETA); elsewhere (a log, a pipe) only a line whose `steady` part changed is
    printed, so that a copy's numbers do not fill it."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        self._shown = ""
        self._steady: str | None = None

    def show(self, line: str, *, steady: str | None = None) -> None:
        steady = line if steady is None else steady
        if self.live:
            if line != self._shown:
                self.console.file.write(f"\r\x1b[2K{_shown(line)}")
                self.console.file.flush()
                self._shown = line
        elif steady != self._steady:
            _print(self.console, steady)
        self._steady = steady

    def end(self, line: str) -> None:
        if self.live and self._shown:
            self.console.file.write("\r\x1b[2K")
            self.console.file.flush()
        _print(self.console, line)
        self._shown, self._steady = "", None


class Progress:
    """A one-line live progress display for `monitord place --wait`: where the service's
    areas are, its state and phases, and its copies' bytes, rate and ETA."""

    def __init__(self, *, service: str, target: str, console: Console | None = None) -> None:
        self.service, self.target = service, target
        self.line = LiveLine(console)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def update(self, status: dict[str, Any]) -> None:
        svc = status.get("services", {}).get(self.service, {})
        areas = svc.get("areas", [])
        there = sum(1 for a in areas if a.get("location") == self.target)
        phases = sorted(
            {
                tx.get("phase", "")
                for tx in status.get("transactions", [])
                if tx.get("service") == self.service
            }
        )
        steady = (
            f"{self.service} -> {self.target}: {there}/{len(areas)} areas there,"
            f" state {svc.get('state', '?')}" + (f", phases {', '.join(phases)}" if phases else "")
        )
        copy = service_copy(status, self.service)
        self.line.show(steady + (f", {copy_words(copy)}" if copy else ""), steady=steady)

    def finish(self, outcome: str) -> None:
        self.line.end(f"{self.service} -> {self.target}: {outcome}")
