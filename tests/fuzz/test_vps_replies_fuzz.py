"""Fuzz: what commands on the VPS print, as monitord parses it (a compromised VPS writes it).

Promise: the tunnel-lease helper's answer (monitord.remote.tunnel.lease_client), the
provisioning prepare report, the preflight probe and self-check reports
(monitord.remote.preflight) and the `ss` probe (monitord.remote.tunnel.port_holder) each
either give a well-typed value or raise a MonitordError — never another exception — for
any text: valid answers with a field swapped for any JSON value, deep nesting, 5000-digit
numbers, numbers no float holds (a 400-digit integer) or no clock reads (1e300), NaN,
look-alike digits ("²", "١") and raw garbage.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from monitord.remote import preflight, provisioning
from monitord.remote.tunnel import lease_client, port_holder
from orchestrator.errors import MonitordError

from .profiles import demo, profile

SESSION = {"sshd_pid": 10, "sshd_start_ticks": 5, "ssh_connection": "1 2 3 4"}
RECORD = {"owner_id": "o", "owner_label": "pbx", "acquired_at": 1.0, "renewed_at": 2.0,
          "ttl": 30.0, "session": SESSION}
VALID_ANSWER = {"op": "acquire", "ok": True, "action": "take", "reason": "free", "now": 5.0,
                "lease": RECORD, "holder": None, "session": SESSION, "fenced_pid": None}

ODD_TEXT = ["²", "١٢", "9" * 5000, "9" * 400, "-" + "9" * 400, "NaN", "-Infinity", "1e999",
            "1e300", "[" * 3000, "{" * 3000, "\x00", "\udcff", " ", "", "-1", "0x10", "755",
            "9"]
# Integers no float holds: float() of one raises OverflowError.
huge_integers = st.integers(min_value=2**1024, max_value=10**400) | st.integers(
    min_value=-(10**400), max_value=-(2**1024))

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), huge_integers, st.floats(), st.text(max_size=12),
    st.sampled_from(ODD_TEXT),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)


def _paths(document: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(document, dict):
        for key, value in document.items():
            found += _paths(value, (*prefix, key))
    return found


def _at(document: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        document = document[key]
    return document


@st.composite
def lease_lines(draw: st.DrawFn) -> str:
    """A valid answer with one field (at any depth) swapped, one number swapped for one out
    of range, or raw hostile text."""
    kind = draw(st.sampled_from(["swap", "swap", "drop", "number", "raw", "splice"]))
    document = json.loads(json.dumps(VALID_ANSWER))
    paths = [p for p in _paths(document) if p]
    if kind == "number":
        paths = [p for p in paths if type(_at(document, p)) in (int, float)]
        kind = "swap"
        values: st.SearchStrategy[Any] = st.one_of(huge_integers, st.floats(), st.sampled_from(
            [1e300, -1e300, 1.7e308, 2**63, 2**53 + 1]))
    else:
        values = json_values
    if kind in ("swap", "drop"):
        path = draw(st.sampled_from(paths))
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        if kind == "drop":
            parent.pop(path[-1], None)
        else:
            parent[path[-1]] = draw(values)
        return json.dumps(document, allow_nan=True)
    if kind == "splice":
        text = json.dumps(document)
        at = draw(st.integers(min_value=0, max_value=len(text)))
        return text[:at] + draw(st.sampled_from(ODD_TEXT)) + text[at:]
    return "".join(draw(st.lists(st.sampled_from(ODD_TEXT + ["{", "}", '"', ":"]),
                                 max_size=6)))


def check_lease_line(line: str) -> None:
    try:
        answer = lease_client.parse_answer(lease_client.parse_answer_document(line))
    except MonitordError:
        return
    assert isinstance(answer.ok, bool) and math.isfinite(answer.now)
    for record in (answer.lease, answer.holder):
        if record is not None:
            assert math.isfinite(record.expires_at)
            assert 0 <= record.session.sshd_pid and isinstance(record.owner_id, str)


@profile("vps")
@given(line=lease_lines())
def test_a_lease_answer_is_typed_or_a_monitord_error(line: str) -> None:
    check_lease_line(line)


report_lines = st.lists(
    st.tuples(
        st.sampled_from(["stale", "have", "missing", "arch", "user", "bin_dir", "write",
                         "avail_kb", "sha", ""]),
        st.lists(st.one_of(st.sampled_from(ODD_TEXT), st.text(max_size=8)), max_size=4),
    ).map(lambda t: " ".join([t[0], *t[1]])),
    max_size=8,
).map("\n".join)


@profile("vps")
@given(text=report_lines)
def test_the_provisioning_and_probe_reports_are_typed_or_a_monitord_error(text: str) -> None:
    try:
        hashes, stale, modes = provisioning.parse_prepare_report(text)
        assert stale >= 0 and all(0 <= mode <= 0o7777 for mode in modes.values())
    except MonitordError:
        pass
    facts = preflight.parse_probe_report(text)
    assert facts.avail_bytes is None or facts.avail_bytes >= 0
    assert 0 <= facts.bin_dir_mode <= 0o7777


@profile("vps")
@given(line=st.one_of(json_values.map(lambda v: json.dumps(v, allow_nan=True)),
                      st.sampled_from(ODD_TEXT),
                      st.builds(lambda ok, check: json.dumps(
                          {"check": check, "ok": ok, "detail": "d"}), json_values, json_values)))
def test_a_self_check_line_is_typed_or_skipped(line: str) -> None:
    found = preflight._self_check_line(line)
    if found is not None:
        assert isinstance(found.ok, bool) and isinstance(found.check, str)


ss_pieces = st.one_of(
    st.sampled_from(['users:(("sshd-session",pid=', 'users:(("sshd",pid=', ",fd=3))",
                     " lastrcv:", "@@stat\n", "@@parent\n", "@@estab\n", "@@self\n",
                     "@@sshd_listen\n", "(", ")", "\n", " ", "42"]),
    st.sampled_from(ODD_TEXT), st.text(max_size=6),
)


@profile("vps")
@given(text=st.lists(ss_pieces, max_size=20).map("".join))
def test_ss_output_gives_an_observation(text: str) -> None:
    observed = port_holder.parse_probe(text, port=8224)
    assert observed.holder.pid is None or 0 <= observed.holder.pid < 10**10


# -- the property can fail ----------------------------------------------------------------------


def _trusting_parse(line: str) -> None:
    """Broken on purpose: what lease_client did before it typed the answer."""
    document = json.loads(line)
    float(document.get("now", 0.0))
    lease = document.get("lease")
    if lease:
        float(lease["renewed_at"]) + float(lease["ttl"])
        int(lease["session"]["sshd_pid"])


def test_the_property_catches_a_trusting_parser() -> None:
    @demo()
    @given(line=lease_lines())
    def search(line: str) -> None:
        try:
            _trusting_parse(line)
        except MonitordError:
            pass

    with pytest.raises((ValueError, KeyError, TypeError, RecursionError)):
        search()
