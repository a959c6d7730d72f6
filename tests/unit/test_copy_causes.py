"""A copy's failures are named by cause and side (monitord/remote/copy, ssh_errors): an SFTP
status that names a full disk or a refused path, a local errno (a real ENOSPC from
/dev/full), a name too long for the VPS — never SSH_UNREACHABLE; a lost link stays one."""

from __future__ import annotations

import errno
from pathlib import Path

import asyncssh
import pytest

from monitord.remote import ssh_errors
from monitord.remote.copy import local_tree, transfer
from orchestrator.errors import ErrorCode, MonitordError


class TestSftpStatusesByCause:
    """Statuses that name a cause on the VPS map to it; the rest name none."""

    @pytest.mark.parametrize(("error", "code"), [
        (asyncssh.SFTPNoSpaceOnFilesystem("full"), ErrorCode.REMOTE_DISK_FULL),
        (asyncssh.SFTPQuotaExceeded("quota"), ErrorCode.REMOTE_DISK_FULL),
        (asyncssh.SFTPPermissionDenied("denied"), ErrorCode.REMOTE_PERMISSION_DENIED),
        (asyncssh.SFTPWriteProtect("ro"), ErrorCode.REMOTE_PERMISSION_DENIED),
        (asyncssh.SFTPFailure("Failure"), None),  # OpenSSH's answer to ENOSPC: asked after
        (asyncssh.SFTPConnectionLost("lost"), None),
    ])
    def test_sftp_cause(self, error: Exception, code: ErrorCode | None) -> None:
        assert ssh_errors.sftp_cause(error) is code

    def test_a_refusal_is_an_answer_a_lost_link_is_not(self) -> None:
        assert ssh_errors.is_sftp_refusal(asyncssh.SFTPFailure("Failure"))
        assert not ssh_errors.is_sftp_refusal(asyncssh.SFTPConnectionLost("lost"))
        assert not ssh_errors.is_sftp_refusal(OSError(errno.ENOSPC, "full"))
        assert not ssh_errors.is_sftp_refusal(None)

    @pytest.mark.parametrize(("error", "code"), [
        (asyncssh.SFTPNoSpaceOnFilesystem("full"), ErrorCode.REMOTE_DISK_FULL),
        (asyncssh.SFTPPermissionDenied("denied"), ErrorCode.REMOTE_PERMISSION_DENIED),
        (asyncssh.SFTPConnectionLost("lost"), ErrorCode.SSH_UNREACHABLE),
        (TimeoutError(), ErrorCode.COPY_INCOMPLETE),
    ])
    def test_a_transfer_names_the_status_s_cause(self, error: Exception,
                                                 code: ErrorCode) -> None:
        with pytest.raises(MonitordError) as caught, \
                transfer._sftp_translated("upload to /d", timeout_s=1.0):
            raise error
        assert caught.value.code is code
        assert caught.value.__cause__ is error


class TestLocalErrors:
    """A file system error on the PBX is named by its errno, with the free space found."""

    def test_a_real_enospc_while_writing_a_fetched_file_is_local_disk_full(self) -> None:
        with open("/dev/full", "wb", buffering=0) as out, \
                pytest.raises(MonitordError) as caught:
            transfer._write_local(out, b"x" * 4096, path=Path("/dev/full"))
        assert caught.value.code is ErrorCode.LOCAL_DISK_FULL
        assert caught.value.detail.startswith("download: /dev/full: No space left on device")
        assert "PBX: " in caught.value.detail and "bytes free" in caught.value.detail
        assert caught.value.facts["side"] == "PBX"

    @pytest.mark.parametrize(("number", "code"), [
        (errno.EDQUOT, ErrorCode.LOCAL_DISK_FULL),
        (errno.EACCES, ErrorCode.LOCAL_PERMISSION_DENIED),
        (errno.ENAMETOOLONG, ErrorCode.NAME_TOO_LONG),
        (errno.EIO, ErrorCode.COPY_INCOMPLETE),
    ])
    def test_by_errno(self, number: int, code: ErrorCode, tmp_path: Path) -> None:
        error = OSError(number, "x", str(tmp_path / "f"))
        assert local_tree.local_file_error(error, during="download").code is code

    def test_a_name_too_long_here_is_named_a_file_in_the_way_refused(self, tmp_path: Path) -> None:
        root = tmp_path / "staging"
        root.mkdir()
        (root / "sub").write_text("a file where a directory is wanted")
        with pytest.raises(MonitordError) as caught:
            local_tree.create_inside(root, "sub/x")
        assert caught.value.code is ErrorCode.COPY_INCOMPLETE  # no cause to fix: refused
        long_name = "n" * 300
        with pytest.raises(MonitordError) as caught:
            local_tree.create_inside(root, long_name)
        assert caught.value.code is ErrorCode.NAME_TOO_LONG


class TestNamesTooLongForTheVps:
    """A component over 255 bytes or a path over 4095 is refused before anything is sent."""

    def test_limits(self) -> None:
        assert transfer.name_too_long("/d/" + "a" * 255) is None
        assert transfer.name_too_long("/d/" + "a" * 256) is not None
        assert transfer.name_too_long("/d/" + "é" * 128) is not None  # 256 bytes in UTF-8
        assert transfer.name_too_long("/" + "/".join(["a" * 200] * 21)) is not None

    def test_the_check_names_the_file(self) -> None:
        with pytest.raises(MonitordError) as caught:
            transfer._check_names("/opt/data/tg/area", ["ok", "x" * 300])
        assert caught.value.code is ErrorCode.NAME_TOO_LONG
        assert caught.value.detail.startswith("VPS: cannot create 'xxx")


class TestTheAgentNamesItsCopyStepErrors:
    """The agent's copy steps (staging reset, listing, promote) answer a file system error
    by its cause on the VPS, with the free space for a full disk; else COPY_INCOMPLETE."""

    @pytest.mark.parametrize(("number", "code"), [
        (errno.ENOSPC, "REMOTE_DISK_FULL"),
        (errno.EDQUOT, "REMOTE_DISK_FULL"),
        (errno.EACCES, "REMOTE_PERMISSION_DENIED"),
        (errno.ENAMETOOLONG, "NAME_TOO_LONG"),
        (errno.EIO, "COPY_INCOMPLETE"),
    ])
    def test_by_errno(self, number: int, code: str, tmp_path: Path) -> None:
        from monitord.vps.runtime import copy_step_error

        error = copy_step_error(OSError(number, "x", str(tmp_path / "d.staging" / "f")),
                                area="a1", doing="reset the staging dir", path=tmp_path / "d")
        assert (error.code, error.status) == (code, 500)
        assert error.detail.startswith("area a1: cannot reset the staging dir: x (")
        if code == "REMOTE_DISK_FULL":
            assert f"VPS: {tmp_path} has " in error.detail and "bytes free" in error.detail
