"""monitord/remote/ssh_errors.py: every asyncssh/OS exception becomes the catalogue code the
adapters have always raised, with the cause chained; and no other module of monitord/remote
names an asyncssh exception class. Real asyncssh exception instances, no network."""

from __future__ import annotations

import ast
import asyncio
import errno
from pathlib import Path

import asyncssh
import pytest

from monitord.remote import ssh_errors
from orchestrator.errors import (
    ErrorCode,
    MonitordError,
    PermanentError,
    TransientError,
    lookup,
)

REMOTE_DIR = Path(__file__).resolve().parents[2] / "monitord" / "remote"
DURING = "doing something"


def _process_error(cls: type[asyncssh.ProcessError] = asyncssh.ProcessError
                   ) -> asyncssh.ProcessError:
    return cls(env=None, command="/bin/false", subsystem=None, exit_status=1, exit_signal=None,
               returncode=1, stdout=b"", stderr=b"boom", reason="exited with 1")


def _assert_typed(error: MonitordError, code: ErrorCode) -> None:
    """The code, and the subclass the catalogue gives it (retryability never drifts)."""
    assert error.code is code, (error.code, error.detail)
    expected = TransientError if lookup(code).retryable else PermanentError
    assert type(error) is expected, (type(error), code)
    assert error.detail.startswith(DURING), error.detail


# (exception, code when the caller's default is PROVISION_FAILED). PROVISION_FAILED is used
# as the caller's code so that "kept the caller's code" and "the exception decided" differ.
TABLE: list[tuple[BaseException, ErrorCode]] = [
    (TimeoutError(), ErrorCode.SSH_TIMEOUT),  # asyncio.TimeoutError is the same class
    (_process_error(asyncssh.TimeoutError), ErrorCode.SSH_TIMEOUT),
    (asyncssh.PermissionDenied("no more auth methods"), ErrorCode.AUTH_FAILED),
    (asyncssh.KeyImportError("invalid private key"), ErrorCode.AUTH_FAILED),
    (asyncssh.KeyEncryptionError("passphrase required"), ErrorCode.AUTH_FAILED),
    (asyncssh.HostKeyNotVerifiable("host key mismatch"), ErrorCode.HOST_KEY_MISMATCH),
    (asyncssh.ChannelListenError("tcpip-forward denied"), ErrorCode.FORWARD_DENIED),
    (asyncssh.SFTPConnectionLost("connection lost"), ErrorCode.SSH_UNREACHABLE),
    (asyncssh.SFTPNoConnection("no connection"), ErrorCode.SSH_UNREACHABLE),
    (asyncssh.SFTPNoSuchFile("no such file"), ErrorCode.PROVISION_FAILED),
    (asyncssh.SFTPPermissionDenied("permission denied"), ErrorCode.PROVISION_FAILED),
    (asyncssh.SFTPFailure("failure"), ErrorCode.PROVISION_FAILED),
    (asyncssh.SFTPNoSpaceOnFilesystem("disk full"), ErrorCode.PROVISION_FAILED),
    (_process_error(), ErrorCode.PROVISION_FAILED),
    (asyncssh.DisconnectError(asyncssh.DISC_BY_APPLICATION, "bye"), ErrorCode.SSH_UNREACHABLE),
    (asyncssh.ConnectionLost("keepalive timeout"), ErrorCode.SSH_UNREACHABLE),
    (asyncssh.ProtocolError("bad packet"), ErrorCode.SSH_UNREACHABLE),
    (asyncssh.KeyExchangeFailed("no matching kex"), ErrorCode.SSH_UNREACHABLE),
    (asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, "Connection refused"),
     ErrorCode.SSH_UNREACHABLE),
    (asyncssh.Error(0, "generic"), ErrorCode.SSH_UNREACHABLE),
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), ErrorCode.SSH_UNREACHABLE),
    (OSError(errno.ENETUNREACH, "Network is unreachable"), ErrorCode.SSH_UNREACHABLE),
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), ErrorCode.SSH_UNREACHABLE),
    (FileNotFoundError(errno.ENOENT, "No such file", "/local/file"), ErrorCode.SSH_UNREACHABLE),
    (ValueError("not an SSH failure"), ErrorCode.PROVISION_FAILED),
]


