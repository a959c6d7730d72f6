"""orchestrator/block_delta.py: the runs the copy after the stop sends are exactly the
blocks that changed, and writing them into the staged file gives the new file."""

from __future__ import annotations

import random

import pytest

from orchestrator.block_delta import (
    BLOCK_BYTES,
    DIGEST_BYTES,
    GROUP_BLOCKS,
    MAX_RUN_BYTES,
    Blocks,
    ChangedGroups,
    Delta,
    blocks_of,
    changed_groups,
    cheapest,
    group_digests,
    plan,
    with_changes,
)


def blocks(data: bytes) -> Blocks:
    return Blocks(size=len(data), digests=blocks_of(data))


def applied(staged: bytes, new: bytes, delta: Delta) -> bytes:
    """What the receiver ends with: the runs of `new` written into `staged`, then the cut."""
    out = bytearray(staged)
    for offset, length in delta.runs:
        if len(out) < offset + length:
            out.extend(b"\0" * (offset + length - len(out)))
        out[offset:offset + length] = new[offset:offset + length]
    if delta.resize:
        del out[delta.size:]
        out.extend(b"\0" * (delta.size - len(out)))
    return bytes(out)


def page(index: int) -> slice:
    return slice(index * BLOCK_BYTES, (index + 1) * BLOCK_BYTES)


class TestPlan:
    def test_an_unchanged_file_sends_nothing(self) -> None:
        data = random.Random(1).randbytes(10 * BLOCK_BYTES + 7)
        assert plan(blocks(data), blocks(data)).nothing

    def test_changed_pages_are_sent_alone_and_adjacent_ones_as_one_run(self) -> None:
        old = random.Random(2).randbytes(16 * BLOCK_BYTES)
        new = bytearray(old)
        for index in (3, 7, 8):
            new[page(index)] = bytes(BLOCK_BYTES)
        delta = plan(blocks(old), blocks(bytes(new)))
        assert delta.runs == ((3 * BLOCK_BYTES, BLOCK_BYTES), (7 * BLOCK_BYTES, 2 * BLOCK_BYTES))
        assert (delta.sent_bytes, delta.resize) == (3 * BLOCK_BYTES, False)

    def test_an_append_sends_the_old_last_block_and_the_new_bytes(self) -> None:
        old = random.Random(3).randbytes(4 * BLOCK_BYTES + 100)
        new = old + b"appended"
        delta = plan(blocks(old), blocks(new))
        assert delta.runs == ((4 * BLOCK_BYTES, 100 + len(b"appended")),)
        assert delta.resize and delta.size == len(new)

    def test_a_shrunk_file_is_cut_and_its_new_last_block_sent(self) -> None:
        old = random.Random(4).randbytes(8 * BLOCK_BYTES)
        new = old[:5 * BLOCK_BYTES + 10]
        delta = plan(blocks(old), blocks(new))
        assert delta.runs == ((5 * BLOCK_BYTES, 10),)
        assert delta.resize and delta.size == len(new)
        exact = old[:5 * BLOCK_BYTES]
        assert plan(blocks(old), blocks(exact)) == Delta(runs=(), size=len(exact), resize=True)

    def test_no_run_is_longer_than_one_write(self) -> None:
        old = bytes(3 * MAX_RUN_BYTES)
        new = b"\1" * len(old)
        delta = plan(blocks(old), blocks(new))
        assert all(length <= MAX_RUN_BYTES for _, length in delta.runs)
        assert delta.sent_bytes == len(new) and len(delta.runs) == 3

    def test_digests_that_do_not_fit_the_size_are_refused(self) -> None:
        with pytest.raises(ValueError, match="digest bytes"):
            Blocks(size=BLOCK_BYTES + 1, digests=blocks_of(bytes(BLOCK_BYTES)))

    def test_the_runs_written_into_the_staged_file_give_the_new_one(self) -> None:
        for seed in range(300):
            old, new = mutated(random.Random(seed))
            delta = plan(blocks(old), blocks(new))
            assert applied(old, new, delta) == new, seed
            changed = sum(1 for i in range(0, len(new), BLOCK_BYTES)
                          if new[i:i + BLOCK_BYTES] != old[i:i + BLOCK_BYTES])
            assert delta.sent_bytes <= changed * BLOCK_BYTES, seed  # the changed blocks only


