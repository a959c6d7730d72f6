"""Failure observations map to stable codes, and every code in the catalogue is explained."""

from __future__ import annotations

import pytest

from orchestrator import classify, errors
from orchestrator.classify import (
    AgentReply,
    ArtifactCheck,
    CleanupOverdue,
    CopyVerification,
    DaemonControl,
    ForwardVerdict,
    HealthObservation,
    LocalFault,
    Observation,
    PreflightFailure,
    RequestRefusal,
    SshFailure,
    TunnelLeaseResult,
)
from orchestrator.errors import ErrorCode

# One realistic observation per code: what an adapter would report when it happens.
REALISTIC: dict[ErrorCode, Observation] = {
    ErrorCode.AUTH_FAILED: SshFailure("auth"),
    ErrorCode.HOST_KEY_MISMATCH: SshFailure("host_key"),
    ErrorCode.SSH_UNREACHABLE: SshFailure("connect_refused"),
    ErrorCode.SSH_TIMEOUT: SshFailure("keepalive_timeout"),
    ErrorCode.TUNNEL_LEASE_CONFLICT: TunnelLeaseResult("held_by_other"),
    ErrorCode.PORT_OCCUPIED: ForwardVerdict("foreign_process"),
    ErrorCode.FORWARD_DENIED: SshFailure("channel_listen"),
    ErrorCode.FORWARD_UNPROVEN: SshFailure("forward_round_trip"),
    ErrorCode.AGENT_UNREACHABLE: AgentReply(status=None),
    ErrorCode.AGENT_UNAUTHORIZED: AgentReply(status=401),
    ErrorCode.AGENT_ROUTE_MISSING: AgentReply(status=404, error_code="AGENT_ROUTE_MISSING"),
    ErrorCode.PROVISION_FAILED: LocalFault("provision_push"),
    ErrorCode.ARTIFACT_HASH_MISMATCH: ArtifactCheck("ab" * 32, "cd" * 32),
    ErrorCode.PREFLIGHT_AUTH: PreflightFailure("auth"),
    ErrorCode.PREFLIGHT_ARCH: PreflightFailure("arch"),
    ErrorCode.PREFLIGHT_BIN_DIR: PreflightFailure("bin_dir"),
    ErrorCode.PREFLIGHT_DISK_SPACE: PreflightFailure("disk_space"),
    ErrorCode.PREFLIGHT_WRITE_TEST: PreflightFailure("write_test"),
    ErrorCode.PREFLIGHT_AGENT: PreflightFailure("agent"),
    ErrorCode.PREFLIGHT_ARTIFACTS: PreflightFailure("artifacts"),
    ErrorCode.PREFLIGHT_TUNNEL_OWNER: PreflightFailure("tunnel_owner"),
    ErrorCode.PREFLIGHT_FORWARDS: PreflightFailure("forwards"),
    ErrorCode.PREFLIGHT_REMOTE_CONFIG: PreflightFailure("remote_config"),
    ErrorCode.COPY_INCOMPLETE: CopyVerification(expected_files=10, verified_files=9),
    ErrorCode.HEALTHCHECK_TIMEOUT: HealthObservation(
        uptime_s=1.0, min_uptime_s=3.0, running=True, probe_ok=False, waited_s=30, deadline_s=30
    ),
    ErrorCode.DESTINATION_CONFLICT: AgentReply(status=409),
    ErrorCode.LEASE_EXPIRED: AgentReply(status=410),
    ErrorCode.CONFIG_CORRUPT: LocalFault("custom_config_unparsable"),
    ErrorCode.CONFIG_INVALID: LocalFault("monitord_toml_invalid"),
    ErrorCode.DATA_NOT_NEWEST: LocalFault("start_on_stale_data"),
    ErrorCode.ROLLBACK_DATA_UNREACHABLE: LocalFault("rollback_data_unreachable"),
    ErrorCode.DAEMON_UNREACHABLE: LocalFault("daemon_api_silent"),
    ErrorCode.AREA_ID_INVALID: LocalFault("area_entry_bad_name"),
    ErrorCode.INTERNAL: LocalFault("unexpected_exception"),
    ErrorCode.AREA_ENTRY_INVALID: LocalFault("area_entry_bad_field"),
    ErrorCode.CLEANUP_STUCK: CleanupOverdue(attempts=40),
    ErrorCode.DUPLICATE_INSTANCE: LocalFault("instance_lock_held"),
    ErrorCode.STORE_WRITE_FAILED: LocalFault("store_write"),
    ErrorCode.BAD_REQUEST: RequestRefusal("bad_json"),
    ErrorCode.UNKNOWN_SERVICE: RequestRefusal("unknown_service"),
    ErrorCode.UNKNOWN_AREA: RequestRefusal("unknown_area"),
    ErrorCode.DRAINING: RequestRefusal("draining"),
    ErrorCode.TRANSACTION_CONFLICT: RequestRefusal("transaction_conflict"),
    ErrorCode.DAEMON_START_FAILED: DaemonControl(operation="start", succeeded=False),
    ErrorCode.DAEMON_STOP_FAILED: DaemonControl(operation="stop", succeeded=False),
    ErrorCode.SERVICE_USER_UNKNOWN: LocalFault("service_user_missing"),
}


