"""Every "called by" line in the code names its callers, and each of them really is one.

A module's docstring (or a comment) that says who calls it is how a reader finds the way
in; a stale one sends them to a module that no longer has anything to do with it. So each
such sentence must name at least one module (dotted, or as a path), and each module it
names must import the module, or be imported by it (a callback handed in), as the source
says today.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("monitord", "orchestrator")
# From "called by" to the end of its sentence (a full stop before a space, a line end or the
# docstring's end), across line breaks.
_SENTENCE = re.compile(r"called by(.*?)(?:\.(?:\s|$)|\"\"\"|$)", re.IGNORECASE | re.DOTALL)
_REFERENCE = re.compile(r"\b(?:monitord|orchestrator|tests)(?:[./][A-Za-z_][A-Za-z0-9_]*)+")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    found = {}
    for base in (*SOURCES, "tests"):
        for path in (ROOT / base).rglob("*.py"):
            found[_module_name(path)] = path
    return found


@cache
def _imports(module: str) -> frozenset[str]:
    path = _modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and node.value in _modules():
            names.add(node.value)  # imported by name (the CLI's table of lazy verbs)
    return frozenset(names)


def _as_module(reference: str) -> str | None:
    """The module a reference names: the longest prefix of it that is one."""
    parts = reference.removesuffix(".py").replace("/", ".").split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in _modules():
            return name
    return None


def _sentences() -> list[tuple[str, str]]:
    found = []
    for base in SOURCES:
        for path in sorted((ROOT / base).rglob("*.py")):
            for match in _SENTENCE.finditer(path.read_text()):
                found.append((_module_name(path), " ".join(match.group(1).split())))
    return found


def _linked(module: str, caller: str) -> bool:
    return module in _imports(caller) or caller in _imports(module)


@pytest.mark.parametrize(("module", "sentence"), _sentences(),
                         ids=lambda value: value[:60])
def test_a_called_by_line_names_callers_that_are_callers(module: str, sentence: str) -> None:
    references = _REFERENCE.findall(sentence)
    assert references, f"{module}: 'called by{sentence}' names no module"
    for reference in references:
        caller = _as_module(reference)
        assert caller is not None, f"{module}: {reference!r} is not a module"
        assert _linked(module, caller), (
            f"{module}: says it is called by {caller}, which neither imports it nor is"
            " imported by it"
        )


def test_the_check_finds_a_stale_line() -> None:
    assert _linked("orchestrator.planner", "monitord.engine.reconciler")
    assert not _linked("orchestrator.planner", "monitord.remote.preflight")
    assert _as_module("monitord/engine/reconciler.py") == "monitord.engine.reconciler"
    assert _sentences(), "the lines themselves are found"
