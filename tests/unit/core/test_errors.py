"""The catalogue: every code has a severity, operator text and a safe action; errors carry
their code and the subclass the catalogue gives it. (That every code a client can see is
catalogued, and every catalogued code is produced: tests/unit/test_error_convention.py.)"""

from __future__ import annotations

import pytest

from orchestrator import errors
from orchestrator.errors import ErrorCode


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
