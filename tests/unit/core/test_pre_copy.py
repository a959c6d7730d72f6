"""A move pre-copies an area unless sending it whole after the stop costs less than a pre-copy."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator import pre_copy
from orchestrator.errors import ErrorCode
from orchestrator.pre_copy import CopyCosts, DecidedBy, Rule
from orchestrator.rules import PARK_AT_ONCE_CODES

from .profiles import PROFILE

MIB = 1024 * 1024
sizes = st.integers(min_value=0, max_value=1 << 44)
min_bytes = st.integers(min_value=0, max_value=1 << 36)
rules = st.sampled_from(Rule)
rates = st.floats(min_value=1.0, max_value=1e12, allow_nan=False)  # bytes/s
fixed_costs = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)  # s


@st.composite
def measured(draw: st.DrawFn) -> CopyCosts:
    """Costs with at least one throughput and one fixed-cost sample."""
    throughputs = draw(st.lists(rates, min_size=1, max_size=pre_copy.WINDOW))
    costs = draw(st.lists(fixed_costs, min_size=1, max_size=pre_copy.WINDOW))
    return CopyCosts(throughputs=tuple(throughputs), fixed_costs=tuple(costs))


any_costs = st.one_of(st.just(CopyCosts()), measured())


def seen(throughput: float, fixed_cost: float) -> CopyCosts:
    """Costs as one pre-copy of 1 MiB would leave them: `throughput`, `fixed_cost`."""
    send_s = MIB / throughput
    return CopyCosts().with_copy(sent_bytes=MIB, send_s=send_s).with_pre_copy(
        wall_s=fixed_cost + send_s, send_s=send_s)


class TestAdaptiveRule:
    """An area is skipped when its bytes take less time to send than a pre-copy's fixed cost."""

    def test_an_area_that_sends_faster_than_the_fixed_cost_is_skipped(self) -> None:
        costs = seen(throughput=10 * MIB, fixed_cost=0.25)  # 2.5 MiB per fixed cost
        decision = pre_copy.decide(size=2 * MIB, rule=Rule.ADAPTIVE, min_bytes=MIB, costs=costs)
        assert not decision.pre_copy
        assert decision.decided_by is DecidedBy.ADAPTIVE
        assert decision.threshold_bytes == round(2.5 * MIB)

    def test_an_area_that_takes_longer_than_the_fixed_cost_is_pre_copied(self) -> None:
        costs = seen(throughput=1 * MIB, fixed_cost=0.25)  # a slow link: 256 KiB
        decision = pre_copy.decide(size=512 * 1024, rule=Rule.ADAPTIVE, min_bytes=MIB,
                                   costs=costs)
        assert decision.pre_copy
        assert decision.threshold_bytes == 256 * 1024

    def test_the_decision_names_what_it_was_based_on(self) -> None:
        costs = seen(throughput=10 * MIB, fixed_cost=0.25)
        decision = pre_copy.decide(size=MIB, rule=Rule.ADAPTIVE, min_bytes=MIB, costs=costs)
        facts = decision.facts()
        assert facts["rule"] == "adaptive"
        assert facts["threshold_bytes"] == decision.threshold_bytes
        assert facts["throughput_bytes_s"] == 10 * MIB
        assert facts["fixed_cost_s"] == 0.25

    @PROFILE
    @given(small=sizes, large=sizes, rule=rules, floor=min_bytes, costs=any_costs)
    def test_a_larger_area_is_never_skipped_where_a_smaller_one_is_pre_copied(
        self, small: int, large: int, rule: Rule, floor: int, costs: CopyCosts
    ) -> None:
        small, large = sorted((small, large))
        if pre_copy.decide(size=small, rule=rule, min_bytes=floor, costs=costs).pre_copy:
            assert pre_copy.decide(size=large, rule=rule, min_bytes=floor, costs=costs).pre_copy

    @PROFILE
    @given(size=sizes, floor=min_bytes, costs=measured())
    def test_the_threshold_stays_within_its_bounds_whatever_was_measured(
        self, size: int, floor: int, costs: CopyCosts
    ) -> None:
        decision = pre_copy.decide(size=size, rule=Rule.ADAPTIVE, min_bytes=floor, costs=costs)
        low, high = pre_copy.bounds(floor)
        assert decision.threshold_bytes is not None
        assert low <= decision.threshold_bytes <= high
        if size >= high:
            assert decision.pre_copy  # no measurement makes it pre-copy nothing
        if size < low:
            assert not decision.pre_copy  # nor everything

    @PROFILE
    @given(size=sizes, costs=any_costs, rule=rules)
    def test_a_threshold_of_zero_pre_copies_every_area(
        self, size: int, costs: CopyCosts, rule: Rule
    ) -> None:
        assert pre_copy.decide(size=size, rule=rule, min_bytes=0, costs=costs).pre_copy


