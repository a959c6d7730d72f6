"""The VPS's listing of a tree, read as untrusted input: parsed and validated whole.

A listing is what `monitord.pyz tree-digest` prints on the VPS (or the agent answers in its
place, monitord.remote.copy.vps_tree): `sha256sum`'s format, one `<64 hex>  ./<name>` line
per regular file. The VPS may be compromised, so nothing in it is trusted: every line must
be `<64 hex>  <name>` (or sha256sum's escaped form, a leading backslash with `\\` and `\n`
in the name), every name relative and normalised (`name_problem`), listed once, never both
a file and a directory; the whole listing is bounded in bytes and entries. One bad line
refuses the whole listing (COPY_INCOMPLETE) before anything is written. Upload's names obey
the same rule, so that whatever goes to the VPS can come back.

Called by monitord.remote.copy.vps_tree (the VPS's answers) and .transfer (local names).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from monitord.base import tree_digest
from orchestrator.errors import ErrorCode, MonitordError, error_for

# Bounds on a VPS listing. An area's data dir (one messenger account's session, keys,
# database and media cache) holds hundreds to a few tens of thousands of files; 200,000
# entries leaves an order of magnitude of room while bounding the PBX's work per copy. The
# byte bound caps memory before parsing: 64 MiB is ~330 bytes per line at the entry bound
# (a line is 64 hex + 2 spaces + "./" + a name, usually well under 200 bytes).
MAX_ENTRIES = 200_000
MAX_BYTES = tree_digest.MAX_LISTING_BYTES
_LINE = re.compile(rb"(\\?)([0-9a-f]{64})  (.+)", re.DOTALL)
_UNESCAPE = {ord("\\"): "\\", ord("n"): "\n"}


def incomplete(detail: str) -> MonitordError:
    """COPY_INCOMPLETE: the copy is refused or failed; the source keeps its data."""
    return error_for(ErrorCode.COPY_INCOMPLETE, detail)


def name_problem(rel: str) -> str | None:
    """Why `rel` cannot be an area file's path (relative to the area dir), or None.

    Accepted: relative, POSIX separators, normalised (no empty, `.` or `..` component), no
    NUL, no carriage return (coreutils 9 and older disagree on how sha256sum writes and
    reads one), representable in UTF-8. The same rule holds for both directions."""
    if not rel:
        return "an empty name"
    if rel.startswith("/"):
        return "an absolute path"
    if "\0" in rel:
        return "a NUL byte in the name"
    if "\r" in rel:
        return "a carriage return in the name"
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            return f"a {part!r} component" if part else "an empty component"
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return "a name that is not valid UTF-8"
    return None


def parse(raw: bytes) -> dict[str, str]:
    """A VPS `sha256sum` listing as {relative name: digest}, or COPY_INCOMPLETE naming the
    first bad entry. Nothing is trusted: see the module docstring for what is accepted."""
    if not raw:
        return {}
    lines = raw.split(b"\n")
    if lines[-1] != b"":
        return _bad_listing(f"its last line is cut short: {_shown(lines[-1])}")
    lines.pop()
    if len(lines) > MAX_ENTRIES:
        return _bad_listing(f"it has {len(lines)} entries, more than {MAX_ENTRIES}")
    result: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        match = _LINE.fullmatch(line)
        if match is None:
            return _bad_listing(f"line {number} is not '<64 hex>  <name>': {_shown(line)}")
        escaped, digest, raw_name = match.groups()
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            return _bad_listing(f"line {number} has a name that is not UTF-8: {_shown(line)}")
        if escaped:
            unescaped = _unescape(name)
            if unescaped is None:
                return _bad_listing(f"line {number} has a bad escape: {_shown(line)}")
            name = unescaped
        rel = name.removeprefix("./")
        problem = name_problem(rel)
        if problem is not None:
            return _bad_listing(f"line {number} names {rel!r}: {problem}")
        if rel in result:
            return _bad_listing(f"line {number} lists {rel!r} a second time")
        result[rel] = digest.decode()
    dirs = {str(parent) for rel in result for parent in PurePosixPath(rel).parents}
    for rel in sorted(result):
        if rel in dirs:
            return _bad_listing(f"{rel!r} is listed both as a file and as a directory")
    return result


def differences(found: dict[str, str], expected: dict[str, str]) -> list[str]:
    """Up to five names that are missing, extra or different between two listings."""
    names = set(found) ^ set(expected) | {p for p in found if found[p] != expected.get(p)}
    return sorted(names)[:5]


def _unescape(name: str) -> str | None:
    out: list[str] = []
    chars = iter(name)
    for char in chars:
        if char == "\\":
            following = _UNESCAPE.get(ord(next(chars, "x")))
            if following is None:
                return None
            out.append(following)
        else:
            out.append(char)
    return "".join(out)


def _shown(line: bytes) -> str:
    return repr(line[:120])[2:-1] + ("…" if len(line) > 120 else "")


def _bad_listing(why: str) -> dict[str, str]:
    raise incomplete(f"refusing the VPS's file listing: {why}")
