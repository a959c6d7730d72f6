"""One error convention: every code a client can see is in the catalogue and its document.

The scan reads monitord/ — the HTTP API, the CLI, the VPS agent, every log line — and
orchestrator/ as source text (the AST, so comments and docstrings do not count) and collects
everything shaped like an error code: a string that is one upper-case word or several joined
by `_` (`"NOT_FOUND"`, `"DRAINING"`), such a word with `_` inside a longer text (`f"failed:
UNKNOWN_AREA …"`), and every `ErrorCode.X`. Each must be a catalogued code
(orchestrator/errors.py) with its row in docs/error-codes.md, or one of the names below that
are not error codes (phase names, HTTP methods, environment variables, …). A new code-shaped
string that is neither fails here: catalogue it, or — when it is not an error code — add it to
`NOT_CODES` with the reason.

The converse holds too: every catalogued code is produced somewhere in monitord/ or
orchestrator/ (a code nobody raises is a catalogue entry an operator can never meet).
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib
import pkgutil
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

import orchestrator
from orchestrator.errors import CATALOGUE, ErrorCode

ROOT = Path(__file__).resolve().parents[2]
SCANNED = (ROOT / "monitord", ROOT / "orchestrator")
CATALOGUE_MODULE = ROOT / "orchestrator" / "errors.py"
STATIC = ROOT / "monitord" / "surface" / "static"
ERROR_CODES_MD = ROOT / "docs" / "error-codes.md"

# A whole string that could be a code: one upper-case word of 4+ characters, or words joined by _.
WHOLE = re.compile(r"[A-Z][A-Z0-9]{3,}|[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")
# Inside a longer text only words joined by _ count (plain capitals are ordinary prose).
INSIDE = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b")
# A string literal of the status page's script ("…", '…' or `…` on one line).
JS_STRING = re.compile(r"([\"'`])((?:(?!\1)[^\\\n])*)\1")


def _enum_values() -> frozenset[str]:
    """Member values of every enum in orchestrator/ except the error codes (phases, kinds,
    states, ...): they are words of the data model, not errors."""
    values: set[str] = set()
    for info in pkgutil.iter_modules(orchestrator.__path__, "orchestrator."):
        module = importlib.import_module(info.name)
        for item in vars(module).values():
            if isinstance(item, type) and issubclass(item, enum.Enum) and item is not ErrorCode:
                values.update(str(m.value) for m in item if isinstance(m.value, str))
    return frozenset(values)


# Code-shaped strings that are not error codes, by what they are.
NOT_CODES = _enum_values() | {
    # HTTP methods (requests built and routed)
    "HEAD", "POST", "DELETE",
    # environment variables read or set
    "HOME", "USER", "LOGNAME", "PYTHONPATH", "JOURNAL_STREAM", "NOTIFY_SOCKET", "WATCHDOG_PID",
    "WATCHDOG_USEC", "SSH_CONNECTION", "MONITORD_AREA", "MONITORD_CONFIG", "MONITORD_CRASH_AT",
    "MONITORD_GENERATION", "MONITORD_HOLD_AT", "MONITORD_HOLD_RELEASE", "MONITORD_STACK_ROOT",
    "MONITORD_SUPERVISOR", "MONITORD_LOOP_FAULT", "MONITORD_SNAPSHOT_DIR", "MONITORD_DATA_DIR",
    "MONITORD_JOURNAL_SOCKET", "PYTEST_XDIST_WORKER",
    # journal entry fields (monitord/base/journal_native.py)
    "MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER", "MONITORD_SERVICE", "MONITORD_CODE",
    "MONITORD_TXN", "MONITORD_EVENT",
    # crash and hold point names (monitord/engine/crash_points.py)
    "COMMIT_WRITTEN",
    # SQL keywords (monitord/store/state_db.py, monitord/vps/warm_snapshot.py)
    "COMMIT", "ROLLBACK", "BEGIN",
    # operating system names: a sysconf variable, a socket family
    "SC_CLK_TCK", "AF_UNIX",
    # argparse metavars, `monitord demo`'s verdict words
    "VERB", "SHA256", "PASS", "FAIL",
    # HTTP header values (X-Frame-Options: DENY on every API answer)
    "DENY",
    # names a package exports (`__all__` of monitord/remote/copy)
    "DIGESTS_SUFFIX", "STAGING_SUFFIX",
}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _sources() -> Iterator[Path]:
    for root in SCANNED:
        yield from sorted(root.rglob("*.py"))


def code_shaped(source: str) -> Iterator[tuple[str, int]]:
    """(code-shaped string, line) of one Python module: see the module docstring."""
    tree = ast.parse(source)
    docstrings = _docstring_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "ErrorCode":
            yield node.attr, node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            if WHOLE.fullmatch(node.value):
                yield node.value, node.lineno
            else:
                yield from ((word, node.lineno) for word in INSIDE.findall(node.value))


@functools.cache
def scan() -> dict[str, set[str]]:
    """Every code-shaped string outside the catalogue module -> where it occurs."""
    seen: dict[str, set[str]] = defaultdict(set)
    for path in _sources():
        if path == CATALOGUE_MODULE:
            continue
        for word, line in code_shaped(path.read_text()):
            seen[word].add(f"{path.relative_to(ROOT)}:{line}")
    for path in sorted(STATIC.iterdir()):  # the status page: its script's string literals
        for number, text in enumerate(path.read_text().splitlines(), 1):
            for _, literal in JS_STRING.findall(text):
                words = [literal] if WHOLE.fullmatch(literal) else INSIDE.findall(literal)
                for word in words:
                    seen[word].add(f"{path.relative_to(ROOT)}:{number}")
    return seen


CATALOGUED = frozenset(code.value for code in CATALOGUE)


def documented() -> frozenset[str]:
    return frozenset(re.findall(r"^\| `([A-Z_]+)` \|", ERROR_CODES_MD.read_text(), re.M))


class TestTheScanner:
    """The scanner finds codes wherever a client could meet them, and nothing in prose."""

    def test_it_finds_codes_in_answers_logs_and_texts(self) -> None:
        source = '''
"""A docstring naming NOT_A_CODE_EITHER is prose."""
def handler():
    # a comment naming COMMENTED_OUT is not code
    log.warning("thing_failed", error_code="LOGGED_CODE")
    print(f"monitord: failed: TEXT_CODE {detail}")
    raise error_for(ErrorCode.ENUM_CODE, "x")
    return error_response(404, code="GONE", detail="route")
'''
        assert sorted(word for word, _ in code_shaped(source)) == [
            "ENUM_CODE", "GONE", "LOGGED_CODE", "TEXT_CODE"
        ]

    def test_it_sees_the_codes_of_each_client_surface(self) -> None:
        seen = scan()
        assert any(p.startswith("monitord/surface/http_api.py") for p in seen["NOT_FOUND"])
        assert any(p.startswith("monitord/vps/server.py") for p in seen["AGENT_UNAUTHORIZED"])
        assert any(p.startswith("monitord/surface/client_commands.py")
                   for p in seen["DAEMON_UNREACHABLE"])
        assert any(p.startswith("monitord/local/supervisor.py") for p in seen["INTERNAL"])


class TestEveryVisibleCodeIsCatalogued:
    def test_every_code_shaped_string_is_a_catalogued_code_or_a_known_other_name(self) -> None:
        unknown = {word: sorted(where) for word, where in scan().items()
                   if word not in CATALOGUED and word not in NOT_CODES}
        assert not unknown, (
            "code-shaped strings outside the catalogue (add them to orchestrator/errors.py and"
            " run scripts/gen_docs.py, or list a name that is no error code in NOT_CODES):"
            f" {unknown}"
        )

    def test_no_name_that_is_not_a_code_shadows_a_code(self) -> None:
        assert not NOT_CODES & CATALOGUED

    def test_the_document_lists_exactly_the_catalogue(self) -> None:
        assert documented() == CATALOGUED

    @pytest.mark.parametrize("code", sorted(CATALOGUED))
    def test_every_catalogued_code_is_produced_somewhere(self, code: str) -> None:
        assert code in scan(), f"{code} is catalogued but nothing in monitord/ produces it"