def mutated(rng: random.Random) -> tuple[bytes, bytes]:
    """A file and what a live store made of it: pages rewritten, bytes poked, appends, cuts."""
    old = rng.randbytes(rng.randrange(0, 40 * BLOCK_BYTES))
    new = bytearray(old)
    for _ in range(rng.randrange(0, 6)):
        kind = rng.choice(("page", "byte", "append", "cut"))
        if kind == "page" and new:
            at = rng.randrange(0, len(new))
            new[at:at + BLOCK_BYTES] = rng.randbytes(len(new[at:at + BLOCK_BYTES]))
        elif kind == "byte" and new:
            new[rng.randrange(0, len(new))] ^= 0xFF
        elif kind == "append":
            new += rng.randbytes(rng.randrange(1, 3 * BLOCK_BYTES))
        elif kind == "cut":
            del new[rng.randrange(0, len(new) + 1):]
    return old, bytes(new)


class TestTheCheapestStart:
    """Of the copies a side holds, the fetch starts from the one that needs fewest bytes."""

    def test_a_whole_older_copy_beats_a_cut_prefix_of_the_newest(self) -> None:
        rng = random.Random(5)
        older = bytearray(rng.randbytes(64 * BLOCK_BYTES))
        now = bytearray(older)
        now[page(40)] = rng.randbytes(BLOCK_BYTES)
        cut = bytes(now[:16 * BLOCK_BYTES])  # a quarter of the newest, then the cut
        assert cheapest(blocks(bytes(now)), [blocks(cut), blocks(bytes(older))]) == 1

    def test_a_cut_copy_that_holds_more_of_the_newest_is_kept(self) -> None:
        rng = random.Random(6)
        older = bytearray(rng.randbytes(64 * BLOCK_BYTES))
        now = bytearray(older)
        for index in range(0, 64, 2):  # half the pages changed since the older copy
            now[page(index)] = rng.randbytes(BLOCK_BYTES)
        cut = bytes(now[:48 * BLOCK_BYTES])
        assert cheapest(blocks(bytes(now)), [blocks(cut), blocks(bytes(older))]) == 0

    def test_of_equals_the_first(self) -> None:
        data = random.Random(7).randbytes(8 * BLOCK_BYTES)
        assert cheapest(blocks(data), [blocks(data), blocks(data)]) == 0



class TestGroupsThatDiffer:
    """A side that holds most of a file asks for the digests of the 64 KiB groups that
    differ only, and rebuilds the whole file's digests from its own for the rest."""

    @pytest.mark.parametrize("seed", range(40))
    def test_the_rebuilt_digests_are_the_files(self, seed: int) -> None:
        rng = random.Random(seed)
        have = bytearray(rng.randbytes(rng.randrange(0, 300) * BLOCK_BYTES
                                       + rng.randrange(0, BLOCK_BYTES)))
        now = bytearray(have)
        for _ in range(rng.randrange(0, 6)):
            if now:
                at = rng.randrange(len(now))
                now[at:at + 10] = rng.randbytes(len(now[at:at + 10]))
        match rng.randrange(3):
            case 0:
                now += rng.randbytes(rng.randrange(1, 5 * BLOCK_BYTES))
            case 1:
                del now[rng.randrange(len(now) + 1):]
        answer = changed_groups(blocks(bytes(now)), group_digests(blocks(bytes(have))))
        assert with_changes(blocks(bytes(have)), answer) == blocks(bytes(now))

    def test_one_changed_page_sends_one_group(self) -> None:
        have = random.Random(1).randbytes(6144 * BLOCK_BYTES // 16)  # 1.5 MiB
        now = bytearray(have)
        now[page(100)] = bytes(BLOCK_BYTES)
        answer = changed_groups(blocks(bytes(now)), group_digests(blocks(have)))
        assert answer.groups == (100 // GROUP_BLOCKS,)
        assert len(answer.digests) == GROUP_BLOCKS * DIGEST_BYTES

    @pytest.mark.parametrize("answer", [
        ChangedGroups(size=40 * BLOCK_BYTES, groups=(1, 0), digests=bytes(32 * DIGEST_BYTES)),
        ChangedGroups(size=40 * BLOCK_BYTES, groups=(3,), digests=bytes(16 * DIGEST_BYTES)),
        ChangedGroups(size=40 * BLOCK_BYTES, groups=(0,), digests=bytes(15 * DIGEST_BYTES)),
        ChangedGroups(size=40 * BLOCK_BYTES, groups=(0,), digests=bytes(17 * DIGEST_BYTES)),
        # a group the asker does not hold, left out of the answer
        ChangedGroups(size=80 * BLOCK_BYTES, groups=(0,), digests=bytes(16 * DIGEST_BYTES)),
    ], ids=["out of order", "out of range", "short", "long", "unsent and not held"])
    def test_an_answer_that_cannot_be_one_is_refused(self, answer: ChangedGroups) -> None:
        have = blocks(random.Random(2).randbytes(40 * BLOCK_BYTES))
        assert with_changes(have, answer) is None
