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


class TestControlCharactersInTheStatus:
    """Text in the status that reached the daemon from elsewhere (a UI's title, a detail) is
    printed with no control character a terminal would obey: ESC, CSI, BEL, a carriage
    return show as U+FFFD, on a terminal too."""

    @pytest.mark.parametrize("text", ["\x1b[2J", "\x1b]0;owned\x07", "ok\rforged", "\x9b2J"])
    def test_status_and_progress_print_no_control_character(self, text: str) -> None:
        status = _status(text)
        status["services"][text]["areas"] = [{"uuid": "a1", "title": text, "state": "running"}]
        out = io.StringIO()
        status_view.print_status(status, console=Console(file=out, width=400,
                                                         force_terminal=True))
        progress_out = io.StringIO()
        progress = status_view.Progress(service=text, target="remote", console=Console(
            file=progress_out, width=400, force_terminal=True))
        progress.update(status)
        progress.finish(f"failed: {text}")
        for printed in (out.getvalue(), progress_out.getvalue()):
            bare = printed.replace("\x1b[", "CSI")  # (rich's own styling)
            for code in ("CSI2J", "\x1b]", "\x07", "\rforged", "\x9b"):
                assert code not in bare, (text, printed[:500])
        assert "\ufffd" in out.getvalue()


MIB = 1 << 20


def _copying(*copies: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "tunnel": {"state": "up", "connected": True}, "counts": {}, "cleanup": {}, "drift": {},
        "transactions": [
            {"transaction_id": f"t{i}" * 4, "service": "tg", "area": f"a{i}" * 8,
             "source": "local", "destination": "remote", "phase": "PREFLIGHT", "attempt": 1,
             "copy": copy}
            for i, copy in enumerate(copies)],
        "services": {"tg": {"desired": "remote", "state": "preflight", "counts": {},
                            "areas": [{"location": "local"}] * len(copies)}},
    }


def _copy(done: int, total: int | None, rate: int | None, eta: float | None,
          stage: str = "pre_copy") -> dict[str, Any]:
    return {"stage": stage, "from": "local", "bytes_done": done, "bytes_total": total,
            "started_at": 0.0, "rate_bytes_s": rate, "eta_s": eta}


class TestCopyProgress:
    """A copy in flight shows its bytes, rate and ETA; a stalled one says so."""

    @pytest.mark.parametrize(("copy", "words"), [
        (_copy(12 * MIB, 100 * MIB, 2 * MIB, 44.0),
         "pre-copy 12.0 MiB of 100.0 MiB, 2.0 MiB/s, 0m44s left"),
        (_copy(512 * 1024, 3 * MIB, None, None, stage="copy"), "copy 512 KiB of 3.0 MiB"),
        ({"stage": "copy", "bytes_done": 0, "bytes_total": None}, "copy starting"),
        (_copy(12 * MIB, 100 * MIB, 0, None), "pre-copy 12.0 MiB of 100.0 MiB, stalled"),
        (_copy(3 << 30, 5 << 30, 100 * MIB, 5000.0),
         "pre-copy 3.00 GiB of 5.00 GiB, 100.0 MiB/s, 1h23m left"),
    ])
    def test_the_words_of_a_copy(self, copy: dict[str, Any], words: str) -> None:
        assert status_view.copy_words(copy) == words

    def test_status_shows_the_copy_of_its_transaction(self) -> None:
        lines = status_view.summary_lines(_copying(_copy(MIB, 4 * MIB, MIB, 3.0), None))
        assert [line for line in lines if line.startswith("  tx ")] == [
            "  tx t0t0t0t0 tg/a0a0a0a0 local->remote PREFLIGHT attempt 1:"
            " pre-copy 1.0 MiB of 4.0 MiB, 1.0 MiB/s, 0m03s left",
            "  tx t1t1t1t1 tg/a1a1a1a1 local->remote PREFLIGHT attempt 1"]

    def test_a_service_sums_its_copies(self) -> None:
        summed = status_view.service_copy(
            _copying(_copy(MIB, 4 * MIB, MIB, 3.0), _copy(2 * MIB, 4 * MIB, None, None),
                     _copy(0, 2 * MIB, MIB, 2.0)), "tg")
        assert summed is not None
        assert (summed["bytes_done"], summed["bytes_total"], summed["rate_bytes_s"],
                summed["eta_s"]) == (3 * MIB, 10 * MIB, 2 * MIB, 3.5)
        assert status_view.service_copy(_copying(None), "tg") is None

    def test_on_a_terminal_the_line_is_rewritten_in_place(self) -> None:
        out = io.StringIO()
        progress = status_view.Progress(service="tg", target="remote", console=Console(
            file=out, width=200, force_terminal=True, color_system=None))
        for done in (MIB, 2 * MIB, 2 * MIB):
            progress.update(_copying(_copy(done, 4 * MIB, MIB, 2.0)))
        progress.finish("converged")
        written = out.getvalue()
        assert written.count("\r\x1b[2K") == 3  # two lines, then cleared for the outcome
        assert "pre-copy 1.0 MiB of 4.0 MiB" in written
        assert "pre-copy 2.0 MiB of 4.0 MiB" in written
        assert written.endswith("tg -> remote: converged\n")
        assert written.count("\n") == 1

    def test_elsewhere_the_numbers_stay_quiet(self) -> None:
        out = io.StringIO()
        progress = status_view.Progress(service="tg", target="remote",
                                        console=Console(file=out, width=200))
        for done in (MIB, 2 * MIB, 3 * MIB):
            progress.update(_copying(_copy(done, 4 * MIB, MIB, 2.0)))
        progress.finish("converged")
        assert out.getvalue().splitlines() == [
            "tg -> remote: 0/1 areas there, state preflight, phases PREFLIGHT",
            "tg -> remote: converged"]


