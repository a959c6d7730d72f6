"""The VPS's side of a copy: one area's data dir there and its staging dir.

Five operations (`VpsTree`): list the data dir (a download's first step), digest the blocks
of some of its files (so that a download fetches only what the PBX's own copy lacks), make
the staging dir empty (where an upload starts), list what a pre-copy put in the staging dir,
and check the staging dir against the expected listing and promote it (an upload's last
steps).
Two ways to do them, chosen once per copy by `chosen` from what the agent says it serves
(`CopyAgent.serves_copies`, the agent's `GET /v1/routes`), never by trying a route and
falling back:

- `AgentTree`: the agent's routes (`AreaCopy`), with no shell and no Python start on the
  VPS, inside the downtime or out of it (on a VPS whose login shell sources a slow rc
  file, one exec cost 80 ms here). When its promote finds the listing differs, the verb
  lists the staging dir so that the refusal names the differences.
- `ShellTree`: fixed shell scripts and the `tree-digest` verb (monitord.base.tree_digest),
  for an agent older than those routes (or none).

A pre-copy's choice travels with its `Staged` to the copy after the stop, so the agent is
asked once per move. A route that goes missing after all (AGENT_ROUTE_MISSING) fails the
copy like any other agent error; the next try asks again — but the blocks route, which only
saves bytes: without it (an agent of a release before it) a download fetches files whole.
Either way's listings are bounded and validated alike (monitord.remote.copy.listing), in a thread.

Called by monitord.remote.copy.transfer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import asyncssh

from monitord.base import tree_digest
from monitord.remote import remote_exec
from monitord.remote.agent_client import AgentClient
from monitord.remote.copy import listing
from orchestrator import block_delta
from orchestrator.block_delta import Blocks, ChangedGroups
from orchestrator.errors import ErrorCode, MonitordError

_SCRIPT_TIMEOUT_S = 60.0
# The agent's routes a copy through the agent needs (as `GET /v1/routes` names them).
# The staging and promote routes moved under `copy/` when the staging dir moved into the
# data dir's `.monitord-copy` dir (monitord.base.tree_digest): an agent that still serves the
# old paths keeps its staging dir beside the data dir, where SFTP no longer puts the files, so
# a PBX must not mix the two — with such an agent (or for an older PBX with a newer agent)
# the shell and the verb do every step, each path passed explicitly.
COPY_ROUTES = frozenset({
    "POST /v1/areas/{area}/listing",
    "POST /v1/areas/{area}/copy/staging",
    "POST /v1/areas/{area}/copy/promote",
})


class CopyAgent(Protocol):
    """The agent's answers about one area's data dir on the VPS and its staging dir
    (`AreaCopy`: AgentClient's routes bound to the area and its data dir)."""

    async def serves_copies(self) -> bool:
        """Whether the agent serves every route below; False from an older agent."""

    async def data_listing(self) -> bytes:
        """The data dir's own listing (tree-digest's output format, its cache kept)."""

    async def blocks(self, paths: list[str], known: dict[str, bytes] | None = None,
                     ) -> dict[str, Blocks | ChangedGroups | None]:
        """The block digests of each of `paths` in the data dir (None: no such regular
        file there, or too large to answer), at most tree_digest.MAX_BLOCK_PATHS; of a name
        in `known` (the PBX's group summaries of its copy: block_delta.group_digests) those
        of the groups that differ only — or all of them, from an agent before `known`."""

    async def reset(self) -> None:
        """The staging dir made empty, its digest cache gone."""

    async def staged_blocks(self) -> dict[str, Blocks | None] | None:
        """The block digests of every file in the staging dir (None: too large to answer
        for), or None when the VPS does not answer for them all."""

    async def listing(self) -> bytes:
        """The staging dir's listing, every file fsynced (tree-digest's output format)."""

    async def promote(self, expect: str) -> bool:
        """True once the staging dir, its listing's SHA-256 being `expect`, has replaced
        the data dir; False (nothing changed) when the listing differs."""


@dataclass(frozen=True, slots=True)
class AreaCopy:
    """One area's data dir on the VPS, and its staging dir, as the agent answers
    for them (`CopyAgent`). Built by the migration engine for each copy."""

    client: AgentClient
    area: str
    data_dir: str

    async def serves_copies(self) -> bool:
        return COPY_ROUTES <= await self.client.routes()

    async def data_listing(self) -> bytes:
        return await self.client.data_listing(area=self.area, data_dir=self.data_dir)

    async def blocks(self, paths: list[str], known: dict[str, bytes] | None = None,
                     ) -> dict[str, Blocks | ChangedGroups | None]:
        return await self.client.blocks(area=self.area, data_dir=self.data_dir, paths=paths,
                                        known=known)

    async def reset(self) -> None:
        await self.client.reset_staging(area=self.area, data_dir=self.data_dir)

    async def staged_blocks(self) -> dict[str, Blocks | None] | None:
        return await self.client.staged_blocks(area=self.area, data_dir=self.data_dir)

    async def listing(self) -> bytes:
        return await self.client.staging_listing(area=self.area, data_dir=self.data_dir)

    async def promote(self, expect: str) -> bool:
        return await self.client.promote(area=self.area, data_dir=self.data_dir, expect=expect)


class VpsTree(Protocol):
    """What a copy asks of the VPS about one area's data dir and its staging dir."""

    @property
    def through_agent(self) -> bool:
        """True: the agent's routes answer; False: the shell and the verb."""

    async def data_listing(self) -> dict[str, str]:
        """The data dir's listing, validated ({relative name: SHA-256})."""

    async def blocks(self, names: Sequence[str],
                     have: Mapping[str, Blocks] | None = None) -> dict[str, Blocks]:
        """The block digests of those of `names` (files of the data dir) the VPS can answer
        for; a name left out is fetched whole. `have`: the PBX's own copies of some of
        them, by their digests — the VPS need only send those of the groups that differ."""

    async def reset_staging(self) -> None:
        """The staging dir made empty, its digest cache gone."""

    async def staged(self) -> dict[str, Blocks | None] | None:
        """What a copy cut by the link left in the staging dir, to resume from: each file's
        block digests (None: it is sent whole). None when the way cannot say (the shell, an
        agent without it, an answer naming a file no area file could be): the caller starts
        the staging dir over instead."""

    async def staging_listing(self, *, during: str) -> dict[str, str]:
        """The staging dir's listing, every file fsynced there, validated."""

    async def promote(self, expected: dict[str, str]) -> dict[str, str] | None:
        """None once the staging dir, found to hold exactly `expected`, has replaced the
        data dir; else what it holds (and nothing changed)."""


async def chosen(
    conn: asyncssh.SSHClientConnection, *, remote_dir: str, vps_command: Sequence[str],
    agent: CopyAgent | None, through_agent: bool | None = None,
) -> VpsTree:
    """The way this copy takes: the agent's, if there is one and it serves the copy routes
    (`through_agent`: a pre-copy's answer to that question, not asked again)."""
    shell = ShellTree(conn=conn, remote_dir=remote_dir, vps_command=tuple(vps_command))
    if agent is None:
        return shell
    if through_agent is None:
        through_agent = await agent.serves_copies()
    return AgentTree(agent=agent, shell=shell) if through_agent else shell


# At most this much of a blocks question summarises the PBX's copies (the agent takes a
# body of 1 MiB): 16 bytes per 64 KiB, some 16 GiB of files; past it, every digest comes.
_MAX_SUMMARY_BYTES = 256 * 1024


def _summaries(names: Sequence[str], have: Mapping[str, Blocks]) -> dict[str, bytes]:
    """{name: the group summaries of the PBX's copy} for those of `names` it has, while
    they fit a question."""
    found: dict[str, bytes] = {}
    room = _MAX_SUMMARY_BYTES
    for rel in names:
        if rel in have:
            summary = block_delta.group_digests(have[rel])
            if len(summary) > room:
                continue
            room -= len(summary)
            found[rel] = summary
    return found


def staging_of(remote_dir: str) -> str:
    """The staging dir of a VPS data dir (monitord.base.tree_digest.staging_dir)."""
    return str(tree_digest.staging_dir(Path(remote_dir)))


def _dirs(remote_dir: str) -> tuple[str, str, str, str, str]:
    """(data dir, its cache, staging dir, its cache, old dir) of a VPS data dir, as the
    scripts below take them: every path a copy uses there comes from tree_digest's layout,
    none is derived in shell."""
    final = Path(remote_dir)
    return (str(final), str(tree_digest.data_cache(final)), str(tree_digest.staging_dir(final)),
            str(tree_digest.staging_cache(final)), str(tree_digest.old_dir(final)))


# Remote side: fixed scripts, values passed as positional parameters (never spliced); the
# digest scripts take their paths, then the argv that runs monitord.pyz on the VPS.
_PREPARE = 'rm -rf -- "$1" "$2" && mkdir -p -- "$1"'  # staging dir, its cache
# (the cache's dir is made first: an older monitord.pyz's verb does not make it)
_VERIFY = ('d=$1; c=$2; shift 2; mkdir -p -- "$(dirname -- "$c")" &&'
           ' "$@" tree-digest --dir "$d" --cache "$c" --sync')
_PROMOTE_STEPS = (  # (an empty area's staging dir may never have been made: it is empty)
    ' mkdir -p -- "$stg" "$(dirname -- "$dst")" "$(dirname -- "$old")";'
    ' if [ -e "$dst" ]; then rm -rf -- "$old"; mv -- "$dst" "$old"; fi;'
    ' mv -- "$stg" "$dst"; rm -rf -- "$old" "$dstc";'
    ' if [ -e "$stgc" ]; then mv -- "$stgc" "$dstc"; fi;'
    ' sync -- "$dst" "$(dirname -- "$dst")"'
)
_PROMOTE_ARGS = 'dst=$1; dstc=$2; stg=$3; stgc=$4; old=$5;'
_PROMOTE = 'set -e; ' + _PROMOTE_ARGS + _PROMOTE_STEPS
# The check and the swap in one exec (one round trip while the area is down): the swap runs
# only if the staging dir's listing is byte for byte the expected one, whose SHA-256 the PBX
# passes; otherwise tree-digest exits EXIT_DIFFERS, having printed what it found.
_VERIFY_PROMOTE = (
    'set -e; ' + _PROMOTE_ARGS + ' want=$6; shift 6; mkdir -p -- "$(dirname -- "$stgc")";'
    ' "$@" tree-digest --dir "$stg" --cache "$stgc" --sync --expect "$want";'
    + _PROMOTE_STEPS
)
_LIST = ('d=$1; c=$2; shift 2; if [ -d "$d" ]; then mkdir -p -- "$(dirname -- "$c")"; fi;'
         ' "$@" tree-digest --dir "$d" --cache "$c"')
_REMOVE = 'rm -rf -- "$1" "$2"'  # staging dir, its cache


@dataclass(frozen=True, slots=True)
class ShellTree:
    """The VPS's dirs through a shell: fixed scripts and the tree-digest verb."""

    conn: asyncssh.SSHClientConnection
    remote_dir: str
    vps_command: tuple[str, ...]  # runs monitord.pyz on the VPS
    through_agent: bool = False

    @property
    def staging(self) -> str:
        return staging_of(self.remote_dir)

    async def data_listing(self) -> dict[str, str]:
        final, cache, *_ = _dirs(self.remote_dir)
        return await self._digest(_LIST, final, cache,
                                  during=f"the VPS's file listing of {self.remote_dir}")

    async def blocks(self, names: Sequence[str],
                     have: Mapping[str, Blocks] | None = None) -> dict[str, Blocks]:
        return {}  # (the verb digests whole files only: these are fetched whole)

    async def staged(self) -> dict[str, Blocks | None] | None:
        return None  # (nor does it digest the staging dir's blocks: it starts over)

    async def reset_staging(self) -> None:
        _, _, staging, cache, _ = _dirs(self.remote_dir)
        await _script(self.conn, _PREPARE, staging, cache)

    async def staging_listing(self, *, during: str) -> dict[str, str]:
        _, _, staging, cache, _ = _dirs(self.remote_dir)
        return await self._digest(_VERIFY, staging, cache, during=during)

    async def promote(self, expected: dict[str, str]) -> dict[str, str] | None:
        """The verb lists what the staging dir holds and promotes it if that is the
        expected listing, in one exec; when the same files are listed in other bytes (a VPS
        whose name order differs), a second exec swaps it in."""
        during = f"upload to {self.remote_dir}"
        result = await remote_exec.run_script(
            self.conn, _VERIFY_PROMOTE,
            args=(*_dirs(self.remote_dir), _sha256_of(expected), *self.vps_command),
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
        promoted = await _script(self.conn, _PROMOTE, *_dirs(self.remote_dir))
        promoted.raise_for_status(ErrorCode.COPY_INCOMPLETE)
        return None

    async def _digest(self, script: str, tree: str, cache: str, *,
                      during: str) -> dict[str, str]:
        result = await remote_exec.run_script(
            self.conn, script, args=(tree, cache, *self.vps_command),
            timeout_s=_SCRIPT_TIMEOUT_S,
            max_stdout=listing.MAX_BYTES,
        )
        if result.stdout_truncated:
            raise listing.incomplete(f"refusing {during}: more than {listing.MAX_BYTES} bytes")
        result.raise_for_status(ErrorCode.COPY_INCOMPLETE)
        return await listing.parse_off_loop(result.stdout)


@dataclass(frozen=True, slots=True)
class AgentTree:
    """The VPS's dirs through the agent's routes; only a promote the agent refuses (the
    listing differs) goes on to the verb, which names the differences."""

    agent: CopyAgent
    shell: ShellTree
    through_agent: bool = True

    async def data_listing(self) -> dict[str, str]:
        return await _bounded(await self.agent.data_listing(),
                              during=f"the VPS's file listing of {self.shell.remote_dir}")

    async def blocks(self, names: Sequence[str],
                     have: Mapping[str, Blocks] | None = None) -> dict[str, Blocks]:
        found: dict[str, Blocks] = {}
        have = have or {}
        known = _summaries(names, have)
        step = tree_digest.MAX_BLOCK_PATHS
        for start in range(0, len(names), step):
            asked = list(names[start:start + step])
            try:
                answered = await self.agent.blocks(
                    asked, {rel: known[rel] for rel in asked if rel in known} or None)
            except MonitordError as e:
                if e.code == ErrorCode.AGENT_ROUTE_MISSING:
                    return found  # an older agent: the rest is fetched whole
                raise
            for rel, answer in answered.items():
                if isinstance(answer, ChangedGroups):
                    # (an answer no question could have had is no start: fetched whole)
                    rebuilt = block_delta.with_changes(have[rel], answer) if rel in have else None
                    if rebuilt is not None:
                        found[rel] = rebuilt
                elif answer is not None:
                    found[rel] = answer
        return found

    async def reset_staging(self) -> None:
        await self.agent.reset()

    async def staged(self) -> dict[str, Blocks | None] | None:
        try:
            found = await self.agent.staged_blocks()
        except MonitordError as e:
            if e.code in (ErrorCode.AGENT_ROUTE_MISSING, ErrorCode.BAD_REQUEST):
                return None  # an older agent: the copy starts the staging dir over
            raise
        if found is not None and any(listing.name_problem(rel) for rel in found):
            return None  # not names of an area's files: nothing of it is used
        return found

    async def staging_listing(self, *, during: str) -> dict[str, str]:
        return await _bounded(await self.agent.listing(), during=during)

    async def promote(self, expected: dict[str, str]) -> dict[str, str] | None:
        if await self.agent.promote(_sha256_of(expected)):
            return None
        return await self.shell.promote(expected)


async def remove_leftovers(conn: asyncssh.SSHClientConnection, *, remote_dir: str) -> None:
    """Remove a staging dir (and its digest cache) a cut copy left on the VPS."""
    _, _, staging, cache, _ = _dirs(remote_dir)
    await _script(conn, _REMOVE, staging, cache)


async def _bounded(raw: bytes, *, during: str) -> dict[str, str]:
    """The agent's listing, held to the bound and the rules the verb's output is held to."""
    if len(raw) > listing.MAX_BYTES:
        raise listing.incomplete(f"refusing {during}: more than {listing.MAX_BYTES} bytes")
    return await listing.parse_off_loop(raw)


def _sha256_of(expected: dict[str, str]) -> str:
    return hashlib.sha256(tree_digest.listing(expected)).hexdigest()


async def _script(
    conn: asyncssh.SSHClientConnection, script: str, *args: str
) -> remote_exec.CommandResult:
    return await remote_exec.run_script(conn, script, args=args, timeout_s=_SCRIPT_TIMEOUT_S)
