"""The one place that knows asyncssh's exception types: SSH failures become catalogue errors.

Every adapter in `monitord/remote/` that talks SSH (the tunnel keeper, its forwards and
lease helper, remote_exec, the copy, provisioning) catches `SSH_ERRORS` around an SSH
operation and hands the exception here, or wraps the operation in
`with ssh_errors.translated(code=..., during=...):`, which re-raises `... from e`. Nothing
outside this module names an asyncssh exception class; code that needs a fact only an
asyncssh exception carries asks a helper below (`is_forward_denied`, `channel_refusal`).

`translate(e, code=..., during=...)` picks the code (orchestrator/errors.py decides whether
that is a TransientError or a PermanentError):

    exception                                         code
    TimeoutError (asyncio's, asyncssh's)               timeout_code (default SSH_TIMEOUT)
    PermissionDenied                                   AUTH_FAILED
    KeyImportError, KeyEncryptionError                 AUTH_FAILED
    HostKeyNotVerifiable                               HOST_KEY_MISMATCH
    ChannelListenError (tcpip-forward refused)         FORWARD_DENIED
    SFTPConnectionLost, SFTPNoConnection               SSH_UNREACHABLE
    any other SFTPError (the server refused a request) the caller's `code`
    ProcessError (a remote process failed)             the caller's `code`
    DisconnectError, ConnectionLost, ChannelOpenError,
      any other asyncssh.Error                         SSH_UNREACHABLE
    OSError (refused, reset, unreachable, local I/O)   SSH_UNREACHABLE
    anything else                                      the caller's `code`

Two situations read some exceptions differently and have their own function:
`translate_connect` (while connecting, a local file error means the key or known_hosts
file cannot be read: AUTH_FAILED) and `translate_local_listen` (binding a local forward's
port on this machine: EADDRINUSE is PORT_OCCUPIED, any other OSError FORWARD_DENIED).
`translate_ssh_config` reads asyncssh's failures to load `remote.ssh_config` (CONFIG_INVALID).

The detail is always `"{during}: {what happened}"`, with asyncssh's `reason` where the
exception has one.

An area copy names a refused SFTP request by its cause where the status names one
(`sftp_cause`: SFTPNoSpaceOnFilesystem, SFTPQuotaExceeded -> REMOTE_DISK_FULL;
SFTPPermissionDenied, SFTPWriteProtect -> REMOTE_PERMISSION_DENIED).

OpenSSH's sftp-server answers ENOSPC and EDQUOT with the bare SSH2_FX_FAILURE ("Failure")
and ENAMETOOLONG with SSH2_FX_BAD_MESSAGE: the status alone does not name the cause. The
copy asks the VPS's free space then (`statvfs`, the statvfs@openssh.com extension) and
names it by the numbers (monitord.remote.copy.transfer).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

import asyncssh

from monitord.base import outside_text
from orchestrator.errors import ErrorCode, MonitordError, error_for

# Of a reason kept in a detail: the server sends it (a disconnect's, a refused channel's,
# an SFTP status's), so it is outside text (monitord.base.outside_text).
_REASON_CHARS = 400

# What to catch around an SSH operation (TimeoutError is an OSError; listed for the reader).
# ChannelListenError is not an asyncssh.Error, hence listed on its own.
SSH_ERRORS: tuple[type[Exception], ...] = (
    asyncssh.Error,
    asyncssh.ChannelListenError,
    OSError,
    TimeoutError,
)
# What to catch around asyncssh.connect(): it also raises ValueError for a key or an
# option it cannot use (KeyImportError and KeyEncryptionError are ValueErrors).
CONNECT_ERRORS: tuple[type[Exception], ...] = (*SSH_ERRORS, ValueError)
# SFTP outcomes a caller handles itself instead of translating them.
SFTP_ERRORS: tuple[type[Exception], ...] = (asyncssh.SFTPError,)
SFTP_NO_SUCH_FILE: tuple[type[Exception], ...] = (asyncssh.SFTPNoSuchFile,)
SFTP_OP_UNSUPPORTED: tuple[type[Exception], ...] = (asyncssh.SFTPOpUnsupported,)

_LINK_LOST_SFTP = (asyncssh.SFTPConnectionLost, asyncssh.SFTPNoConnection)
# SFTP statuses that name their cause on the VPS (a v5+ server's; OpenSSH's v3 says less).
_SFTP_CAUSES: tuple[tuple[type[Exception], ErrorCode], ...] = (
    (asyncssh.SFTPNoSpaceOnFilesystem, ErrorCode.REMOTE_DISK_FULL),
    (asyncssh.SFTPQuotaExceeded, ErrorCode.REMOTE_DISK_FULL),
    (asyncssh.SFTPPermissionDenied, ErrorCode.REMOTE_PERMISSION_DENIED),
    (asyncssh.SFTPWriteProtect, ErrorCode.REMOTE_PERMISSION_DENIED),
)
_KEY_UNUSABLE = (asyncssh.KeyImportError, asyncssh.KeyEncryptionError)
_LOCAL_FILE_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError)


def translate(
    error: BaseException,
    *,
    code: str,
    during: str,
    timeout_code: str = ErrorCode.SSH_TIMEOUT,
    timeout_s: float | None = None,
) -> MonitordError:
    """The catalogue error for an SSH failure (see the module table).

    `code` is what the failure means when the exception says nothing more specific (a
    refused SFTP request, a failed remote process); `timeout_code` what running out of
    time means for this operation; `timeout_s`, if given, is named in the detail."""
    if isinstance(error, TimeoutError):
        limit = f"did not finish within {timeout_s:g} s" if timeout_s is not None else (
            "no answer in time"
        )
        return error_for(timeout_code, f"{during}: {limit}")
    if isinstance(error, asyncssh.PermissionDenied):
        return error_for(ErrorCode.AUTH_FAILED, f"{during}: the server refused our key")
    if isinstance(error, asyncssh.HostKeyNotVerifiable):
        return error_for(
            ErrorCode.HOST_KEY_MISMATCH, f"{during}: host key does not match known_hosts"
        )
    if isinstance(error, _KEY_UNUSABLE):
        return error_for(ErrorCode.AUTH_FAILED, f"{during}: the key file cannot be used")
    if isinstance(error, asyncssh.ChannelListenError):
        return error_for(ErrorCode.FORWARD_DENIED, f"{during}: {describe(error)}")
    if isinstance(error, _LINK_LOST_SFTP):
        return error_for(ErrorCode.SSH_UNREACHABLE, f"{during}: {describe(error)}")
    if isinstance(error, asyncssh.SFTPError | asyncssh.ProcessError):
        return error_for(code, f"{during}: {describe(error)}")
    if isinstance(error, asyncssh.Error | OSError):
        return error_for(ErrorCode.SSH_UNREACHABLE, f"{during}: {describe(error)}")
    return error_for(code, f"{during}: {describe(error)}")


def translate_connect(error: BaseException, *, during: str) -> MonitordError:
    """`translate` for asyncssh.connect() (and the keeper's step that prepares the VPS):
    a local file that cannot be read is our key or known_hosts file (AUTH_FAILED); any
    other failure that says nothing more specific is SSH_UNREACHABLE."""
    if isinstance(error, _LOCAL_FILE_ERRORS):
        return error_for(ErrorCode.AUTH_FAILED, f"{during}: cannot read {error.filename}")
    if isinstance(error, (TimeoutError, asyncssh.Error, *_KEY_UNUSABLE)):
        return translate(error, code=ErrorCode.SSH_UNREACHABLE, during=during)
    if isinstance(error, OSError):
        return error_for(
            ErrorCode.SSH_UNREACHABLE, f"{during}: {error.strerror or type(error).__name__}"
        )
    return error_for(ErrorCode.SSH_UNREACHABLE, f"{during}: {type(error).__name__}")


def translate_ssh_config(error: OSError | ValueError, *, path: object) -> MonitordError:
    """`remote.ssh_config` cannot be read (OSError) or parsed (asyncssh's parser raises a
    ValueError naming the file and line): CONFIG_INVALID, whatever the connection."""
    if isinstance(error, OSError):
        why = f"cannot read {path}: {error.strerror or type(error).__name__}"
    else:
        why = str(error) or f"cannot parse {path}"
    return error_for(ErrorCode.CONFIG_INVALID, f"remote.ssh_config: {why}")


def translate_local_listen(
    error: OSError, *, during: str, delay: float | None = None
) -> MonitordError:
    """A local forward's listening socket on THIS machine could not be bound: PORT_OCCUPIED
    (with `delay`) when the port is in use, FORWARD_DENIED otherwise."""
    if error.errno == errno.EADDRINUSE:
        return error_for(
            ErrorCode.PORT_OCCUPIED, f"{during}: the port is in use on this machine",
            delay=delay,
        )
    return error_for(ErrorCode.FORWARD_DENIED, f"{during}: {error.strerror or error}")


@contextlib.contextmanager
def translated(
    *,
    code: str,
    during: str,
    timeout_code: str = ErrorCode.SSH_TIMEOUT,
    timeout_s: float | None = None,
) -> Iterator[None]:
    """`with translated(code=..., during=...):` raises `translate(e, ...) from e` for any of
    SSH_ERRORS raised inside; everything else (MonitordError included) passes unchanged.
    Put it OUTSIDE an `asyncio.timeout()` block so that the block's TimeoutError is seen."""
    try:
        yield
    except SSH_ERRORS as e:
        raise translate(
            e, code=code, during=during, timeout_code=timeout_code, timeout_s=timeout_s
        ) from e


def sftp_cause(error: BaseException) -> ErrorCode | None:
    """The cause an SFTP status names on the VPS (the module table), or None."""
    for kind, code in _SFTP_CAUSES:
        if isinstance(error, kind):
            return code
    return None


def is_sftp_refusal(error: BaseException | None) -> bool:
    """The SFTP server answered a request with a failure status (the link still works);
    False for a lost link and for anything that is not SFTP."""
    return isinstance(error, asyncssh.SFTPError) and not isinstance(error, _LINK_LOST_SFTP)


def is_forward_denied(error: BaseException) -> bool:
    """The server refused a tcpip-forward request (a reverse forward's port): diagnose the
    port holder instead of translating."""
    return isinstance(error, asyncssh.ChannelListenError)


def channel_refusal(error: BaseException) -> str | None:
    """The server's reason when it refused to open a channel (e.g. nothing listens on a
    local forward's target, or forwarding is prohibited); None for any other failure."""
    if isinstance(error, asyncssh.ChannelOpenError):
        return outside_text.clean(error.reason, limit=_REASON_CHARS)
    return None


def describe(error: BaseException) -> str:
    """`Type: reason` for an SSH or OS failure, for error details and logs."""
    name = type(error).__name__
    text = outside_text.clean(error.reason if isinstance(error, asyncssh.Error) else str(error),
                              limit=_REASON_CHARS)
    return f"{name}: {text}" if text else name
