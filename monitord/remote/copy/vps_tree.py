"""The VPS's side of a copy: one area's data dir there and the staging dir beside it.

Four operations: list the data dir (a download's first step), make the staging dir empty
(where an upload starts), list what a pre-copy put in the staging dir, and check the
staging dir against the expected listing and promote it (an upload's last steps). The agent
answers each (`CopyAgent`, given by the caller) with no shell and no Python start on the
VPS, inside the downtime or out of it (on a VPS whose login shell sources a slow rc file,
one exec cost 80 ms here). An agent without these routes (an older one) answers
UNKNOWN_AREA, and a fixed shell script and the `tree-digest` verb (monitord.base.tree_digest)
do it instead; when the listings differ, the verb's listing names the differences. Either
answer is bounded and validated alike (monitord.remote.copy.listing).

Called by monitord.remote.copy.transfer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

import asyncssh

from monitord.base import tree_digest
from monitord.remote import remote_exec
from monitord.remote.copy import listing
from orchestrator.errors import ErrorCode, MonitordError

_SCRIPT_TIMEOUT_S = 60.0


class CopyAgent(Protocol):
    """The agent's answers about one area's data dir on the VPS and the staging dir beside
    it (AgentClient's routes, bound to the area and its data dir by the caller: AreaCopy).
    Each raises UNKNOWN_AREA from an agent without the route."""

    async def data_listing(self) -> bytes:
        """The data dir's own listing (tree-digest's output format, its cache kept)."""

    async def reset(self) -> None:
        """The staging dir made empty, its digest cache gone."""

    async def listing(self) -> bytes:
        """The staging dir's listing, every file fsynced (tree-digest's output format)."""

    async def promote(self, expect: str) -> bool:
        """True once the staging dir, its listing's SHA-256 being `expect`, has replaced
        the data dir; False (nothing changed) when the listing differs."""


# Remote side: fixed scripts, values passed as positional parameters (never spliced); the
# digest scripts take the dir, then the argv that runs monitord.pyz on the VPS.
_PREPARE = 'rm -rf -- "$1" "$1.digests" && mkdir -p -- "$1"'
_VERIFY = 'd=$1; shift; "$@" tree-digest --dir "$d" --cache "$d.digests" --sync'
_PROMOTE_STEPS = (  # (an empty area's staging dir may never have been made: it is empty)
    ' mkdir -p -- "$stg" "$(dirname -- "$dst")";'
    ' if [ -e "$dst" ]; then rm -rf -- "$dst.old"; mv -- "$dst" "$dst.old"; fi;'
    ' mv -- "$stg" "$dst"; rm -rf -- "$dst.old" "$dst.digests";'
    ' if [ -e "$stg.digests" ]; then mv -- "$stg.digests" "$dst.digests"; fi;'
    ' sync -- "$dst" "$(dirname -- "$dst")"'
)
_PROMOTE = 'set -e; dst=$1; stg=$2;' + _PROMOTE_STEPS
# The check and the swap in one exec (one round trip while the area is down): the swap runs
# only if the staging dir's listing is byte for byte the expected one, whose SHA-256 the PBX
# passes; otherwise tree-digest exits EXIT_DIFFERS, having printed what it found.
_VERIFY_PROMOTE = (
    'set -e; dst=$1; stg=$2; want=$3; shift 3;'
    ' "$@" tree-digest --dir "$stg" --cache "$stg.digests" --sync --expect "$want";'
    + _PROMOTE_STEPS
)
_LIST = 'd=$1; shift; "$@" tree-digest --dir "$d" --cache "$d.digests"'
_REMOVE = 'rm -rf -- "$1" "$1.digests"'


def staging_of(remote_dir: str) -> str:
    """The staging dir beside a VPS data dir."""
    return remote_dir.rstrip("/") + tree_digest.STAGING_SUFFIX


async def data_listing(
    conn: asyncssh.SSHClientConnection, remote_dir: str, vps_command: Sequence[str],
    agent: CopyAgent | None,
) -> dict[str, str]:
    return await _vps_listing(conn, _LIST, remote_dir, vps_command,
                              ask=None if agent is None else agent.data_listing,
                              during=f"the VPS's file listing of {remote_dir}")


async def staging_listing(
    conn: asyncssh.SSHClientConnection, staging: str, vps_command: Sequence[str],
    agent: CopyAgent | None, *, during: str,
) -> dict[str, str]:
    return await _vps_listing(conn, _VERIFY, staging, vps_command,
                              ask=None if agent is None else agent.listing, during=during)


async def _vps_listing(
    conn: asyncssh.SSHClientConnection, script: str, tree: str, vps_command: Sequence[str],
    *, ask: Callable[[], Awaitable[bytes]] | None, during: str,
) -> dict[str, str]:
    """A VPS tree's digest: the agent's answer to `ask`, else (no agent, or one without the
    route) the verb's through `script`; either bounded and validated exactly alike."""
    listed = None if ask is None else await _agent_answer(ask)
    if listed is None:
        return await _digest(conn, script, tree, vps_command, during=during)
    if len(listed) > listing.MAX_BYTES:
        raise listing.incomplete(f"refusing {during}: more than {listing.MAX_BYTES} bytes")
    return await listing.parse_off_loop(listed)