class TestWarmCopies:
    """`monitord areas` shows each remote area's warm copy as its age — what a give-up would
    lose — marked once overdue; `give-up` says per area what it starts on and the loss."""

    def _status(self, warm: dict[str, Any] | None) -> dict[str, Any]:
        return {"services": {"tg": {"areas": [{"uuid": "a1", "location": "remote",
                                               "warm_copy": warm}]}}}

    def _cell(self, warm: dict[str, Any] | None, *, now: float) -> str:
        [row] = status_view.area_rows(self._status(warm), now=now)
        out = io.StringIO()
        Console(file=out, width=200).print(status_view.areas_listing([row]))
        return out.getvalue().splitlines()[-1].split("a1", 1)[1]

    def test_its_age_then_overdue_with_the_last_failure(self) -> None:
        fresh = {"taken_at": 1000.0, "overdue_at": 1090.0, "error": None}
        assert self._cell(fresh, now=1042.0).rstrip().endswith("0m42s")
        late = {"taken_at": 1000.0, "overdue_at": 1090.0,
                "error": {"code": "WARM_COPY_FAILED", "detail": "d"}}
        assert self._cell(late, now=1100.0).rstrip().endswith("1m40s ! WARM_COPY_FAILED")
        first = {"taken_at": None, "overdue_at": 1090.0, "error": None}
        assert self._cell(first, now=1010.0).rstrip().endswith("none yet")
        [row] = status_view.area_rows(self._status(None), now=1000.0)
        assert (row["warm_copy_age_s"], row["warm_copy_overdue"]) == (None, None)

    def test_a_give_up_names_each_areas_loss(self) -> None:
        from monitord.surface.client_commands import give_up_line

        line = give_up_line({"service": "tg", "transaction_ids": ["t1", "t2"], "kept": {
            "a1": {"kept_copy": "warm", "kept_copy_age_s": 12.4, "warm_copy_taken_at": 1.0},
            "a2": {"kept_copy": "pbx", "kept_copy_age_s": 86400.0, "warm_copy_taken_at": None},
        }})
        assert line.splitlines()[1:] == ["  a1: starts on its warm copy, 12 s of its data lost",
                                         "  a2: starts on the PBX's own copy, 86400 s of its"
                                         " data lost"]
