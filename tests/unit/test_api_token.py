"""The API token file (monitord/surface/api_token.py): written once, 0640 for its group,
atomically; kept while it is in order, replaced when it could have leaked or been planted;
compared in constant time; read by the CLI without ever raising."""

from __future__ import annotations

import grp
import hmac
import os
import re
import stat
from pathlib import Path

import pytest

from monitord.base import atomic_file
from monitord.surface import api_token
from orchestrator.errors import ErrorCode

SHAPE = r"[A-Za-z0-9_-]{43}"


def own_group() -> str:
    return grp.getgrgid(os.getegid()).gr_name


def other_group() -> grp.struct_group:
    return next(g for g in grp.getgrall() if g.gr_gid != os.getegid())


class TestEnsure:
    def test_first_start_writes_a_random_token_0640_for_the_group(self, tmp_path: Path) -> None:
        ensured = api_token.ensure(tmp_path, None)
        path = tmp_path / "api-token"
        st = path.lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
        assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())
        assert ensured.written == "missing"
        assert ensured.token.path == path and ensured.token.group == own_group()
        value = ensured.token.value.decode()
        assert path.read_text() == value + "\n"
        assert re.fullmatch(SHAPE, value)
        other = tmp_path / "other"
        other.mkdir()
        assert api_token.ensure(other, None).token.value != ensured.token.value

    def test_the_value_is_never_in_its_repr_or_str(self, tmp_path: Path) -> None:
        token = api_token.ensure(tmp_path, None).token
        value = token.value.decode()
        assert value not in repr(token) and value not in str(token)
        assert value not in repr(api_token.ensure(tmp_path, None))

    def test_a_later_start_keeps_a_file_in_order(self, tmp_path: Path) -> None:
        first = api_token.ensure(tmp_path, None).token
        again = api_token.ensure(tmp_path, None)
        assert again.written is None and again.token.value == first.value
        (tmp_path / "api-token").chmod(0o600)  # narrower is fine: kept, not widened
        kept = api_token.ensure(tmp_path, None)
        assert kept.written is None and kept.token.value == first.value

    def test_the_configured_group_owns_it(self, tmp_path: Path) -> None:
        group = other_group()
        ensured = api_token.ensure(tmp_path, group.gr_name)
        assert (tmp_path / "api-token").stat().st_gid == group.gr_gid
        assert ensured.token.group == group.gr_name
        # The group changed in the config: a new token (the old group may have read it).
        moved = api_token.ensure(tmp_path, None)
        assert moved.written is not None and "group" in moved.written
        assert moved.token.value != ensured.token.value
        assert (tmp_path / "api-token").stat().st_gid == os.getegid()

    def test_an_unknown_group_stops_the_start(self, tmp_path: Path) -> None:
        with pytest.raises(api_token.ApiTokenError) as raised:
            api_token.ensure(tmp_path, "no-such-group-here")
        assert raised.value.code is ErrorCode.DAEMON_START_FAILED
        assert "no-such-group-here" in raised.value.detail
        assert not (tmp_path / "api-token").exists()

    @pytest.mark.parametrize(("spoil", "reason"), [
        (lambda p: p.chmod(0o644), "mode 0644"),
        (lambda p: p.chmod(0o660), "mode 0660"),
        (lambda p: p.chmod(0o740), "mode 0740"),
        (lambda p: p.write_text("short\n"), "not a token"),
        (lambda p: p.write_bytes(b"\xff" * 43), "not a token"),
        (lambda p: p.write_text("A" * 5000), "not a token"),
        (lambda p: os.chown(p, 4242, -1), "owned by uid 4242"),
    ], ids=["0644", "0660", "0740", "short", "binary", "long", "owner"])
    def test_a_file_out_of_order_is_replaced_by_a_new_token(
        self, tmp_path: Path, spoil: object, reason: str
    ) -> None:
        old = api_token.ensure(tmp_path, None).token.value
        path = tmp_path / "api-token"
        path.chmod(0o640)
        spoil(path)  # type: ignore[operator]
        replaced = api_token.ensure(tmp_path, None)
        assert replaced.written is not None and reason in replaced.written
        assert replaced.token.value != old
        st = path.lstat()
        assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_uid == os.geteuid()
        assert path.read_bytes() == replaced.token.value + b"\n"

    def test_a_planted_symlink_is_replaced_and_its_target_untouched(self, tmp_path: Path) -> None:
        target = tmp_path / "elsewhere"
        target.write_text("A" * 43 + "\n")
        target.chmod(0o640)
        (tmp_path / "api-token").symlink_to(target)
        ensured = api_token.ensure(tmp_path, None)
        assert ensured.written is not None and "plain file" in ensured.written
        assert ensured.token.value != b"A" * 43
        assert not (tmp_path / "api-token").is_symlink()
        assert target.read_text() == "A" * 43 + "\n"

    def test_a_fifo_there_is_replaced_without_blocking(self, tmp_path: Path) -> None:
        os.mkfifo(tmp_path / "api-token", 0o640)
        ensured = api_token.ensure(tmp_path, None)
        assert ensured.written == "not a regular file"
        assert (tmp_path / "api-token").is_file()

    def test_the_file_is_0640_before_it_takes_the_name(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        seen: list[tuple[int, int]] = []
        real_replace = os.replace

        def replace(src: str, dst: str) -> None:
            st = os.stat(src)
            seen.append((stat.S_IMODE(st.st_mode), st.st_size))
            real_replace(src, dst)

        monkeypatch.setattr(atomic_file.os, "replace", replace)
        old_umask = os.umask(0)
        try:
            api_token.ensure(tmp_path, None)
        finally:
            os.umask(old_umask)
        assert seen == [(0o640, 44)]


class TestPermits:
    TOKEN = api_token.ApiToken(b"B" * 43, Path("/w/api-token"), "monitord")

    @pytest.mark.parametrize(("header", "ok"), [
        ("Bearer " + "B" * 43, True),
        ("bearer " + "B" * 43, True),
        ("BEARER  " + "B" * 43 + " ", True),
        ("Bearer " + "B" * 42 + "C", False),
        ("Bearer " + "B" * 42, False),
        ("Bearer " + "B" * 44, False),
        ("Bearer ", False),
        ("Bearer", False),
        ("B" * 43, False),
        ("Basic " + "B" * 43, False),
        ("Bearer " + "B" * 42 + "\u00e9", False),
        (None, False),
    ])
    def test_only_the_bearer_token_itself_permits(self, header: str | None, ok: bool) -> None:
        assert api_token.permits(self.TOKEN, header) is ok

    def test_the_comparison_is_hmac_compare_digest(self, monkeypatch: pytest.MonkeyPatch) -> None:
        calls: list[tuple[bytes, bytes]] = []
        real = hmac.compare_digest

        def compare(a: bytes, b: bytes) -> bool:
            calls.append((a, b))
            return real(a, b)

        monkeypatch.setattr(api_token.hmac, "compare_digest", compare)
        assert not api_token.permits(self.TOKEN, "Bearer " + "B" * 42 + "C")
        assert calls == [(b"B" * 42 + b"C", b"B" * 43)]


class TestRead:
    def test_the_cli_reads_what_the_daemon_wrote(self, tmp_path: Path) -> None:
        written = api_token.ensure(tmp_path, None).token.value.decode()
        assert api_token.read(tmp_path) == (written, "")

    def test_a_missing_or_garbled_file_is_a_reason_never_an_exception(
        self, tmp_path: Path
    ) -> None:
        token, why = api_token.read(tmp_path)
        assert token is None and why.startswith(f"cannot read {tmp_path / 'api-token'}")
        (tmp_path / "api-token").mkdir()
        token, why = api_token.read(tmp_path)
        assert token is None and why
        (tmp_path / "api-token").rmdir()
        (tmp_path / "api-token").write_text("not one\n")
        assert api_token.read(tmp_path) == (None, f"{tmp_path / 'api-token'} does not hold an"
                                                  " API token")