class TestTranslate:
    """The module table, row by row."""

    @pytest.mark.parametrize(
        ("error", "code"), TABLE, ids=[type(e).__name__ + f"-{i}" for i, (e, _) in
                                       enumerate(TABLE)]
    )
    def test_each_exception_gets_its_code(self, error: BaseException, code: ErrorCode) -> None:
        translated = ssh_errors.translate(error, code=ErrorCode.PROVISION_FAILED, during=DURING)
        _assert_typed(translated, code)

    @pytest.mark.parametrize(("error", "code"), TABLE)
    def test_with_ssh_unreachable_as_the_default_everything_but_specifics_is_unreachable(
        self, error: BaseException, code: ErrorCode
    ) -> None:
        """What remote_exec, the lease helper, the forwards and the copy pass."""
        translated = ssh_errors.translate(error, code=ErrorCode.SSH_UNREACHABLE, during=DURING)
        expected = ErrorCode.SSH_UNREACHABLE if code is ErrorCode.PROVISION_FAILED else code
        _assert_typed(translated, expected)

    def test_the_caller_names_what_running_out_of_time_means(self) -> None:
        """The copy: a transfer that does not finish is COPY_INCOMPLETE, not SSH_TIMEOUT."""
        translated = ssh_errors.translate(
            TimeoutError(), code=ErrorCode.SSH_UNREACHABLE, during=DURING,
            timeout_code=ErrorCode.COPY_INCOMPLETE, timeout_s=600.0,
        )
        _assert_typed(translated, ErrorCode.COPY_INCOMPLETE)
        assert "600 s" in translated.detail

    def test_the_timeout_code_is_only_for_timeouts(self) -> None:
        translated = ssh_errors.translate(
            asyncssh.ConnectionLost("gone"), code=ErrorCode.SSH_UNREACHABLE, during=DURING,
            timeout_code=ErrorCode.COPY_INCOMPLETE,
        )
        _assert_typed(translated, ErrorCode.SSH_UNREACHABLE)

    def test_the_detail_names_the_step_the_type_and_asyncssh_reason(self) -> None:
        translated = ssh_errors.translate(
            asyncssh.SFTPNoSuchFile("/opt/offload/x: not there"), code=ErrorCode.PROVISION_FAILED,
            during="upload x",
        )
        assert translated.detail == "upload x: SFTPNoSuchFile: /opt/offload/x: not there"


class TestTranslateConnect:
    """Connecting (and the keeper's step that prepares the VPS): the keeper's codes and texts."""

    WHERE = "offload@vps:22"

    @pytest.mark.parametrize(
        ("error", "code", "detail"),
        [
            (asyncssh.PermissionDenied("x"), ErrorCode.AUTH_FAILED, "the server refused our key"),
            (asyncssh.HostKeyNotVerifiable("x"), ErrorCode.HOST_KEY_MISMATCH,
             "host key does not match known_hosts"),
            (asyncssh.KeyImportError("x"), ErrorCode.AUTH_FAILED, "the key file cannot be used"),
            (asyncssh.KeyEncryptionError("x"), ErrorCode.AUTH_FAILED,
             "the key file cannot be used"),
            (FileNotFoundError(errno.ENOENT, "No such file", "/etc/monitord/id"),
             ErrorCode.AUTH_FAILED, "cannot read /etc/monitord/id"),
            (PermissionError(errno.EACCES, "Permission denied", "/etc/monitord/id"),
             ErrorCode.AUTH_FAILED, "cannot read /etc/monitord/id"),
            (IsADirectoryError(errno.EISDIR, "Is a directory", "/etc/monitord"),
             ErrorCode.AUTH_FAILED, "cannot read /etc/monitord"),
            (TimeoutError(), ErrorCode.SSH_TIMEOUT, "no answer in time"),
            (asyncssh.ConnectionLost("reset"), ErrorCode.SSH_UNREACHABLE, "ConnectionLost: reset"),
            (asyncssh.ProtocolError("bad banner"), ErrorCode.SSH_UNREACHABLE,
             "ProtocolError: bad banner"),
            (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
             ErrorCode.SSH_UNREACHABLE, "Connection refused"),
            (OSError(errno.EHOSTUNREACH, "No route to host"), ErrorCode.SSH_UNREACHABLE,
             "No route to host"),
            (OSError(), ErrorCode.SSH_UNREACHABLE, "OSError"),
            (ValueError("bad option"), ErrorCode.SSH_UNREACHABLE, "ValueError"),
        ],
    )
    def test_connect_failures(self, error: BaseException, code: ErrorCode, detail: str) -> None:
        translated = ssh_errors.translate_connect(error, during=self.WHERE)
        assert translated.code is code
        assert translated.retryable is lookup(code).retryable
        assert translated.detail == f"{self.WHERE}: {detail}"

    def test_every_connect_error_type_is_caught(self) -> None:
        for error in (asyncssh.KeyImportError("x"), ValueError("x"), TimeoutError(),
                      asyncssh.PermissionDenied("x"), OSError()):
            assert isinstance(error, ssh_errors.CONNECT_ERRORS)


