"""remote_state.json (monitord/store/remote_state.py) is written whatever text its rows
carry: a lone surrogate (a legacy file may hold one as a JSON escape) is written as U+FFFD,
so the publish never raises out of a placement listener and the UI's decoder, which
refuses an unpaired surrogate's escape, reads the file."""

from __future__ import annotations

import json
from pathlib import Path

from monitord.store import spool_files
from monitord.store.remote_state import RemoteStateFile
from monitord.store.spool_files import ServiceCompatState


class TestTextThatDoesNotEncode:
    """A row whose last_error UTF-8 cannot encode is published, the surrogate replaced."""

    def test_a_legacy_row_holding_a_lone_surrogate_is_published(self, tmp_path: Path) -> None:
        path = tmp_path / "remote_state.json"
        path.write_text('{"tg": {"parked": true, "last_error": "cut \\ud83d"}}')
        state_file = RemoteStateFile(path)
        legacy = state_file.read_legacy()
        assert legacy == {"tg": ServiceCompatState(parked=True, last_error="cut \ud83d")}
        state_file.publish(legacy)
        text = path.read_bytes().decode("utf-8")
        assert "\\ud83d" not in text
        assert json.loads(text)["tg"]["last_error"] == "cut \ufffd"

    def test_a_written_row_reads_back_with_the_replacement(self, tmp_path: Path) -> None:
        path = tmp_path / "remote_state.json"
        spool_files.write_remote_state(path, {"tg": ServiceCompatState(last_error="\udc80")})
        assert spool_files.read_remote_state(path) == {
            "tg": ServiceCompatState(last_error="\ufffd")}