class TestColdStart:
    """Until a copy and a pre-copy have been timed, the configured threshold decides."""

    @PROFILE
    @given(size=sizes, floor=min_bytes, throughputs=st.lists(rates, max_size=3),
           fixed=st.lists(fixed_costs, max_size=3))
    def test_without_both_estimates_the_fixed_threshold_decides(
        self, size: int, floor: int, throughputs: list[float], fixed: list[float]
    ) -> None:
        costs = CopyCosts(throughputs=tuple(throughputs),
                          fixed_costs=() if throughputs else tuple(fixed))
        decision = pre_copy.decide(size=size, rule=Rule.ADAPTIVE, min_bytes=floor, costs=costs)
        assert decision.decided_by is DecidedBy.COLD_START
        assert decision.threshold_bytes == floor
        assert decision.pre_copy == (size >= floor)

    def test_a_cold_start_names_no_measurement(self) -> None:
        decision = pre_copy.decide(size=10, rule=Rule.ADAPTIVE, min_bytes=MIB,
                                   costs=CopyCosts())
        assert decision.facts() == {"rule": "cold_start", "threshold_bytes": MIB}


class TestFixedThreshold:
    """`by_size` keeps the configured threshold, whatever was measured."""

    @PROFILE
    @given(size=sizes, floor=min_bytes, costs=any_costs)
    def test_the_configured_threshold_alone_decides(
        self, size: int, floor: int, costs: CopyCosts
    ) -> None:
        decision = pre_copy.decide(size=size, rule=Rule.BY_SIZE, min_bytes=floor, costs=costs)
        assert decision.decided_by is DecidedBy.BY_SIZE
        assert decision.pre_copy == (size >= floor)
        assert decision.facts() == {"rule": "by_size", "threshold_bytes": floor}


class TestUnknownSize:
    """An area whose size is not known is always pre-copied."""

    @PROFILE
    @given(rule=rules, floor=min_bytes, costs=any_costs)
    def test_an_unknown_size_is_pre_copied(
        self, rule: Rule, floor: int, costs: CopyCosts
    ) -> None:
        decision = pre_copy.decide(size=None, rule=rule, min_bytes=floor, costs=costs)
        assert decision.pre_copy
        assert decision.decided_by is DecidedBy.SIZE_UNKNOWN