class TestTranslateLocalListen:
    """Binding a local forward's port on this machine."""

    def test_a_port_in_use_is_port_occupied_with_the_callers_delay(self) -> None:
        error = OSError(errno.EADDRINUSE, "Address already in use")
        translated = ssh_errors.translate_local_listen(error, during=DURING, delay=30.0)
        _assert_typed(translated, ErrorCode.PORT_OCCUPIED)
        assert isinstance(translated, TransientError) and translated.delay == 30.0

    def test_any_other_bind_failure_is_forward_denied(self) -> None:
        error = PermissionError(errno.EACCES, "Permission denied")
        translated = ssh_errors.translate_local_listen(error, during=DURING, delay=30.0)
        _assert_typed(translated, ErrorCode.FORWARD_DENIED)
        assert "Permission denied" in translated.detail


class TestTranslated:
    """The context manager raises the translation from the original exception."""

    def test_the_cause_is_chained(self) -> None:
        original = asyncssh.ConnectionLost("keepalive timeout")
        with pytest.raises(TransientError) as caught,  \
                ssh_errors.translated(code=ErrorCode.SSH_UNREACHABLE, during=DURING):
            raise original
        assert caught.value.code is ErrorCode.SSH_UNREACHABLE
        assert caught.value.__cause__ is original
        assert "keepalive timeout" in caught.value.detail

    def test_a_refused_sftp_request_keeps_the_callers_code(self) -> None:
        original = asyncssh.SFTPPermissionDenied("denied")
        with pytest.raises(TransientError) as caught, \
                ssh_errors.translated(code=ErrorCode.PROVISION_FAILED, during=DURING):
            raise original
        assert caught.value.code is ErrorCode.PROVISION_FAILED
        assert caught.value.__cause__ is original

    def test_a_permanent_code_comes_out_permanent(self) -> None:
        original = asyncssh.PermissionDenied("no more auth methods")
        with pytest.raises(PermanentError) as caught, \
                ssh_errors.translated(code=ErrorCode.SSH_UNREACHABLE, during=DURING):
            raise original
        assert caught.value.code is ErrorCode.AUTH_FAILED
        assert caught.value.__cause__ is original

    async def test_an_asyncio_timeout_inside_is_the_timeout_code(self) -> None:
        with pytest.raises(TransientError) as caught, ssh_errors.translated(
            code=ErrorCode.SSH_UNREACHABLE, during=DURING, timeout_s=0.01
        ):
            async with asyncio.timeout(0.01):
                await asyncio.sleep(10)
        assert caught.value.code is ErrorCode.SSH_TIMEOUT
        assert isinstance(caught.value.__cause__, TimeoutError)
        assert "0.01 s" in caught.value.detail

    def test_our_own_errors_and_foreign_bugs_pass_unchanged(self) -> None:
        ours = PermanentError(ErrorCode.BAD_REQUEST, "already typed")
        with pytest.raises(PermanentError) as caught, \
                ssh_errors.translated(code=ErrorCode.SSH_UNREACHABLE, during=DURING):
            raise ours
        assert caught.value is ours
        with pytest.raises(KeyError), \
                ssh_errors.translated(code=ErrorCode.SSH_UNREACHABLE, during=DURING):
            raise KeyError("a bug, not an SSH failure")

    def test_nothing_raised_nothing_changed(self) -> None:
        with ssh_errors.translated(code=ErrorCode.SSH_UNREACHABLE, during=DURING):
            value = 1
        assert value == 1


