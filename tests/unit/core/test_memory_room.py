"""orchestrator/memory_room.py: what a move asks of the VPS's memory (the daemon as it is on
the PBX, its lease guard, the moves under way, the reserve) against what the VPS has
available, and the shortage preflight reports with each part named."""

from __future__ import annotations

from orchestrator import disk_space, memory_room
from orchestrator.memory_room import GUARD_BYTES, Host, Need

MIB = disk_space.MIB


class TestTheNeed:
    def test_it_adds_the_daemon_its_guard_the_claims_and_the_reserve(self) -> None:
        need = Need(daemon_bytes=150 * MIB, claimed_bytes=300 * MIB, reserve_bytes=64 * MIB)
        assert need.area_bytes == 150 * MIB + GUARD_BYTES
        assert need.total_bytes == 150 * MIB + GUARD_BYTES + 300 * MIB + 64 * MIB

    def test_a_daemon_of_unknown_size_counts_its_guard_only(self) -> None:
        assert Need(daemon_bytes=None, reserve_bytes=0).total_bytes == GUARD_BYTES


class TestTheShortage:
    def test_an_area_that_fits_to_the_byte(self) -> None:
        need = Need(daemon_bytes=100 * MIB, claimed_bytes=10 * MIB, reserve_bytes=64 * MIB)
        assert memory_room.shortage(Host(1024 * MIB, need.total_bytes), need) is None

    def test_one_byte_short(self) -> None:
        need = Need(daemon_bytes=100 * MIB, claimed_bytes=10 * MIB, reserve_bytes=64 * MIB)
        short = memory_room.shortage(Host(1024 * MIB, need.total_bytes - 1), need)
        assert short is not None and short.missing == 1

    def test_a_vps_that_does_not_tell_is_not_judged(self) -> None:
        need = Need(daemon_bytes=1 << 50)
        assert memory_room.shortage(Host(None, None), need) is None

    def test_the_detail_names_every_part_and_what_is_missing(self) -> None:
        need = Need(daemon_bytes=150 * MIB, claimed_bytes=40 * MIB, reserve_bytes=64 * MIB)
        short = memory_room.shortage(Host(1024 * MIB, 180 * MIB), need)
        assert short is not None
        assert short.detail() == (
            "VPS: 180.0 MiB of memory available, 258.0 MiB needed (its daemon 150.0 MiB as"
            " resident on the PBX, its lease guard 4.0 MiB, moves under way 40.0 MiB,"
            " 64.0 MiB kept free): 78.0 MiB missing")
        assert short.facts() == {
            "side": "VPS", "unit": "memory_bytes", "needed_bytes": 258 * MIB,
            "available_bytes": 180 * MIB, "daemon_bytes": 150 * MIB,
            "claimed_bytes": 40 * MIB, "reserve_bytes": 64 * MIB}

    def test_a_daemon_not_running_is_said_so(self) -> None:
        short = memory_room.shortage(Host(None, 0), Need(daemon_bytes=None))
        assert short is not None
        assert "its daemon's size unknown (not running on the PBX)" in short.detail()
        assert "moves under way" not in short.detail()


class TestTheClaims:
    """The moves under way count each other until they end."""

    def test_each_move_counts_the_others_claimed_before_it(self) -> None:
        claims = memory_room.Claims()
        first = claims.claim("t1", daemon_bytes=100 * MIB)
        second = claims.claim("t2", daemon_bytes=50 * MIB)
        third = claims.claim("t3", daemon_bytes=None)
        assert first.claimed_bytes == 0
        assert second.claimed_bytes == 100 * MIB + GUARD_BYTES
        assert third.claimed_bytes == 150 * MIB + 2 * GUARD_BYTES

    def test_a_move_that_ended_claims_nothing(self) -> None:
        claims = memory_room.Claims()
        claims.claim("t1", daemon_bytes=100 * MIB)
        claims.release("t1")
        claims.release("t1")  # (twice: an end and a failed preflight)
        assert claims.claim("t2", daemon_bytes=10 * MIB).claimed_bytes == 0

    def test_checked_again_it_keeps_its_measure_and_does_not_count_itself(self) -> None:
        """A preflight checked again after the source stopped (its daemon no longer runs)
        keeps the size it measured while it ran."""
        claims = memory_room.Claims()
        claims.claim("t1", daemon_bytes=100 * MIB)
        claims.claim("t2", daemon_bytes=30 * MIB)
        again = claims.claim("t1", daemon_bytes=None)
        assert again.daemon_bytes == 100 * MIB
        assert again.claimed_bytes == 30 * MIB + GUARD_BYTES
        assert claims.claim("t1", daemon_bytes=120 * MIB).daemon_bytes == 120 * MIB
