"""Which bytes of a file the copy after the stop sends, given what the pre-copy staged.

A live account's store is never still: an SQLite database changes a few 4 KiB pages a
second, so the file the pre-copy sent has changed by the stop, and sending it again whole
made a 24 MiB store's downtime as long as a copy without any pre-copy. The pre-copy knows
exactly what it put in the staging dir (it read and sent those bytes), so it keeps a digest
of every `BLOCK_BYTES` block of it (`Blocks`, from `blocks_of`); after the stop the PBX
digests the stopped file the same way, locally, and `plan` says which runs of blocks
differ — only those cross the link, written in place into the staged file, which is then
cut to the new size. An append is a run at the end; a file that shrank is a cut.

Nothing is trusted to these digests alone: the receiver still digests the whole staging
dir with SHA-256 and promotes it only if every file matches the stopped source's manifest
(monitord/remote/copy/transfer.py), so a wrong plan costs a full copy, never a wrong file.

Pure: the digests are computed from bytes handed in; reading files is the caller's. It is
one of the modules the VPS runs too (monitord/remote/artifact.py: the agent digests a VPS
file's blocks for a copy home), so it is held to Python 3.9: no dataclass slots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_BYTES = 4096  # SQLite's default page, and the page size of the machines here
DIGEST_BYTES = 16  # BLAKE2b-128 per block: a collision only costs a failed promote
MAX_RUN_BYTES = 1 << 20  # one write at most: runs longer than this are split


@dataclass(frozen=True)
class Blocks:
    """A file's content as block digests: `size` bytes, `digests` DIGEST_BYTES per block
    of BLOCK_BYTES in order (the last block may be shorter)."""

    size: int
    digests: bytes

    def __post_init__(self) -> None:
        if len(self.digests) != block_count(self.size) * DIGEST_BYTES:
            raise ValueError(f"{len(self.digests)} digest bytes for a file of {self.size}")

    def digest(self, index: int) -> bytes:
        return self.digests[index * DIGEST_BYTES:(index + 1) * DIGEST_BYTES]

    def run(self, offset: int, length: int) -> bytes:
        """The digests of the blocks of bytes offset .. offset + length (offset at a block)."""
        first = offset // BLOCK_BYTES
        return self.digests[first * DIGEST_BYTES:(first + block_count(length)) * DIGEST_BYTES]


def block_count(size: int) -> int:
    return -(-size // BLOCK_BYTES)


# Blocks one group summary stands for (64 KiB): what a side that already holds most of a
# file sends to ask for the digests of the groups that differ only (`changed_groups`).
GROUP_BLOCKS = 16


def group_count(size: int) -> int:
    return -(-block_count(size) // GROUP_BLOCKS)


def group_digests(blocks: Blocks) -> bytes:
    """One DIGEST_BYTES summary per GROUP_BLOCKS blocks of `blocks`, in order (the last
    group may be shorter): the BLAKE2b-128 of the group's block digests."""
    step = GROUP_BLOCKS * DIGEST_BYTES
    return b"".join(hashlib.blake2b(blocks.digests[i:i + step], digest_size=DIGEST_BYTES)
                    .digest() for i in range(0, len(blocks.digests), step))


@dataclass(frozen=True)
class ChangedGroups:
    """A file's block digests sent for the groups that differ from what the asker holds
    only: `groups` (ascending indices), their blocks' digests in order in `digests`."""

    size: int
    groups: tuple[int, ...]
    digests: bytes


def changed_groups(now: Blocks, known: bytes) -> ChangedGroups:
    """`now` as an answer to one who holds a copy summarised by `known` (its
    `group_digests`): the groups whose summary differs — every group past the known ones,
    and one whose block count differs, since its summary does."""
    mine = group_digests(now)
    groups = tuple(i for i in range(group_count(now.size))
                   if mine[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]
                   != known[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES])
    step = GROUP_BLOCKS * DIGEST_BYTES
    return ChangedGroups(size=now.size, groups=groups,
                         digests=b"".join(now.digests[g * step:(g + 1) * step] for g in groups))


def with_changes(have: Blocks, answer: ChangedGroups) -> Blocks | None:
    """The answered file's block digests, those of its unchanged groups taken from `have`
    (the copy the question summarised); None when the answer cannot be one to that
    question: groups out of order or range, digests not those groups' size, or an unsent
    group that `have` does not hold with as many blocks. (What it rebuilds only chooses what
    to fetch: the SHA-256 of the result still decides.)"""
    count = block_count(answer.size)
    groups = answer.groups
    if list(groups) != sorted(set(groups)) or any(not 0 <= g < group_count(answer.size)
                                                  for g in groups):
        return None
    changed = set(groups)
    have_count = block_count(have.size)
    out = bytearray()
    at = 0
    for g in range(group_count(answer.size)):
        first = g * GROUP_BLOCKS
        blocks = min(GROUP_BLOCKS, count - first)
        if g in changed:
            taken = answer.digests[at:at + blocks * DIGEST_BYTES]
            if len(taken) != blocks * DIGEST_BYTES:
                return None
            out += taken
            at += len(taken)
        elif min(GROUP_BLOCKS, have_count - first) == blocks:
            out += have.digests[first * DIGEST_BYTES:(first + blocks) * DIGEST_BYTES]
        else:
            return None
    if at != len(answer.digests):
        return None
    return Blocks(size=answer.size, digests=bytes(out))


def blocks_of(data: bytes) -> bytes:
    """The digests of `data`'s blocks (`data` starts at a block boundary)."""
    return b"".join(hashlib.blake2b(data[i:i + BLOCK_BYTES], digest_size=DIGEST_BYTES).digest()
                    for i in range(0, len(data), BLOCK_BYTES))


@dataclass(frozen=True)
class Delta:
    """What turns the staged file into the new one: write each run (offset, length) of the
    new file's bytes at its offset, then cut or extend the file to `size` if `resize`."""

    runs: tuple[tuple[int, int], ...]
    size: int
    resize: bool

    @property
    def sent_bytes(self) -> int:
        return sum(length for _, length in self.runs)

    @property
    def nothing(self) -> bool:
        """The staged file already is the new one."""
        return not self.runs and not self.resize


def plan(staged: Blocks, now: Blocks) -> Delta:
    """The runs of `now`'s blocks whose digest differs from `staged`'s at the same index
    (every block past the staged file's end differs), merged while adjacent, none longer
    than MAX_RUN_BYTES; `resize` when the sizes differ."""
    runs: list[tuple[int, int]] = []
    staged_count = block_count(staged.size)
    for index in range(block_count(now.size)):
        if index < staged_count and staged.digest(index) == now.digest(index):
            continue
        offset = index * BLOCK_BYTES
        length = min(BLOCK_BYTES, now.size - offset)
        if runs and runs[-1][0] + runs[-1][1] == offset \
                and runs[-1][1] + length <= MAX_RUN_BYTES:
            runs[-1] = (runs[-1][0], runs[-1][1] + length)
        else:
            runs.append((offset, length))
    return Delta(runs=tuple(runs), size=now.size, resize=now.size != staged.size)


def cheapest(now: Blocks, starts: Sequence[Blocks]) -> int:
    """Which of `starts` (copies one side already holds) turns into `now` with the fewest
    bytes fetched (`plan`'s runs); the first of equals. A copy cut part way holds less than
    a whole older one: the older may be the better start."""
    return min(range(len(starts)), key=lambda i: plan(starts[i], now).sent_bytes)