class TestCopyCosts:
    """The estimates are medians of a bounded window of recent, meaningful samples."""

    def test_a_copy_of_few_bytes_is_no_throughput_sample(self) -> None:
        costs = CopyCosts().with_copy(sent_bytes=pre_copy.MIN_SAMPLE_BYTES - 1, send_s=0.001)
        assert costs.throughput is None
        costs = costs.with_copy(sent_bytes=pre_copy.MIN_SAMPLE_BYTES, send_s=0.5)
        assert costs.throughput == pre_copy.MIN_SAMPLE_BYTES * 2

    def test_a_copy_timed_at_zero_or_less_is_no_sample(self) -> None:
        costs = CopyCosts().with_copy(sent_bytes=MIB, send_s=0.0)
        costs = costs.with_copy(sent_bytes=MIB, send_s=-1.0)
        costs = costs.with_copy(sent_bytes=MIB, send_s=float("nan"))
        costs = costs.with_pre_copy(wall_s=float("inf"), send_s=0.0)
        assert costs == CopyCosts()

    def test_the_fixed_cost_is_the_wall_beyond_the_sending(self) -> None:
        costs = CopyCosts().with_pre_copy(wall_s=0.3, send_s=0.1)
        assert costs.fixed_cost is not None
        assert abs(costs.fixed_cost - 0.2) < 1e-9
        # a clock that ticked unevenly never makes a negative cost
        assert CopyCosts().with_pre_copy(wall_s=0.1, send_s=0.2).fixed_cost == 0.0

    @PROFILE
    @given(samples=st.lists(rates, min_size=1, max_size=40))
    def test_only_the_last_window_of_samples_counts(self, samples: list[float]) -> None:
        costs = CopyCosts()
        for rate in samples:
            costs = costs.with_copy(sent_bytes=MIB, send_s=MIB / rate)
        assert len(costs.throughputs) == min(len(samples), pre_copy.WINDOW)
        recent = [MIB / (MIB / rate) for rate in samples[-pre_copy.WINDOW:]]
        assert costs.throughputs == tuple(recent)

    @PROFILE
    @given(normal=st.lists(rates, min_size=2, max_size=pre_copy.WINDOW - 1),
           outlier=st.one_of(st.just(1e-6), st.just(1e15), rates),
           at=st.integers(min_value=0))
    def test_one_outlier_moves_the_estimate_no_further_than_the_others_lie(
        self, normal: list[float], outlier: float, at: int
    ) -> None:
        samples = list(normal)
        samples.insert(at % (len(samples) + 1), outlier)
        costs = CopyCosts(throughputs=tuple(samples), fixed_costs=tuple(samples))
        for estimate in (costs.throughput, costs.fixed_cost):
            assert estimate is not None
            assert min(normal) <= estimate <= max(normal)


class TestRounds:
    """The pre-copy goes over what changed again while the rounds shrink."""

    def test_a_tree_that_fits_in_what_is_left_for_after_the_stop_takes_one_round(self) -> None:
        assert not pre_copy.another_round([pre_copy.SETTLED_BYTES])
        assert pre_copy.another_round([pre_copy.SETTLED_BYTES + 1])

    def test_rounds_go_on_while_each_sends_at_most_half_of_the_one_before(self) -> None:
        assert pre_copy.another_round([24 << 20, 700_000])
        assert pre_copy.another_round([24 << 20, 700_000, 350_000])
        assert not pre_copy.another_round([24 << 20, 700_000, 350_001])

    def test_a_store_changing_faster_than_the_link_follows_ends_the_rounds(self) -> None:
        assert not pre_copy.another_round([24 << 20, 4 << 20, 4 << 20])

    def test_a_round_that_sent_little_is_the_last(self) -> None:
        assert not pre_copy.another_round([24 << 20, 700_000, pre_copy.SETTLED_BYTES])

    def test_no_more_than_the_most_rounds(self) -> None:
        shrinking = [1 << 30 >> (2 * i) for i in range(pre_copy.MAX_ROUNDS)]
        assert pre_copy.another_round(shrinking[:-1])
        assert not pre_copy.another_round(shrinking)

    @PROFILE
    @given(st.lists(st.integers(min_value=0, max_value=1 << 40), max_size=8))
    def test_the_rounds_always_end(self, sent: list[int]) -> None:
        rounds = list(sent)
        while pre_copy.another_round(rounds):
            rounds.append(rounds[-1])  # a round that did not shrink
        assert len(rounds) <= max(len(sent), pre_copy.MAX_ROUNDS)


class TestEndsThePreflight:
    """A pre-copy's failure fails its move's preflight only for a cause retrying cannot fix
    (found before the source stops) and for a lost link (the next try resumes); any other
    failure leaves the copy after the stop to send what the pre-copy did not."""

    @pytest.mark.parametrize("code", sorted(PARK_AT_ONCE_CODES | {
        ErrorCode.SSH_UNREACHABLE, ErrorCode.SSH_TIMEOUT, ErrorCode.AGENT_UNREACHABLE}))
    def test_a_lost_link_or_a_cause_retrying_cannot_fix_ends_it(self, code: str) -> None:
        assert pre_copy.ends_the_preflight(code)

    @pytest.mark.parametrize("code", [ErrorCode.COPY_SOURCE_CHANGED, ErrorCode.COPY_INCOMPLETE,
                                      ErrorCode.AGENT_ROUTE_MISSING, ErrorCode.BAD_REQUEST])
    def test_anything_else_is_left_to_the_copy_after_the_stop(self, code: str) -> None:
        assert not pre_copy.ends_the_preflight(code)
