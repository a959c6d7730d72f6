"""The pure tunnel decisions: who may take, renew or release the tunnel lease, what a denied
reverse forward means (orchestrator/tunnel_lease.py, orchestrator/forward_diagnosis.py), and
how fast the keeper may reconnect (monitord/remote/tunnel/backoff.py, driven by a fake clock), plus
the small pure-ish pieces around them (`ss` output parsing, the stable owner id)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from monitord.remote.tunnel.backoff import ReconnectBackoff
from monitord.remote.tunnel.port_holder import parse_probe
from monitord.store import owner_id
from orchestrator.errors import MonitordError
from orchestrator.forward_diagnosis import Diagnosis, HolderKind, PortHolder, Verdict, diagnose
from orchestrator.tunnel_lease import (
    LeaseAction,
    LeaseDecision,
    LeaseRecord,
    SessionIdentity,
    decide_acquire,
    decide_release,
    decide_renew,
)

OURS = SessionIdentity(sshd_pid=100, sshd_start_ticks=5, ssh_connection="10.0.0.1 5 10.0.0.2 22")
THEIRS = SessionIdentity(sshd_pid=200, sshd_start_ticks=7, ssh_connection="10.0.0.9 6 10.0.0.2 22")


def lease(owner: str = "them", *, session: SessionIdentity = THEIRS, renewed_at: float = 1000.0,
          ttl: float = 30.0) -> LeaseRecord:
    return LeaseRecord(owner_id=owner, owner_label=f"{owner}-label", acquired_at=900.0,
                       renewed_at=renewed_at, ttl=ttl, session=session)


def acquire(
    current: LeaseRecord | None, *, now: float = 1010.0, alive: bool = True
) -> LeaseDecision:
    return decide_acquire(current, owner_id="us", owner_label="us-label", ttl=30.0,
                          session=OURS, now=now, holder_session_alive=alive)


class TestAcquire:
    """A node takes a free, own or provably dead lease and never a live foreign one."""

    def test_a_free_lease_is_taken(self) -> None:
        decision = acquire(None)
        assert decision.action is LeaseAction.TAKE
        assert decision.record is not None and decision.record.owner_id == "us"
        assert decision.record.session == OURS and decision.record.renewed_at == 1010.0

    def test_our_own_earlier_session_is_replaced_by_the_new_one(self) -> None:
        decision = acquire(lease("us", session=THEIRS))
        assert decision.action is LeaseAction.TAKE
        assert decision.record is not None and decision.record.session == OURS

    def test_reacquiring_from_the_same_session_keeps_the_acquired_time(self) -> None:
        decision = acquire(lease("us", session=OURS))
        assert decision.record is not None and decision.record.acquired_at == 900.0

    def test_a_live_foreign_lease_is_refused_even_if_its_session_looks_gone(self) -> None:
        for alive in (True, False):
            decision = acquire(lease(), now=1029.9, alive=alive)
            assert decision.action is LeaseAction.REFUSE_CONFLICT
            assert decision.record is None
            assert decision.holder is not None and decision.holder.owner_id == "them"

    def test_an_expired_foreign_lease_with_its_session_gone_is_taken(self) -> None:
        decision = acquire(lease(), now=1030.0, alive=False)
        assert decision.action is LeaseAction.TAKE

    def test_an_expired_foreign_lease_with_a_live_session_is_taken_only_after_fencing(self) -> None:
        decision = acquire(lease(), now=1031.0, alive=True)
        assert decision.action is LeaseAction.FENCE_THEN_TAKE
        assert decision.fence_pid == THEIRS.sshd_pid

    @given(now=st.floats(min_value=0, max_value=1e6), alive=st.booleans(),
           renewed=st.floats(min_value=0, max_value=1e6),
           ttl=st.floats(min_value=0.1, max_value=1e4))
    def test_no_interleaving_takes_an_unexpired_foreign_lease(
        self, now: float, alive: bool, renewed: float, ttl: float
    ) -> None:
        current = lease(renewed_at=renewed, ttl=ttl)
        decision = acquire(current, now=now, alive=alive)
        if not current.is_expired(now):
            assert decision.action is LeaseAction.REFUSE_CONFLICT
        else:
            assert decision.action in (LeaseAction.TAKE, LeaseAction.FENCE_THEN_TAKE)


class TestRenewAndRelease:
    """Only the owning session renews; only the owner releases."""

    def test_the_owning_session_renews(self) -> None:
        decision = decide_renew(lease("us", session=OURS), owner_id="us", session=OURS, now=1020.0)
        assert decision.action is LeaseAction.RENEW
        assert decision.record is not None and decision.record.renewed_at == 1020.0

    @pytest.mark.parametrize(
        "current",
        [None, lease("them", session=OURS), lease("us", session=THEIRS)],
        ids=["no-lease", "other-owner", "other-session"],
    )
    def test_anything_else_is_reported_lost(self, current: LeaseRecord | None) -> None:
        decision = decide_renew(current, owner_id="us", session=OURS, now=1020.0)
        assert decision.action is LeaseAction.LOST and decision.record is None

    def test_release_removes_only_our_own_record(self) -> None:
        assert decide_release(lease("us"), owner_id="us").action is LeaseAction.RELEASE
        assert decide_release(lease("them"), owner_id="us").action is LeaseAction.NOTHING
        assert decide_release(None, owner_id="us").action is LeaseAction.NOTHING

    def test_a_record_survives_its_storage_round_trip(self) -> None:
        record = lease("us", session=OURS)
        assert LeaseRecord.from_dict(record.to_dict()) == record


def verdict_for(
    holder: PortHolder, *, current: LeaseRecord | None = None, our_pid: int = 100
) -> Diagnosis:
    return diagnose(holder, our_owner_id="us", our_sshd_pid=our_pid,
                    lease=current if current is not None else lease("us", session=OURS),
                    now=1010.0, keepalive_interval_s=1.0, stale_after_s=3.0,
                    conflict_retry_s=20.0)


class TestForwardDiagnosis:
    """A denied forward is explained by its holder: fence our stale session, name a live
    owner, or name the foreign program — never a blind retry."""

    def test_a_freed_port_is_retried_at_once(self) -> None:
        assert verdict_for(PortHolder(port=4222, kind=HolderKind.NONE)).verdict is Verdict.RETRY_NOW

    def test_a_non_sshd_listener_is_port_occupied_with_its_pid_and_command(self) -> None:
        d = verdict_for(PortHolder(port=4222, kind=HolderKind.OTHER, pid=77, command="nc"))
        assert (d.verdict, d.code, d.holder_pid, d.holder_command) == (
            Verdict.PORT_OCCUPIED, "PORT_OCCUPIED", 77, "nc")
        assert d.fence_pid is None

    def test_our_own_stale_session_is_fenced(self) -> None:
        d = verdict_for(PortHolder(port=4222, kind=HolderKind.SSHD, pid=150, lastrcv_s=3.5))
        assert d.verdict is Verdict.FENCE and d.fence_pid == 150 and d.code is None
        assert "our own" in d.detail

    def test_a_session_without_a_client_socket_is_fenced(self) -> None:
        d = verdict_for(PortHolder(port=4222, kind=HolderKind.SSHD, pid=150, lastrcv_s=None))
        assert d.verdict is Verdict.FENCE

    def test_a_session_going_silent_is_waited_for_until_it_is_stale(self) -> None:
        d = verdict_for(PortHolder(port=4222, kind=HolderKind.SSHD, pid=150, lastrcv_s=2.0))
        assert d.verdict is Verdict.WAIT_STALE and d.fence_pid is None
        assert 1.0 <= d.retry_after_s <= 1.5

    def test_a_talking_unknown_session_is_a_conflict_not_fenced(self) -> None:
        d = verdict_for(PortHolder(port=4222, kind=HolderKind.SSHD, pid=150, lastrcv_s=0.1,
                                   client="10.1.1.1:4000"))
        assert d.verdict is Verdict.LEASE_CONFLICT and d.code == "TUNNEL_LEASE_CONFLICT"
        assert d.fence_pid is None and d.retry_after_s == 20.0

    def test_the_session_of_another_owners_unexpired_lease_is_never_fenced(self) -> None:
        for silent in (0.1, 2.0, 50.0, None):
            d = verdict_for(PortHolder(port=4222, kind=HolderKind.SSHD, pid=200, lastrcv_s=silent),
                            current=lease("them"))
            assert d.verdict is Verdict.LEASE_CONFLICT and d.fence_pid is None
            assert (d.owner_id, d.owner_label) == ("them", "them-label")

    def test_our_own_live_session_is_never_fenced(self) -> None:
        d = verdict_for(PortHolder(port=4222, kind=HolderKind.SSHD, pid=100, lastrcv_s=99.0))
        assert d.verdict is Verdict.DENIED and d.fence_pid is None

    @given(pid=st.integers(1, 300), silent=st.one_of(st.none(), st.floats(0, 100)),
           owner=st.sampled_from(["us", "them"]), renewed=st.floats(900, 1100))
    def test_fencing_never_targets_our_session_or_a_live_foreign_lease(
        self, pid: int, silent: float | None, owner: str, renewed: float
    ) -> None:
        current = lease(owner, session=THEIRS, renewed_at=renewed)
        d = verdict_for(PortHolder(port=1, kind=HolderKind.SSHD, pid=pid, lastrcv_s=silent),
                        current=current)
        if d.verdict is Verdict.FENCE:
            assert pid != 100
            assert silent is None or silent >= 3.0
            assert not (owner == "them" and pid == 200 and not current.is_expired(1010.0))


class TestReconnectBackoff:
    """Backoff grows with full jitter up to its cap, and no clock lets more than
    max_attempts_per_window attempts through in any window."""

    def test_a_minute_of_instant_failures_makes_at_most_the_cap_of_attempts(self) -> None:
        backoff = ReconnectBackoff(base_s=0.01, cap_s=0.05, max_attempts_per_window=6,
                                   window_s=60.0, rng=random.Random(7))
        now, attempts = 0.0, []
        while now < 180.0:
            now += backoff.delay(now)
            backoff.record_attempt(now)
            attempts.append(now)
            backoff.record_failure(now=now)
        for i, t in enumerate(attempts):
            assert len([u for u in attempts[i:] if u < t + 60.0]) <= 6
        assert len(attempts) >= 3 * 6 - 1, "the cap paces attempts, it does not stop them"

    def test_delays_are_jittered_below_an_exponential_ceiling_and_reset_on_success(
        self,
    ) -> None:
        backoff = ReconnectBackoff(base_s=1.0, cap_s=30.0, max_attempts_per_window=1000,
                                   rng=random.Random(1))
        assert backoff.delay(0.0) == 0.0
        for failures in range(1, 10):
            backoff.record_failure(now=0.0)
            assert 0.0 <= backoff.delay(0.0) <= min(30.0, 2 ** (failures - 1))
        backoff.record_success()
        assert backoff.delay(0.0) == 0.0

    def test_the_first_retry_after_a_proven_connection_is_immediate_then_jittered(
        self,
    ) -> None:
        backoff = ReconnectBackoff(base_s=1.0, cap_s=30.0, max_attempts_per_window=1000,
                                   rng=random.Random(3))
        backoff.record_success()
        backoff.record_failure(now=0.0)  # the VPS dropped a working session
        assert backoff.delay(0.0) == 0.0
        delays = []
        for _ in range(20):  # it keeps failing: jitter below the exponential ceiling again
            backoff.record_failure(now=0.0)
            delays.append(backoff.delay(0.0))
        assert any(d > 0 for d in delays) and all(0 <= d <= 30.0 for d in delays)
        fresh = ReconnectBackoff(base_s=1.0, cap_s=30.0, max_attempts_per_window=1000,
                                 rng=random.Random(3))
        fresh.record_failure(now=0.0)  # never connected yet: no free retry
        assert 0.0 < fresh.delay(0.0) <= 1.0

    def test_a_slow_retry_a_cause_asks_for_wins_over_the_free_one(self) -> None:
        backoff = ReconnectBackoff(base_s=1.0, cap_s=30.0, max_attempts_per_window=100)
        backoff.record_success()
        backoff.record_failure(at_least_s=20.0, now=100.0)
        assert backoff.delay(100.0) >= 20.0

    def test_a_cause_can_ask_for_a_slow_retry(self) -> None:
        backoff = ReconnectBackoff(base_s=0.01, cap_s=0.05, max_attempts_per_window=100)
        backoff.record_failure(at_least_s=20.0, now=100.0)
        assert backoff.delay(100.0) >= 20.0
        assert backoff.delay(121.0) <= 0.05


SS_SSHD = """LISTEN 0      128    127.0.0.1:4222 0.0.0.0:* users:(("sshd",pid=6200,fd=5))
@@stat
6200 (sshd) S 6196 6196 6196 0 -1 4194560 700 0 0 0 1 2 0 0 20 0 1 0 987654 1 2 3
@@parent
6196 (sshd) S 700 6196 6196 0 -1 4194560 700 0 0 0 1 2 0 0 20 0 1 0 987650 1 2 3
@@sshd_listen
LISTEN 0      128    0.0.0.0:22 0.0.0.0:* users:(("sshd",pid=700,fd=3))
@@estab
0 0 127.0.0.1:22 127.0.0.1:50104 users:(("sshd",pid=6300,fd=4)) bbr lastsnd:4 lastrcv:9 lastack:4
0 0 127.0.0.1:22 127.0.0.1:50200 users:(("sshd",pid=6200,fd=4)) lastsnd:10 lastrcv:4016 lastack:9
@@self
127.0.0.1 50104 127.0.0.1 22
"""


class TestPortHolderParsing:
    """The VPS probe's `ss` output becomes a holder observation (pure parsing)."""

    def test_an_sshd_holder_with_its_silence_client_and_start_time(self) -> None:
        observed = parse_probe(SS_SSHD, port=4222)
        assert observed.holder == PortHolder(
            port=4222, kind=HolderKind.SSHD, pid=6200, command="sshd", lastrcv_s=4.016,
            client="127.0.0.1:50200")
        assert observed.start_ticks == 987654
        assert observed.our_ssh_connection == "127.0.0.1 50104 127.0.0.1 22"

    def test_a_foreign_program_and_a_free_port(self) -> None:
        foreign = parse_probe(
            'LISTEN 0 128 127.0.0.1:4222 0.0.0.0:* users:(("nc",pid=77,fd=3))\n@@stat\n'
            "@@estab\n@@self\nx\n", port=4222)
        assert (foreign.holder.kind, foreign.holder.pid, foreign.holder.command) == (
            HolderKind.OTHER, 77, "nc")
        free = parse_probe("@@stat\n@@estab\n@@self\nx\n", port=4222)
        assert free.holder.kind is HolderKind.NONE

    def test_an_sshd_holder_without_a_client_socket_has_unknown_silence(self) -> None:
        text = SS_SSHD.replace("pid=6200,fd=4", "pid=9999,fd=4")
        assert parse_probe(text, port=4222).holder.lastrcv_s is None


class TestOwnerId:
    """The owner id is created once per work_dir and read back unchanged afterwards."""

    def test_stable_per_work_dir_and_distinct_between_work_dirs(self, tmp_path: Path) -> None:
        first = owner_id.load_or_create(tmp_path / "a")
        assert owner_id.load_or_create(tmp_path / "a") == first
        assert owner_id.load_or_create(tmp_path / "b") != first
        assert (tmp_path / "a" / "owner_id").read_text().strip() == first

    def test_a_damaged_file_is_config_corrupt_and_left_alone(self, tmp_path: Path) -> None:
        (tmp_path / "owner_id").write_text("not-an-id\n")
        with pytest.raises(MonitordError) as raised:
            owner_id.load_or_create(tmp_path)
        assert raised.value.code == "CONFIG_CORRUPT"
        assert (tmp_path / "owner_id").read_text() == "not-an-id\n"
