"""orchestrator/disk_space.py: what an area takes once copied, the margin on top, and the
shortage preflight reports (both numbers, bytes before inodes); and
orchestrator/errors.file_error_code: a file system errno named by its cause and side."""

from __future__ import annotations

import errno

import pytest

from orchestrator import disk_space
from orchestrator.disk_space import Free, Usage
from orchestrator.errors import ErrorCode, PermanentError, error_for, file_error_code

MIB = disk_space.MIB


class TestFootprint:
    """Files are counted in whole 4 KiB blocks, a directory takes a block, each an inode."""

    def test_files_round_up_to_blocks_and_directories_add_one(self) -> None:
        usage = disk_space.footprint([0, 1, 4096, 4097], dirs=2)
        assert usage == Usage(bytes=0 + 4096 + 4096 + 8192 + 2 * 4096, inodes=6,
                              content_bytes=0 + 1 + 4096 + 4097)

    def test_an_empty_tree(self) -> None:
        assert disk_space.footprint([]) == Usage(bytes=0, inodes=0, content_bytes=0)


class TestTheMargin:
    """max(64 MiB, 5 %) in bytes, max(1024, 5 %) in inodes."""

    @pytest.mark.parametrize(("area", "margin"), [
        (0, 64 * MIB),
        (40 * MIB, 64 * MIB),
        (1280 * MIB, 64 * MIB),  # 5 % of it is exactly the floor
        (2000 * MIB, 100 * MIB),
    ])
    def test_bytes(self, area: int, margin: int) -> None:
        assert disk_space.needed(Usage(bytes=area)).bytes == area + margin

    def test_inodes(self) -> None:
        assert disk_space.needed(Usage(bytes=0, inodes=10)).inodes == 10 + 1024
        assert disk_space.needed(Usage(bytes=0, inodes=100_000)).inodes == 105_000


class TestShortage:
    """None when the area and the margin fit; else the side, path, needed and free."""

    def test_it_fits_exactly(self) -> None:
        usage = Usage(bytes=40 * MIB, inodes=3)
        want = disk_space.needed(usage)
        assert disk_space.shortage(side="VPS", path="/d", usage=usage,
                                   free=Free(bytes=want.bytes, inodes=want.inodes)) is None

    def test_one_byte_short_names_both_numbers(self) -> None:
        usage = Usage(bytes=40 * MIB)
        want = disk_space.needed(usage).bytes
        short = disk_space.shortage(side="VPS", path="/opt/data/tg", usage=usage,
                                    free=Free(bytes=want - 1))
        assert short is not None
        assert (short.unit, short.needed, short.free, short.missing) == ("bytes", want,
                                                                          want - 1, 1)
        assert short.detail().startswith(
            f"VPS: /opt/data/tg has {want - 1} bytes free (104.0 MiB), the area needs {want}"
            " bytes (104.0 MiB, margin included)")
        assert short.facts() == {"side": "VPS", "path": "/opt/data/tg", "unit": "bytes",
                                 "needed_bytes": want, "free_bytes": want - 1}

    def test_the_issue_s_case_16_mib_free_for_40_mib(self) -> None:
        short = disk_space.shortage(side="VPS", path="/d", usage=Usage(bytes=40 * MIB),
                                    free=Free(bytes=16 * MIB))
        assert short is not None and short.missing == 88 * MIB
        assert short.detail().endswith(": 88.0 MiB missing")

    def test_inodes_short_when_bytes_fit(self) -> None:
        short = disk_space.shortage(side="PBX", path="/d", usage=Usage(bytes=0, inodes=10),
                                    free=Free(bytes=1 << 40, inodes=100, total_inodes=1000))
        assert short is not None and short.unit == "inodes"
        assert (short.needed, short.free) == (1034, 100)
        assert short.facts()["needed_inodes"] == 1034

    def test_a_file_system_without_inode_counts_is_judged_on_bytes(self) -> None:
        assert disk_space.shortage(side="VPS", path="/d", usage=Usage(bytes=0, inodes=10),
                                   free=Free(bytes=1 << 40, inodes=0, total_inodes=0)) is None
        assert disk_space.shortage(side="VPS", path="/d", usage=Usage(bytes=0, inodes=10),
                                   free=Free(bytes=1 << 40)) is None


class TestRanOut:
    """After a bare write failure: the disk ran out when what was left does not fit."""

    def test_what_is_left_does_not_fit(self) -> None:
        short = disk_space.ran_out(side="VPS", path="/s", remaining=Usage(bytes=8192),
                                   free=Free(bytes=4096))
        assert short is not None and not short.with_margin
        assert "the copy still needed 8192 bytes" in short.detail()
        assert "margin" not in short.detail()

    def test_room_left_means_another_cause(self) -> None:
        assert disk_space.ran_out(side="VPS", path="/s", remaining=Usage(bytes=8192),
                                  free=Free(bytes=1 * MIB)) is None

    def test_no_inode_left(self) -> None:
        short = disk_space.ran_out(side="VPS", path="/s", remaining=Usage(bytes=0, inodes=2),
                                   free=Free(bytes=MIB, inodes=0, total_inodes=100))
        assert short is not None and short.unit == "inodes"


class TestFileErrorCode:
    """A file system errno is named by its cause on its side; others name nothing."""

    @pytest.mark.parametrize(("number", "remote", "code"), [
        (errno.ENOSPC, True, ErrorCode.REMOTE_DISK_FULL),
        (errno.EDQUOT, True, ErrorCode.REMOTE_DISK_FULL),
        (errno.ENOSPC, False, ErrorCode.LOCAL_DISK_FULL),
        (errno.EDQUOT, False, ErrorCode.LOCAL_DISK_FULL),
        (errno.EACCES, True, ErrorCode.REMOTE_PERMISSION_DENIED),
        (errno.EPERM, False, ErrorCode.LOCAL_PERMISSION_DENIED),
        (errno.EROFS, False, ErrorCode.LOCAL_PERMISSION_DENIED),
        (errno.ENAMETOOLONG, True, ErrorCode.NAME_TOO_LONG),
        (errno.ENAMETOOLONG, False, ErrorCode.NAME_TOO_LONG),
        (errno.EIO, True, None),
        (errno.ECONNRESET, False, None),
        (None, False, None),
    ])
    def test_table(self, number: int | None, remote: bool, code: ErrorCode | None) -> None:
        assert file_error_code(number, remote=remote) is code

    @pytest.mark.parametrize("code", [
        ErrorCode.PREFLIGHT_DISK_SPACE, ErrorCode.REMOTE_DISK_FULL, ErrorCode.LOCAL_DISK_FULL,
        ErrorCode.REMOTE_PERMISSION_DENIED, ErrorCode.LOCAL_PERMISSION_DENIED,
        ErrorCode.NAME_TOO_LONG,
    ])
    def test_each_cause_is_permanent_and_carries_its_numbers(self, code: ErrorCode) -> None:
        error = error_for(code, "x", facts={"needed_bytes": 2, "free_bytes": 1})
        assert isinstance(error, PermanentError)
        assert dict(error.facts) == {"needed_bytes": 2, "free_bytes": 1}
        assert dict(error_for(code, "x").facts) == {}
