"""`monitord status` prints what the daemon says as plain text: a `[/x]` or `[bold]` in a
quarantined uuid, a VPS error detail, a service name or a phase is shown as written, never
read as rich markup (a closing tag that closes nothing raised MarkupError and the command
crashed)."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from monitord.surface import status_view

HOSTILE = ["[/x]", "[bold red]boom[/]", "[link=http://x]", "\\[/x]", "[/]"]


def _status(text: str) -> dict[str, Any]:
    return {
        "tunnel": {"state": "down", "connected": False, "last_error": f"SSH_UNREACHABLE: {text}"},
        "counts": {}, "cleanup": {}, "drift": {},
        "config_error": {"code": "CONFIG_CORRUPT", "detail": text},
        "quarantined": [{"position": 0, "code": "AREA_ID_INVALID", "detail": f"uuid {text}"}],
        "transactions": [{"transaction_id": "t" * 8, "service": text, "area": text,
                          "source": "local", "destination": "remote", "phase": text,
                          "attempt": 1}],
        "loops": {text: {"errors": 1, "failing": 1,
                         "last_error": {"code": "INTERNAL", "detail": text, "at": 0}}},
        "services": {text: {
            "desired": text, "state": text, "counts": {},
            "last_error": {"code": "VPS_REPLY_INVALID", "detail": f"agent said {text}",
                           "area": text, "action": text},
            "last_move": {"direction": text, "areas": 1, "outcomes": {text: 1}},
        }},
    }


class TestMarkupInTheStatus:
    """Every text of the status document is printed literally."""

    @pytest.mark.parametrize("text", HOSTILE)
    def test_status_prints_hostile_text_as_written(self, text: str) -> None:
        out = io.StringIO()
        console = Console(file=out, width=400, color_system=None)
        status_view.print_status(_status(text), console=console)
        printed = out.getvalue()
        assert f"uuid {text}" in printed
        assert f"agent said {text}" in printed

    @pytest.mark.parametrize("text", HOSTILE)
    def test_progress_prints_hostile_text_as_written(self, text: str) -> None:
        out = io.StringIO()
        progress = status_view.Progress(service=text, target="remote",
                                        console=Console(file=out, width=400))
        progress.update(_status(text))
        progress.finish(f"failed: {text}")
        assert f"failed: {text}" in out.getvalue()
