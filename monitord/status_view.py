"""Human rendering of the status document (SPEC §8) for `monitord status` and `place --wait`.

Called by `monitord.client_commands` and the demo. Pure formatting over the JSON document
the daemon serves, so what an operator reads in a terminal is what the API says.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.table import Table


def _error_text(err: Any) -> str:
    if not err:
        return ""
    if isinstance(err, str):
        return err
    parts = [err.get("code", ""), err.get("detail", "")]
    if err.get("phase"):
        parts.append(f"(phase {err['phase']})")
    return " ".join(p for p in parts if p)


def services_table(status: dict[str, Any]) -> Table:
    table = Table(title="services", expand=False)
    columns = ("service", "desired", "state", "local", "remote", "migrating", "orphan", "error")
    for column in columns:
        table.add_column(column)
    for name, svc in sorted(status.get("services", {}).items()):
        counts = svc.get("counts", {})
        table.add_row(
            name,
            str(svc.get("desired", "")),
            str(svc.get("state", "")),
            str(counts.get("local", 0)),
            str(counts.get("remote", 0)),
            str(counts.get("migrating", 0)),
            str(counts.get("orphan", 0)),
            _error_text(svc.get("last_error")),
        )
    return table


def summary_lines(status: dict[str, Any]) -> list[str]:
    tunnel = status.get("tunnel") or {}
    counts = status.get("counts", {})
    cleanup = status.get("cleanup", {})
    drift = status.get("drift", {})
    lines = [
        f"tunnel: {tunnel.get('state', 'not configured')}"
        + (f" ({tunnel['last_error']})" if tunnel.get("last_error") else "")
        + f", attempts {tunnel.get('attempts', 0)}",
        "areas: "
        + ", ".join(f"{k} {counts.get(k, 0)}" for k in ("local", "remote", "migrating", "orphan")),
        f"cleanup backlog: {cleanup.get('backlog', 0)} (stuck {cleanup.get('stuck', 0)})"
        f", drift: {drift.get('after', drift.get('current', 0))}",
    ]
    for tx in status.get("transactions", []):
        lines.append(
            f"  tx {tx.get('transaction_id', '')[:8]} {tx.get('service')}/{tx.get('area', '')[:8]}"
            f" {tx.get('source')}->{tx.get('destination')} {tx.get('phase')}"
            f" attempt {tx.get('attempt')}"
        )
    return lines


def print_status(status: dict[str, Any], *, console: Console | None = None) -> None:
    console = console or Console()
    for line in summary_lines(status):
        console.print(line, highlight=False)
    console.print(services_table(status))


class Progress:
    """A one-line live progress display for `monitord place --wait`."""

    def __init__(self, *, service: str, target: str, console: Console | None = None) -> None:
        self.service, self.target = service, target
        self.console = console or Console(stderr=True)
        self._last = ""

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
        line = (
            f"{self.service} -> {self.target}: {there}/{len(areas)} areas there,"
            f" state {svc.get('state', '?')}" + (f", phases {', '.join(phases)}" if phases else "")
        )
        if line != self._last:
            self.console.print(line, highlight=False)
            self._last = line

    def finish(self, outcome: str) -> None:
        self.console.print(f"{self.service} -> {self.target}: {outcome}", highlight=False)
