"""Spool files: atomic replacement, faithful round-trips, corrupt files kept."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monitord.base import atomic_file
from monitord.store import spool_files
from monitord.store.spool_files import AreaEntry, ConfigCorrupt, ServiceCompatState

JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=2)
    | st.dictionaries(st.text(max_size=4), inner, max_size=2),
    max_leaves=3,
)
FIXTURE_AND_SLOW = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
RESERVED = {"uuid", "service", "location", "generation"}


@st.composite
def custom_config_documents(draw: st.DrawFn) -> dict[str, Any]:
    """Valid custom_config.json documents with unknown fields, optional keys and random order."""
    uuids = draw(st.lists(st.uuids().map(str), unique=True, max_size=4))
    entries = []
    for uuid in uuids:
        entry: dict[str, Any] = {}
        extra_keys = st.text(min_size=1, max_size=6).filter(lambda k: k not in RESERVED)
        extras = draw(st.dictionaries(extra_keys, JSON_VALUES, max_size=2))
        service = draw(st.sampled_from(["tg", "chats", "max"]))
        fields: list[tuple[str, Any]] = [("uuid", uuid), ("service", service)]
        if draw(st.booleans()):
            fields.append(("location", draw(st.sampled_from(["local", "remote"]))))
        if draw(st.booleans()):
            fields.append(("generation", draw(st.integers(min_value=0, max_value=10**6))))
        fields.extend(extras.items())
        for key, value in draw(st.permutations(fields)):
            entry[key] = value
        entries.append(entry)
    document: dict[str, Any] = {"custom_daemons": entries}
    if draw(st.booleans()):
        document["other_top_level"] = draw(JSON_VALUES)
    return document


class TestAtomicWrite:
    """A replacement is all-or-nothing: the target holds the old or the new bytes, never a mix."""

    def test_write_replaces_content_and_leaves_no_temp_file(self, tmp_path: Path) -> None:
        target = tmp_path / "f.json"
        target.write_bytes(b"old")
        atomic_file.atomic_write_bytes(target, b"new")
        assert target.read_bytes() == b"new"
        assert os.listdir(tmp_path) == ["f.json"]

    def test_failure_during_write_leaves_old_file_and_no_partial(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        target = tmp_path / "f.json"
        target.write_bytes(b"old content")

        def failing_fsync(fd: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr("monitord.base.atomic_file.os.fsync", failing_fsync)
        with pytest.raises(OSError):
            atomic_file.atomic_write_bytes(target, b"new content that never lands")
        assert target.read_bytes() == b"old content"
        assert os.listdir(tmp_path) == ["f.json"]

    def test_failure_of_the_rename_leaves_old_file_and_no_partial(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        target = tmp_path / "f.json"
        target.write_bytes(b"old")

        def failing_replace(src: Any, dst: Any) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr("monitord.base.atomic_file.os.replace", failing_replace)
        with pytest.raises(OSError):
            atomic_file.atomic_write_bytes(target, b"new")
        assert target.read_bytes() == b"old"
        assert os.listdir(tmp_path) == ["f.json"]


class TestCustomConfigRoundTrip:
    """Reading and writing custom_config.json keeps unknown fields, values and entry order."""

    @settings(max_examples=60, suppress_health_check=FIXTURE_AND_SLOW, deadline=None)
    @given(document=custom_config_documents())
    def test_read_then_write_is_identity(self, tmp_path: Path, document: dict[str, Any]) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text(json.dumps(document))
        config = spool_files.read_custom_config(path)
        spool_files.write_custom_config(path, config)
        written = json.loads(path.read_text())
        assert written == document
        assert [list(e) for e in written["custom_daemons"]] == [
            list(e) for e in document["custom_daemons"]
        ]

    @settings(max_examples=60, suppress_health_check=FIXTURE_AND_SLOW, deadline=None)
    @given(document=custom_config_documents(), data=st.data())
    def test_update_changes_only_one_area_location_and_generation(
        self, tmp_path: Path, document: dict[str, Any], data: st.DataObject
    ) -> None:
        if not document["custom_daemons"]:
            return
        path = tmp_path / "custom_config.json"
        path.write_text(json.dumps(document))
        target = data.draw(st.sampled_from(document["custom_daemons"]))["uuid"]
        spool_files.update_area_placement(path, uuid=target, location="remote", generation=42)
        written = json.loads(path.read_text())
        pairs = zip(document["custom_daemons"], written["custom_daemons"], strict=True)
        for before, after in pairs:
            if before["uuid"] == target:
                assert after == {**before, "location": "remote", "generation": 42}
                assert list(after)[: len(before)] == list(before)
            else:
                assert after == before and list(after) == list(before)
        assert spool_files.read_custom_config(path).entry(target) == AreaEntry(
            uuid=target, service=before_service(document, target), location="remote", generation=42
        )

    @settings(max_examples=60, suppress_health_check=FIXTURE_AND_SLOW, deadline=None)
    @given(document=custom_config_documents())
    def test_the_file_is_written_as_json_dumps_writes_it(
        self, tmp_path: Path, document: dict[str, Any]
    ) -> None:
        """The writer keeps odd numbers as their text; everything else reads as before."""
        path = tmp_path / "custom_config.json"
        spool_files.write_custom_config(path, spool_files.parse_custom_config(document, path=path))
        assert path.read_text() == json.dumps(document, indent=2, ensure_ascii=False) + "\n"

    def test_missing_location_means_local_and_missing_generation_means_zero(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text('{"custom_daemons": [{"uuid": "a1", "service": "tg"}]}')
        assert spool_files.read_custom_config(path).entries == (
            AreaEntry(uuid="a1", service="tg", location="local", generation=0),
        )

    def test_missing_file_is_an_empty_placement(self, tmp_path: Path) -> None:
        assert spool_files.read_custom_config(tmp_path / "absent.json").entries == ()

    def test_updating_an_unknown_area_raises_and_leaves_file(self, tmp_path: Path) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text('{"custom_daemons": []}')
        with pytest.raises(KeyError):
            spool_files.update_area_placement(path, uuid="nope", location="remote", generation=1)
        assert path.read_text() == '{"custom_daemons": []}'


def before_service(document: dict[str, Any], uuid: str) -> str:
    return str(next(e["service"] for e in document["custom_daemons"] if e["uuid"] == uuid))


MALFORMED = {
    "truncated": ('{"custom_daemons": [{"uuid": "a1", "serv', "line 1 column"),
    "not an object": ("[1, 2]", "top level"),
    # (a UI whose encoder failed writes `null`: no file would be an empty placement, every
    # area stopped; this is a broken file, never an empty one)
    "null": ("null", "top level"),
    "daemons not a list": ('{"custom_daemons": {}}', "custom_daemons"),
    "not utf-8": ('{"custom_daemons": "\udcff"}', "UTF-8"),
}

# One bad entry next to a good one: (entries, position, code, where). The good area "ok1"
# must survive every one of them.
GOOD = {"uuid": "ok1", "service": "tg", "location": "remote", "generation": 4}
BAD_ENTRIES: dict[str, tuple[list[Any], int, str, str]] = {
    "bad location": ([{"uuid": "a1", "service": "tg", "location": "mars"}], 0,
                     "AREA_ENTRY_INVALID", "custom_daemons[0].location"),
    "negative generation": ([{"uuid": "a1", "service": "tg", "generation": -1}], 0,
                            "AREA_ENTRY_INVALID", "custom_daemons[0].generation"),
    "not an object": ([7], 0, "AREA_ENTRY_INVALID", "custom_daemons[0]"),
    "missing uuid": ([{"service": "tg"}], 0, "AREA_ID_INVALID", "custom_daemons[0].uuid"),
    "braced uuid": ([{"uuid": "{5b1d}", "service": "tg"}], 0, "AREA_ID_INVALID", "uuid"),
    "padded uuid": ([{"uuid": " 5b1d", "service": "tg"}], 0, "AREA_ID_INVALID", "uuid"),
    "path uuid": ([{"uuid": "../chats/ok1", "service": "tg"}], 0, "AREA_ID_INVALID", "uuid"),
    "fragment uuid": ([{"uuid": "victim#", "service": "tg"}], 0, "AREA_ID_INVALID", "uuid"),
    "nul uuid": ([{"uuid": "a\u0000b", "service": "tg"}], 0, "AREA_ID_INVALID", "uuid"),
    "long uuid": ([{"uuid": "a" * 300, "service": "tg"}], 0, "AREA_ID_INVALID", "300"),
    "newline uuid": ([{"uuid": "a1\n", "service": "tg"}], 0, "AREA_ID_INVALID", "uuid"),
    "path service": ([{"uuid": "a1", "service": "../tg"}], 0, "AREA_ID_INVALID", "service"),
    "duplicate uuid": ([{"uuid": "a", "service": "tg"}, {"uuid": "a", "service": "max"}], 1,
                       "AREA_ID_INVALID", "custom_daemons[1].uuid"),
}


class TestOneBadEntryStaysInItsBox:
    """A bad entry is quarantined on its own, naming its position; the others go on, and a
    commit of another area leaves the bad entry exactly as it was."""

    @pytest.mark.parametrize("name", sorted(BAD_ENTRIES))
    def test_the_bad_entry_is_quarantined_and_the_good_one_kept(
        self, tmp_path: Path, name: str
    ) -> None:
        bad, position, code, where = BAD_ENTRIES[name]
        path = tmp_path / "custom_config.json"
        path.write_text(json.dumps({"custom_daemons": [*bad, GOOD]}))
        config = spool_files.read_custom_config(path)
        assert [e.uuid for e in config.entries] == ["ok1"]
        quarantined = [e for e in config.invalid if e.position == position]
        assert quarantined and quarantined[0].code == code
        assert where in quarantined[0].detail

    @pytest.mark.parametrize("name", sorted(BAD_ENTRIES))
    def test_a_commit_of_another_area_leaves_the_bad_entry_untouched(
        self, tmp_path: Path, name: str
    ) -> None:
        bad, _, _, _ = BAD_ENTRIES[name]
        path = tmp_path / "custom_config.json"
        path.write_text(json.dumps({"custom_daemons": [*bad, GOOD]}))
        spool_files.update_area_placement(path, uuid="ok1", location="local", generation=5)
        after = json.loads(path.read_text())["custom_daemons"]
        assert after[: len(bad)] == bad
        assert after[-1] == {**GOOD, "location": "local", "generation": 5}


class TestMalformedCustomConfig:
    """A malformed custom_config.json raises CONFIG_CORRUPT naming where, and is never rewritten."""

    @pytest.mark.parametrize("name", sorted(MALFORMED))
    def test_malformed_file_raises_config_corrupt_naming_the_position(
        self, tmp_path: Path, name: str
    ) -> None:
        text, where = MALFORMED[name]
        path = tmp_path / "custom_config.json"
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        with pytest.raises(ConfigCorrupt) as caught:
            spool_files.read_custom_config(path)
        assert caught.value.code == "CONFIG_CORRUPT"
        assert where in caught.value.detail

    @pytest.mark.parametrize("name", sorted(MALFORMED))
    def test_update_of_a_malformed_file_never_overwrites_it(
        self, tmp_path: Path, name: str
    ) -> None:
        text, _ = MALFORMED[name]
        path = tmp_path / "custom_config.json"
        original = text.encode("utf-8", "surrogateescape")
        path.write_bytes(original)
        with pytest.raises(ConfigCorrupt):
            spool_files.update_area_placement(path, uuid="a1", location="remote", generation=3)
        assert path.read_bytes() == original
        # no temp file left; the writers' lock stays (every writer opens it: docs/design.md)
        assert sorted(os.listdir(tmp_path)) == ["custom_config.json", "custom_config.json.lock"]


class TestRemoteState:
    """remote_state.json round-trips its per-service rows and tolerates legacy gaps."""

    @given(
        states=st.dictionaries(
            st.text(min_size=1, max_size=8),
            st.builds(
                ServiceCompatState,
                migrating=st.booleans(),
                resuming=st.booleans(),
                parked=st.booleans(),
                fail_count=st.integers(min_value=0, max_value=1000),
                last_error=st.text(max_size=20),
            ),
            max_size=4,
        )
    )
    @settings(max_examples=40, suppress_health_check=FIXTURE_AND_SLOW, deadline=None)
    def test_write_then_read_is_identity(
        self, tmp_path: Path, states: dict[str, ServiceCompatState]
    ) -> None:
        path = tmp_path / "remote_state.json"
        spool_files.write_remote_state(path, states)
        assert spool_files.read_remote_state(path) == states

    def test_legacy_rows_with_missing_keys_read_as_defaults(self, tmp_path: Path) -> None:
        path = tmp_path / "remote_state.json"
        path.write_text('{"tg": {"migrating": true}}')
        assert spool_files.read_remote_state(path) == {"tg": ServiceCompatState(migrating=True)}

    def test_broken_json_raises_config_corrupt(self, tmp_path: Path) -> None:
        path = tmp_path / "remote_state.json"
        path.write_text('{"tg": ')
        with pytest.raises(ConfigCorrupt):
            spool_files.read_remote_state(path)


def _as_written(text: str) -> Any:
    """The JSON document of `text` with every number as the text it is written with."""
    return json.loads(text, parse_int=lambda n: ("n", n), parse_float=lambda n: ("n", n))


def _entry_text(**fields: str) -> str:
    """A custom_config.json with one entry whose fields are raw JSON text."""
    raw = {"uuid": '"a1"', "service": '"tg"', **fields}
    body = ", ".join(f'"{k}": {v}' for k, v in raw.items())
    return '{"custom_daemons": [{' + body + '}, {"uuid": "a2", "service": "tg"}]}'


class TestHostileNumbersAndShapes:
    """Huge numbers, deep nesting and odd values make the file CONFIG_CORRUPT or quarantine
    the one entry; no other exception ever leaves the loader."""

    @pytest.mark.parametrize("text", [
        _entry_text(extra="[" * 100_000 + "]" * 100_000),  # the decoder's RecursionError
        _entry_text(extra="[" * 900 + "]" * 900),  # decodes, then deepcopy recursed
        _entry_text(extra='{"a":' * 400 + "1" + "}" * 400),
        _entry_text(generation="NaN"),
        _entry_text(extra="Infinity"),
    ], ids=["100000 deep", "900 deep", "400 deep objects", "NaN", "Infinity"])
    def test_the_file_is_config_corrupt_with_a_reason(self, tmp_path: Path, text: str) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text(text)
        with pytest.raises(ConfigCorrupt) as corrupt:
            spool_files.read_custom_config(path)
        assert corrupt.value.code == "CONFIG_CORRUPT"
        assert path.read_text() == text, "never rewritten"

    @pytest.mark.parametrize("generation", [
        str(2**63), str(2**64), "9" * 30, "9" * 99, "-1", "1e300", "1.0", '"7"', "true", "null",
        "[]",
        # numbers a Python int or float cannot hold: refused the whole file before
        pytest.param("9" * 5000, id="5000 digits"),
        pytest.param("-" + "9" * 5000, id="-5000 digits"), "1e400",
    ])
    def test_a_generation_outside_0_to_2_63_quarantines_only_its_entry(
        self, tmp_path: Path, generation: str
    ) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text(_entry_text(generation=generation))
        config = spool_files.read_custom_config(path)
        assert [e.uuid for e in config.entries] == ["a2"]
        assert [(q.position, q.code) for q in config.invalid] == [(0, "AREA_ENTRY_INVALID")]
        assert "generation" in config.invalid[0].detail

    @pytest.mark.parametrize("generation", [
        pytest.param("9" * 5000, id="5000 digits"), "9" * 30, "1e400"])
    def test_an_out_of_range_generation_is_named_so_in_a_short_reason(
        self, tmp_path: Path, generation: str
    ) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text(_entry_text(generation=generation))
        (quarantined,) = spool_files.read_custom_config(path).invalid
        assert "custom_daemons[0].generation" in quarantined.detail
        assert "out of range" in quarantined.detail
        assert len(quarantined.detail) < 200, "the reason shows the number cut short"

    def test_a_commit_writes_a_quarantined_entry_back_number_for_number(
        self, tmp_path: Path
    ) -> None:
        """The file is the UI's: a number Python cannot hold (or would write otherwise) in
        an entry monitord leaves alone comes back as the very text it was."""
        path = tmp_path / "custom_config.json"
        path.write_text(_entry_text(generation="9" * 5000, note="1e400", ratio="1.10",
                                    big="-" + "7" * 4400, tiny="1E-400"))
        before = _as_written(path.read_text())
        quarantined = spool_files.read_custom_config(path).invalid
        spool_files.update_area_placement(path, uuid="a2", location="remote", generation=7)
        after = _as_written(path.read_text())
        assert after["custom_daemons"][0] == before["custom_daemons"][0]
        assert after["custom_daemons"][1] == {**before["custom_daemons"][1],
                                              "location": "remote", "generation": ("n", "7")}
        config = spool_files.read_custom_config(path)
        assert config.invalid == quarantined
        assert config.entry("a2") == AreaEntry(uuid="a2", service="tg", location="remote",
                                               generation=7)

    @pytest.mark.parametrize("literal", [
        pytest.param("1" * 5000, id="5000 digits"),
        pytest.param("-" + "1" * 5000, id="-5000 digits"),
        "1e400", "-1e999", "1.10", "2.5E3", "0.30000000000000001"])
    def test_a_number_in_a_field_of_the_ui_keeps_the_entry_and_its_text(
        self, tmp_path: Path, literal: str
    ) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text(_entry_text(phone=literal))
        config = spool_files.read_custom_config(path)
        assert [e.uuid for e in config.entries] == ["a1", "a2"] and config.invalid == ()
        spool_files.update_area_placement(path, uuid="a1", location="remote", generation=3)
        assert _as_written(path.read_text())["custom_daemons"][0]["phone"] == ("n", literal)

    def test_the_highest_generation_is_2_63_minus_1(self, tmp_path: Path) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text(_entry_text(generation=str(2**63 - 1)))
        config = spool_files.read_custom_config(path)
        assert config.entry("a1") == AreaEntry(uuid="a1", service="tg", generation=2**63 - 1)

    def test_a_file_larger_than_the_bound_is_config_corrupt_unread(self, tmp_path: Path) -> None:
        path = tmp_path / "custom_config.json"
        path.write_text(_entry_text(extra='"' + "x" * spool_files.MAX_CUSTOM_CONFIG_BYTES + '"'))
        with pytest.raises(ConfigCorrupt, match="larger than"):
            spool_files.read_custom_config(path)

    def test_a_fifo_in_its_place_is_config_corrupt_at_once(self, tmp_path: Path) -> None:
        """A reader blocked on a FIFO would hold the file lock (and every commit) forever."""
        path = tmp_path / "custom_config.json"
        os.mkfifo(path)
        with pytest.raises(ConfigCorrupt, match="not a regular file"):
            spool_files.read_custom_config(path)


class TestTitles:
    """An entry's `title` (else its `name`) is what the operator calls the area; shown only."""

    def test_title_then_name_of_valid_entries_only(self, tmp_path: Path) -> None:
        document = {"custom_daemons": [
            {"uuid": "a1", "service": "tg", "title": "  Sales  ", "name": "ignored"},
            {"uuid": "a2", "service": "tg", "title": "", "name": "Support"},
            {"uuid": "a3", "service": "tg", "title": 7},
            {"uuid": "a4", "service": "tg", "name": "x" * 500},
            {"uuid": "../bad", "service": "tg", "title": "quarantined"},
        ]}
        parsed = spool_files.parse_custom_config(document, path=tmp_path / "c.json")
        assert parsed.titles() == {"a1": "Sales", "a2": "Support",
                                   "a4": "x" * spool_files.TITLE_MAX_CHARS}
