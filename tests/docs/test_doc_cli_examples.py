"""Every `monitord ...` command the docs show parses with the real command line parser
(monitord.surface.cli.build_parser): a renamed verb or option fails here, not in the hands of
whoever copies the example.

What counts as an example, in README.md and docs/*.md:

- each line of a fenced code block that starts with `monitord ` (after an optional `$ `
  prompt; `\\` continuations joined; a trailing `# comment`, `&&`, `|`, `>` cut off): it must
  parse as it stands;
- each inline code span that starts with `monitord ` and names an option or argument: it
  must parse as well, unless it is a synopsis (`[--area UUID]`, `local|remote`, `{a,b}`,
  `…`), of which only the verb must exist;
- an inline span of only `monitord VERB` names a verb, which must exist.

Placeholders such as FILE, SERVICE or UUID are plain words to the parser, so they parse.
"""

from __future__ import annotations

import argparse
import functools
import re
import shlex
from pathlib import Path

import pytest

from monitord.surface import cli

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`]+)`")
SYNOPSIS = re.compile(r"[\[\]{}|…]|\.\.\.")
VERB_WORD = re.compile(r"^[a-z][a-z-]*$")


def fenced_commands(text: str) -> list[str]:
    commands = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"^\$\s+", "", line.strip())
            if line.startswith("monitord "):
                commands.append(line)
    return commands


def inline_commands(text: str) -> list[str]:
    prose = FENCE.sub("", text)
    spans = (" ".join(span.split()) for span in SPAN.findall(prose))
    return [span for span in spans if span.startswith("monitord ")]


def examples() -> list[tuple[str, str, bool]]:
    """(doc, command, must fully parse)."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        name = str(doc.relative_to(REPO))
        found += [(name, cmd, True) for cmd in fenced_commands(text)]
        for cmd in inline_commands(text):
            words = cmd.split()
            if not VERB_WORD.match(words[1]):
                continue  # "monitord 0.2.0", a version line
            found.append((name, cmd, len(words) > 2 and not SYNOPSIS.search(cmd)))
    return found


def cut(command: str) -> str:
    """The command alone: no comment, no second command, no pipe or redirection."""
    for stop in (" #", " &&", " ||", " |", " >", " 2>", ";"):
        command = command.split(stop)[0]
    return command.strip()


@functools.cache
def parser_for(verb: str | None) -> argparse.ArgumentParser:
    return cli.build_parser(only=verb)


def parse(words: list[str]) -> None:
    parser = parser_for(words[0] if words and words[0] in cli.VERBS else None)
    try:
        parser.parse_args(words)
    except SystemExit as e:  # argparse reports bad usage by exiting 2 (--help exits 0)
        if e.code:
            raise AssertionError(f"does not parse: monitord {shlex.join(words)}") from None


EXAMPLES = examples()


def test_the_docs_have_examples_of_every_kind() -> None:
    full = [cmd for _, cmd, strict in EXAMPLES if strict]
    assert len(full) >= 30, full
    assert any(doc == "docs/install.md" for doc, _, _ in EXAMPLES)


@pytest.mark.parametrize(("doc", "command", "strict"), EXAMPLES,
                         ids=[f"{doc}:{cmd}" for doc, cmd, _ in EXAMPLES])
def test_each_cli_example_parses(doc: str, command: str, strict: bool) -> None:
    words = shlex.split(cut(command))[1:]
    assert words[0].startswith("-") or words[0] in cli.VERBS, f"{doc}: no verb {words[0]!r}"
    if strict:
        parse(words)


def test_a_wrong_example_is_caught() -> None:
    """The check itself: a stale option and a missing argument fail."""
    with pytest.raises(AssertionError):
        parse(shlex.split("status -c FILE --no-such-option"))
    with pytest.raises(AssertionError):
        parse(shlex.split("place -c FILE tg"))