class TestEveryCodeIsReachable:
    """Each catalogued code is produced by at least one realistic observation."""

    def test_the_realistic_table_covers_the_whole_catalogue(self) -> None:
        assert set(REALISTIC) == set(errors.CATALOGUE)

    @pytest.mark.parametrize("code", list(ErrorCode), ids=str)
    def test_observation_classifies_to_its_code(self, code: ErrorCode) -> None:
        assert classify.classify(REALISTIC[code]) == code


class TestHealthyObservationsAreNotErrors:
    """Observations that show success classify to no code at all."""

    @pytest.mark.parametrize(
        "observation",
        [
            AgentReply(status=200),
            CopyVerification(expected_files=3, verified_files=3),
            ArtifactCheck("ab" * 32, "ab" * 32),
            DaemonControl(operation="stop", succeeded=True),
            HealthObservation(uptime_s=5, min_uptime_s=3, running=True),
            HealthObservation(uptime_s=1, min_uptime_s=3, running=True, waited_s=1, deadline_s=9),
        ],
        ids=repr,
    )
    def test_success_has_no_code(self, observation: Observation) -> None:
        assert classify.classify(observation) is None


class TestAgentReplies:
    """Agent replies prefer the agent's own error code, then fall back to the HTTP status."""

    def test_agent_error_code_wins_over_status(self) -> None:
        assert classify.classify(AgentReply(status=409, error_code="LEASE_EXPIRED")) == (
            ErrorCode.LEASE_EXPIRED
        )

    def test_unknown_agent_error_code_falls_back_to_status(self) -> None:
        assert classify.classify(AgentReply(status=503, error_code="FROM_THE_FUTURE")) == (
            ErrorCode.AGENT_UNREACHABLE
        )

    def test_a_copy_with_a_mismatched_file_is_incomplete(self) -> None:
        seen = CopyVerification(expected_files=3, verified_files=3, mismatched_files=1)
        assert classify.classify(seen) == ErrorCode.COPY_INCOMPLETE

    def test_a_dead_destination_is_a_failed_start(self) -> None:
        seen = HealthObservation(uptime_s=0, min_uptime_s=3, running=False)
        assert classify.classify(seen) == ErrorCode.DAEMON_START_FAILED


class TestUnknownObservations:
    """An observation kind nobody catalogued is a loud programming error, not a guess."""

    def test_unknown_ssh_kind_raises(self) -> None:
        with pytest.raises(classify.UnclassifiedObservation):
            classify.classify(SshFailure("cosmic_ray"))


class TestCatalogue:
    """Every code has a severity, operator text and a safe action; errors carry their code."""

    @pytest.mark.parametrize("code", list(ErrorCode), ids=str)
    def test_every_code_has_text_and_action(self, code: ErrorCode) -> None:
        entry = errors.lookup(code)
        assert entry.code == code
        assert entry.text.strip() and entry.action.strip()
        assert entry.text.endswith(".") and entry.action.endswith(".")

    def test_lookup_of_an_uncatalogued_code_raises(self) -> None:
        with pytest.raises(errors.UnknownErrorCode):
            errors.lookup("NOT_A_CODE")

    def test_error_for_picks_transient_for_retryable_codes(self) -> None:
        error = errors.error_for("SSH_TIMEOUT", "keepalive", delay=2.0)
        assert isinstance(error, errors.TransientError)
        assert error.delay == 2.0 and error.retryable

    def test_error_for_picks_permanent_for_operator_codes(self) -> None:
        error = errors.error_for("HOST_KEY_MISMATCH", "vps.example.net")
        assert isinstance(error, errors.PermanentError)
        assert not error.retryable
        assert str(error) == "HOST_KEY_MISMATCH: vps.example.net"

    def test_an_error_cannot_carry_an_uncatalogued_code(self) -> None:
        with pytest.raises(errors.UnknownErrorCode):
            errors.MonitordError("TYPO_CODE", "x")
