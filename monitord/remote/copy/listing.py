"""The VPS's listing of a tree, read as untrusted input: parsed and validated whole.

A listing is what `monitord.pyz tree-digest` prints on the VPS (or the agent answers in its
place, monitord.remote.copy.vps_tree): `sha256sum`'s format, one `<64 hex>  ./<name>` line
per regular file. The VPS may be compromised, so nothing in it is trusted: every line must
be `<64 hex>  <name>` (or sha256sum's escaped form, a leading backslash with `\\` and `\n`
in the name), every name relative and normalised (`name_problem`), listed once, never both
a file and a directory; the whole listing is bounded in bytes and entries, and each name
in bytes per component, bytes per path and components. One bad line refuses the whole
listing (COPY_INCOMPLETE) before anything is written. Upload's names obey the same rule, so
that whatever goes to the VPS can come back.

Parsing costs time and memory linear in the listing's size whatever its names look like
(a name is never split into its parent directories: the file-and-directory check sorts
the names once), and callers run it in a thread (`parse_off_loop`): a listing may be
64 MiB, and the event loop keeps every tunnel and lease alive meanwhile.

Called by monitord.remote.copy.vps_tree (the VPS's answers) and .transfer (local names).
"""

from __future__ import annotations

import asyncio
import re

from monitord.base import tree_digest
from orchestrator.errors import ErrorCode, MonitordError, error_for

# Bounds on a VPS listing. An area's data dir (one messenger account's session, keys,
# database and media cache) holds hundreds to a few tens of thousands of files; 200,000
# entries leaves an order of magnitude of room while bounding the PBX's work per copy. The
# byte bound caps memory before parsing: 64 MiB is ~330 bytes per line at the entry bound
# (a line is 64 hex + 2 spaces + "./" + a name, usually well under 200 bytes).
MAX_ENTRIES = 200_000
MAX_BYTES = tree_digest.MAX_LISTING_BYTES
# Bounds on one name, in UTF-8 bytes: Linux's NAME_MAX for a component and PATH_MAX for the
# whole relative path (neither side could create a longer one), and at most 128 components —
# a messenger's data dir nests a handful deep (a browser profile's cache storage about ten),
# and every level costs a directory fd when a file is written (local_tree.create_inside).
MAX_COMPONENT_BYTES = 255
MAX_PATH_BYTES = 4096
MAX_DEPTH = 128
_LINE = re.compile(rb"(\\?)([0-9a-f]{64})  (.+)", re.DOTALL)


def incomplete(detail: str) -> MonitordError:
    """COPY_INCOMPLETE: the copy is refused or failed; the source keeps its data."""
    return error_for(ErrorCode.COPY_INCOMPLETE, detail)


def name_problem(rel: str) -> str | None:
    """Why `rel` cannot be an area file's path (relative to the area dir), or None.

    Accepted: relative, POSIX separators, normalised (no empty, `.` or `..` component), no
    NUL, no carriage return (coreutils 9 and older disagree on how sha256sum writes and
    reads one), representable in UTF-8, within MAX_COMPONENT_BYTES, MAX_PATH_BYTES and
    MAX_DEPTH. The same rule holds for both directions. Linear in the name's length."""
    if not rel:
        return "an empty name"
    if rel.startswith("/"):
        return "an absolute path"
    if "\0" in rel:
        return "a NUL byte in the name"
    if "\r" in rel:
        return "a carriage return in the name"
    try:
        encoded = rel.encode("utf-8")
    except UnicodeEncodeError:
        return "a name that is not valid UTF-8"
    if len(encoded) > MAX_PATH_BYTES:
        return f"a name of {len(encoded)} bytes, more than {MAX_PATH_BYTES}"
    parts = encoded.split(b"/")
    if len(parts) > MAX_DEPTH:
        return f"a name of {len(parts)} components, more than {MAX_DEPTH}"
    for part in parts:
        if part in (b"", b".", b".."):
            return f"a {part.decode()!r} component" if part else "an empty component"
        if len(part) > MAX_COMPONENT_BYTES:
            return f"a component of {len(part)} bytes, more than {MAX_COMPONENT_BYTES}"
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
    both = _file_and_directory(result)
    if both is not None:
        return _bad_listing(f"{both!r} is listed both as a file and as a directory")
    return result


async def parse_off_loop(raw: bytes) -> dict[str, str]:
    """`parse`, in a thread: the event loop goes on meanwhile."""
    return await asyncio.to_thread(parse, raw)


def _file_and_directory(names: dict[str, str]) -> str | None:
    """A name that another name lies under, if any. With "/" mapped below every other
    character (names hold no NUL), sorting puts every name directly before the names that
    lie under it — anything sorting between "a" and "a/b" starts with "a/" too — so one
    look at each name's successor suffices: O(total length), after one sort of the names,
    and no parent directory is ever built as a string of its own."""
    keys = sorted(name.replace("/", "\0") for name in names)
    for name, following in zip(keys, keys[1:], strict=False):
        if following.startswith(name) and following[len(name)] == "\0":
            return name.replace("\0", "/")
    return None


def differences(found: dict[str, str], expected: dict[str, str]) -> list[str]:
    """Up to five names that are missing, extra or different between two listings."""
    names = set(found) ^ set(expected) | {p for p in found if found[p] != expected.get(p)}
    return sorted(names)[:5]


def _unescape(name: str) -> str | None:
    """sha256sum's escaped name (`\\\\` for a backslash, `\\n` for a newline) unescaped, or
    None for any other escape. The first `\\\\` always begins an escape (a backslash before it
    would begin an earlier one), so splitting at each finds every backslash escape; what is
    left between them may only hold `\\n`. String methods only: no loop per character."""
    pieces = name.split("\\\\")
    for i, piece in enumerate(pieces):
        pieces[i] = piece = piece.replace("\\n", "\n")
        if "\\" in piece:
            return None
    return "\\".join(pieces)


def _shown(line: bytes) -> str:
    return repr(line[:120])[2:-1] + ("…" if len(line) > 120 else "")


def _bad_listing(why: str) -> dict[str, str]:
    raise incomplete(f"refusing the VPS's file listing: {why}")