class TestHelpers:
    """Facts only an asyncssh exception carries, asked without naming asyncssh."""

    def test_a_refused_tcpip_forward_is_a_denied_forward(self) -> None:
        assert ssh_errors.is_forward_denied(asyncssh.ChannelListenError("denied"))
        assert not ssh_errors.is_forward_denied(
            asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, "refused")
        )
        assert not ssh_errors.is_forward_denied(OSError())

    def test_a_refused_channel_gives_the_servers_reason(self) -> None:
        for code in (asyncssh.OPEN_CONNECT_FAILED, asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED):
            refused = asyncssh.ChannelOpenError(code, "Connection refused")
            assert ssh_errors.channel_refusal(refused) == "Connection refused"
        assert ssh_errors.channel_refusal(asyncssh.ConnectionLost("gone")) is None
        assert ssh_errors.channel_refusal(ConnectionRefusedError()) is None
        assert ssh_errors.channel_refusal(asyncssh.ChannelListenError("denied")) is None

    def test_the_sftp_tuples_catch_what_their_names_say(self) -> None:
        assert isinstance(asyncssh.SFTPNoSuchFile("x"), ssh_errors.SFTP_NO_SUCH_FILE)
        assert not isinstance(asyncssh.SFTPFailure("x"), ssh_errors.SFTP_NO_SUCH_FILE)
        assert isinstance(asyncssh.SFTPOpUnsupported("x"), ssh_errors.SFTP_OP_UNSUPPORTED)
        assert isinstance(asyncssh.SFTPConnectionLost("x"), ssh_errors.SFTP_ERRORS)
        assert not isinstance(asyncssh.ConnectionLost("x"), ssh_errors.SFTP_ERRORS)

    @pytest.mark.parametrize(("error", "_code"), TABLE[:-1])  # all but the foreign ValueError
    def test_ssh_errors_catches_every_ssh_failure(
        self, error: BaseException, _code: ErrorCode
    ) -> None:
        """Key errors are ValueErrors that only asyncssh.connect() raises: CONNECT_ERRORS."""
        assert isinstance(error, ssh_errors.CONNECT_ERRORS)
        if not isinstance(error, ValueError):
            assert isinstance(error, ssh_errors.SSH_ERRORS)

    def test_ssh_errors_does_not_catch_our_own_errors_or_cancellation(self) -> None:
        assert not isinstance(TransientError(ErrorCode.SSH_UNREACHABLE), ssh_errors.SSH_ERRORS)
        assert not isinstance(asyncio.CancelledError(), ssh_errors.SSH_ERRORS)

    def test_describe(self) -> None:
        assert ssh_errors.describe(asyncssh.ConnectionLost("reset")) == "ConnectionLost: reset"
        assert ssh_errors.describe(OSError()) == "OSError"


def _asyncssh_exception_names() -> set[str]:
    return {
        name for name in dir(asyncssh)
        if isinstance(getattr(asyncssh, name), type)
        and issubclass(getattr(asyncssh, name), BaseException)
    }


def test_no_other_remote_module_names_an_asyncssh_exception() -> None:
    """The one-module rule: `asyncssh.<SomeError>` appears in ssh_errors.py only."""
    names = _asyncssh_exception_names()
    assert {"Error", "ChannelListenError", "SFTPNoSuchFile"} <= names
    offenders = []
    for path in sorted(REMOTE_DIR.rglob("*.py")):
        if path.name == "ssh_errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "asyncssh" and node.attr in names):
                offenders.append(f"{path.relative_to(REMOTE_DIR)}:{node.lineno} {node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == "asyncssh":
                offenders.extend(f"{path.relative_to(REMOTE_DIR)}:{node.lineno} {a.name}"
                                 for a in node.names if a.name in names)
    assert offenders == []
