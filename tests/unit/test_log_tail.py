"""An area's log is read back bounded: its last lines (from the rotated file too when the live
one was just started afresh) and, for a follower, what was appended since its position —
across a rotation by the real log sink without losing or repeating a line."""

from __future__ import annotations

import os
from pathlib import Path

from monitord.base import log_sink, log_tail


def numbered(first: int, count: int) -> bytes:
    return b"".join(b"line %06d\n" % i for i in range(first, first + count))


class TestTail:
    def test_the_last_lines_and_the_position_after_them(self, tmp_path: Path) -> None:
        log = tmp_path / "a.log"
        log.write_bytes(numbered(0, 50) + b"partial")
        found = log_tail.tail(str(log), lines=3)
        assert found["data"] == "line 000048\nline 000049\npartial"
        assert (found["file"], found["offset"], found["missing"]) == (
            log.stat().st_ino, log.stat().st_size, False)

    def test_a_fresh_file_is_topped_up_from_the_rotated_one(self, tmp_path: Path) -> None:
        log = tmp_path / "a.log"
        (tmp_path / "a.log.1").write_bytes(numbered(0, 10))
        log.write_bytes(numbered(10, 2))
        assert log_tail.tail(str(log), lines=4)["data"] == (
            "line 000008\nline 000009\nline 000010\nline 000011\n")

    def test_never_more_than_the_byte_bound_and_never_a_cut_line(self, tmp_path: Path) -> None:
        log = tmp_path / "a.log"
        log.write_bytes(numbered(0, 300_000))  # 3.6 MB
        found = log_tail.tail(str(log), lines=log_tail.MAX_LINES * 10, max_bytes=10**9)
        data = found["data"].encode()
        assert len(data) <= log_tail.MAX_BYTES
        assert data.startswith(b"line ") and data.endswith(b"line 299999\n")
        assert len(data.splitlines()) == log_tail.MAX_LINES  # the line bound holds too

    def test_a_missing_log_says_so(self, tmp_path: Path) -> None:
        found = log_tail.tail(str(tmp_path / "none.log"), lines=5)
        assert (found["missing"], found["data"], found["file"]) == (True, "", None)


class TestFollow:
    def test_a_follower_reads_across_the_sinks_rotations_without_loss(
        self, tmp_path: Path
    ) -> None:
        """The real sink rotates under a reader that polls between writes: the lines it
        collects are exactly the lines written, in order."""
        log = tmp_path / "a.log"
        sink = log_sink.RotatingLog(str(log), max_bytes=4096, keep=2)
        position = log_tail.tail(str(log), lines=10)
        collected = position["data"]
        written = 0
        for _ in range(40):  # 40 x 100 lines of 12 bytes: ~12 rotations
            sink.write(numbered(written, 100))
            written += 100
            position = log_tail.read_from(str(log), file=position["file"],
                                          offset=position["offset"])
            collected += position["data"]
            while position["data"]:  # the rest of a rotated file, then the new one
                position = log_tail.read_from(str(log), file=position["file"],
                                              offset=position["offset"])
                collected += position["data"]
        sink.close()
        assert collected.encode() == numbered(0, written)

    def test_a_large_append_comes_in_bounded_whole_line_pieces(self, tmp_path: Path) -> None:
        log = tmp_path / "a.log"
        log.write_bytes(b"")
        ino = log.stat().st_ino
        log.write_bytes(numbered(0, 200_000))  # 2.4 MB, in place
        first = log_tail.read_from(str(log), file=ino, offset=0)
        data = first["data"].encode()
        assert 0 < len(data) <= log_tail.MAX_BYTES and data.endswith(b"\n")
        second = log_tail.read_from(str(log), file=first["file"], offset=first["offset"])
        assert second["data"].startswith("line ")  # continues at a line start
        assert int(second["data"][5:11]) == len(data.splitlines())

    def test_a_file_started_afresh_in_place_is_read_from_its_start(self, tmp_path: Path) -> None:
        log = tmp_path / "a.log"
        log.write_bytes(numbered(0, 100))
        before = log_tail.tail(str(log), lines=1)
        with open(log, "r+b") as f:
            f.truncate(0)
            f.write(b"again\n")
        assert log_tail.read_from(str(log), file=before["file"], offset=before["offset"])[
            "data"] == "again\n"
        os.unlink(log)
        assert log_tail.read_from(str(log), file=before["file"], offset=0)["missing"] is True