async def _digest(
    conn: asyncssh.SSHClientConnection, script: str, remote_dir: str,
    vps_command: Sequence[str], *, during: str,
) -> dict[str, str]:
    """A VPS tree's digest ({relative name: SHA-256}), validated whole (listing.parse)."""
    result = await remote_exec.run_script(
        conn, script, args=(remote_dir, *vps_command), timeout_s=_SCRIPT_TIMEOUT_S,
        max_stdout=listing.MAX_BYTES,
    )
    if result.stdout_truncated:
        raise listing.incomplete(f"refusing {during}: more than {listing.MAX_BYTES} bytes")
    result.raise_for_status(ErrorCode.COPY_INCOMPLETE)
    return await listing.parse_off_loop(result.stdout)


async def verify_and_promote(
    conn: asyncssh.SSHClientConnection, *, remote_dir: str, staging: str,
    expected: dict[str, str], vps_command: Sequence[str], agent: CopyAgent | None = None,
) -> dict[str, str] | None:
    """Steps 3 and 4 of an upload, on the VPS: None once the staging dir, found to hold
    exactly `expected`, has replaced remote_dir; else what it holds (and nothing changed)."""
    during = f"upload to {remote_dir}"
    want = hashlib.sha256(tree_digest.listing(expected)).hexdigest()
    if agent is not None and await _agent_answer(lambda: agent.promote(want)):
        return None
    # Differs (or no such route): the verb lists what the staging dir holds, and promotes
    # it after all if that is what was expected.
    result = await remote_exec.run_script(
        conn, _VERIFY_PROMOTE, args=(remote_dir, staging, want, *vps_command),
        timeout_s=_SCRIPT_TIMEOUT_S, max_stdout=listing.MAX_BYTES,
    )
    if result.stdout_truncated:
        raise listing.incomplete(f"refusing {during}: more than {listing.MAX_BYTES} bytes")
    if result.exit_status != tree_digest.EXIT_DIFFERS:
        result.raise_for_status(ErrorCode.COPY_INCOMPLETE)
        return None
    found = await listing.parse_off_loop(result.stdout)
    if found != expected:
        return found
    # The same files, listed in other bytes (a VPS whose name order differs): swap it apart.
    promoted = await _script(conn, _PROMOTE, remote_dir, staging)
    promoted.raise_for_status(ErrorCode.COPY_INCOMPLETE)
    return None


async def remove_leftovers(conn: asyncssh.SSHClientConnection, *, remote_dir: str) -> None:
    """Remove a staging dir (and its manifest) a cut copy left on the VPS."""
    await _script(conn, _REMOVE, staging_of(remote_dir))


T = TypeVar("T")


async def _agent_answer(ask: Callable[[], Awaitable[T]]) -> T | None:
    """`ask()`'s answer; None from an agent without the route (UNKNOWN_AREA: an older one),
    which the caller then does over a shell instead."""
    try:
        return await ask()
    except MonitordError as e:
        if e.code != ErrorCode.UNKNOWN_AREA:
            raise
        return None


async def reset_staging(
    conn: asyncssh.SSHClientConnection, staging: str, agent: CopyAgent | None
) -> None:
    async def reset() -> bool:
        assert agent is not None
        await agent.reset()
        return True

    if agent is None or not await _agent_answer(reset):
        await _script(conn, _PREPARE, staging)


async def _script(
    conn: asyncssh.SSHClientConnection, script: str, *args: str
) -> remote_exec.CommandResult:
    return await remote_exec.run_script(conn, script, args=args, timeout_s=_SCRIPT_TIMEOUT_S)
