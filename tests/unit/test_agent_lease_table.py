"""The agent's pure lease-table decisions (monitord.vps.lease_table), case by case."""

from __future__ import annotations

import pytest

from monitord.vps.lease_table import (
    AreaEntry,
    AreaSpec,
    CreateVerdict,
    EntryState,
    GenerationCheck,
    RenewOutcome,
    check_generation,
    decide_create,
    decide_renew,
    restart_delay_s,
)

NOW = 1000.0


def spec(*, generation: int = 5, owner: str = "me", command: tuple[str, ...] = ("d",)) -> AreaSpec:
    return AreaSpec(area="a", service="tg", generation=generation, owner_id=owner,
                    command=command, data_dir="/opt/offload/data/a")


def entry(*, generation: int = 5, owner: str = "me", lease_left: float | None = 10.0) -> AreaEntry:
    expires = None if lease_left is None else NOW + lease_left
    return AreaEntry(spec=spec(generation=generation, owner=owner), lease_expires=expires)


class TestCreateDecision:
    """Create is refused for another live owner or a newer generation, and idempotent."""

    @pytest.mark.parametrize(
        ("existing", "request_spec", "alive", "verdict"),
        [
            (None, spec(), False, CreateVerdict.NEW),
            (entry(), spec(), True, CreateVerdict.SAME),
            (entry(), spec(command=("other",)), True, CreateVerdict.UPDATE),
            (entry(generation=6), spec(generation=5), False, CreateVerdict.CONFLICT),
            (entry(generation=4), spec(generation=5), True, CreateVerdict.SUPERSEDE),
            (entry(owner="them"), spec(generation=9), False, CreateVerdict.CONFLICT),
            (entry(owner="them", lease_left=None), spec(), True, CreateVerdict.CONFLICT),
            (entry(owner="them", lease_left=-1.0), spec(), False, CreateVerdict.TAKE_OVER),
        ],
    )
    def test_verdict(
        self, existing: AreaEntry | None, request_spec: AreaSpec, alive: bool,
        verdict: CreateVerdict,
    ) -> None:
        decision = decide_create(existing, request_spec, now=NOW, process_alive=alive)
        assert decision.verdict is verdict


class TestRenewAndGenerationChecks:
    """Only an exact (area, generation, owner) match is renewed; stop/delete check generation."""

    def test_renew_outcomes(self) -> None:
        assert decide_renew(None, owner_id="me", generation=5) is RenewOutcome.ABSENT
        assert decide_renew(entry(), owner_id="x", generation=5) is RenewOutcome.OTHER_OWNER
        assert decide_renew(entry(), owner_id="me", generation=4) is (
            RenewOutcome.GENERATION_MISMATCH
        )
        assert decide_renew(entry(), owner_id="me", generation=5) is RenewOutcome.RENEWED

    def test_generation_check(self) -> None:
        assert check_generation(None, 5) is GenerationCheck.ABSENT
        assert check_generation(entry(), 4) is GenerationCheck.MISMATCH
        assert check_generation(entry(), 5) is GenerationCheck.MATCH


class TestEntryState:
    """An entry without a current lease never counts as allowed to run."""

    def test_a_lapsed_or_ungranted_entry_awaits_a_grant_and_should_not_run(self) -> None:
        for lease_left in (None, 0.0, -5.0):
            lapsed = entry(lease_left=lease_left)
            assert not lapsed.should_run(NOW)
            assert lapsed.state(now=NOW, process_running=True) is EntryState.AWAITING_GRANT

    def test_restart_delay_grows_and_is_capped(self) -> None:
        delays = [restart_delay_s(n, base_s=0.5, cap_s=4.0) for n in range(1, 7)]
        assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


class TestRenewalRewrite:
    """A renewal rewrites the lease file unless it would extend a current lease by less
    than a tenth of its TTL; the lease on disk is never longer than the owner asked for."""

    @pytest.mark.parametrize(
        ("lease_left", "ttl_s", "rewrite"),
        [
            (None, 3.0, True),  # never granted (or lapsed): always
            (-0.1, 3.0, True),  # lapsed
            (3.0, 3.0, False),  # renewed again at once: it would not move
            (2.8, 3.0, False),  # by 0.2 s < 0.3 s
            (2.6, 3.0, True),  # by more than a tenth
            (2.0, 3.0, True),  # the regular renewal, every TTL/3
            (10.0, 3.0, True),  # shorter than what is held: must be written
        ],
    )
    def test_when_a_renewal_rewrites(
        self, lease_left: float | None, ttl_s: float, rewrite: bool
    ) -> None:
        assert entry(lease_left=lease_left).worth_a_rewrite(now=NOW, ttl_s=ttl_s) is rewrite
