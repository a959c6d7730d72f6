"""The VPS is untrusted input: a hostile listing never writes outside the local staging dir.

Every test plays a VPS whose `sha256sum` listing (the manifest of a remote→local copy) is
crafted: `_LIST`, the remote script the listing comes from, is replaced by one that prints a
file the test wrote next to the remote dir. The remote tree itself is real (files and
symlinks on this machine), served by the in-process SSH server. Each test asserts on the
filesystem: the copy fails with COPY_INCOMPLETE, nothing outside the destination changed,
the previous destination data is intact and no staging dir is left behind.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from monitord.base import tree_digest
from monitord.remote import copy as area_copy
from monitord.remote.copy import listing, local_tree, vps_tree
from monitord.testing.vps_server import VpsServer
from orchestrator.errors import ErrorCode, MonitordError
from tests.support.agent_process import vps_command

PWNED = b"written by a hostile VPS"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _snapshot(root: Path) -> dict[str, str]:
    """Every entry under root: file contents' hash, symlink target, or 'dir'."""
    seen: dict[str, str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if full.is_symlink():
                seen[rel] = "-> " + os.readlink(full)
            elif full.is_dir():
                seen[rel] = "dir"
            else:
                seen[rel] = _sha(full.read_bytes())
    return seen


class Scene:
    """A PBX side (`pbx/`: the area's destination dir with old data, a victim dir beside it)
    and a VPS side (`vps/data/a1`, the remote area dir, with one honest file)."""

    def __init__(self, root: Path) -> None:
        self.pbx = root / "pbx"
        self.local = self.pbx / "areas" / "a1"
        self.staging = tree_digest.staging_dir(self.local)
        self.victim = self.pbx / "areas" / "victim"
        self.remote = root / "vps" / "data" / "a1"
        self.local.mkdir(parents=True)
        (self.local / "keep").write_bytes(b"generation 4")
        self.victim.mkdir()
        (self.victim / "precious").write_bytes(b"not yours")
        self.remote.mkdir(parents=True)
        (self.remote / "session.db").write_bytes(b"honest data")
        # the dir every copy keeps its own dirs in, as an earlier copy leaves it: a refused
        # copy leaves nothing of its own in there
        tree_digest.copy_dir(self.local).parent.mkdir()
        self.before = _snapshot(self.pbx)

    def listing(self, monkeypatch: pytest.MonkeyPatch, text: bytes) -> None:
        """Make the VPS answer the listing request with exactly `text`."""
        Path(str(self.remote) + ".listing").write_bytes(text)
        monkeypatch.setattr(vps_tree, "_LIST", 'cat -- "$1.listing"')

    def honest_line(self) -> bytes:
        return f"{_sha(b'honest data')}  ./session.db\n".encode()

    async def download_fails(self, vps: VpsServer) -> MonitordError:
        async with vps.connect() as conn:
            with pytest.raises(MonitordError) as err:
                await area_copy.download(
                    conn, vps_command=vps_command(),
                    remote_dir=str(self.remote), local_dir=self.local
                )
        return err.value

    def assert_untouched(self) -> None:
        assert _snapshot(self.pbx) == self.before
        assert (self.local / "keep").read_bytes() == b"generation 4"
        assert not self.staging.exists()


@pytest.fixture
async def vps(tmp_path: Path):  # type: ignore[no-untyped-def]
    async with VpsServer(work_dir=tmp_path / "vps-ssh") as server:
        yield server


@pytest.fixture
def scene(tmp_path: Path) -> Scene:
    return Scene(tmp_path)


class TestPathsFromTheListing:
    """Only relative, normalised names strictly inside the destination are accepted."""

    async def test_an_absolute_path_is_refused_before_anything_is_written(
        self, vps: VpsServer, scene: Scene, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        target = scene.victim / "abs_pwned"
        # the VPS serves the file at remote_dir + target, so a naive join fetches it fine
        served = Path(str(scene.remote) + str(target))
        served.parent.mkdir(parents=True)
        served.write_bytes(PWNED)
        scene.listing(monkeypatch, scene.honest_line() + f"{_sha(PWNED)}  {target}\n".encode())
        error = await scene.download_fails(vps)
        assert error.code == ErrorCode.COPY_INCOMPLETE
        assert str(target) in error.detail
        assert not target.exists()
        scene.assert_untouched()

    async def test_a_dot_dot_path_is_refused(
        self, vps: VpsServer, scene: Scene, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        (scene.remote.parent / "escaped").write_bytes(PWNED)  # what remote_dir/../escaped reads
        scene.listing(monkeypatch, scene.honest_line() + f"{_sha(PWNED)}  ./../escaped\n".encode())
        error = await scene.download_fails(vps)
        assert error.code == ErrorCode.COPY_INCOMPLETE
        assert "../escaped" in error.detail
        assert not (scene.local.parent / "escaped").exists()
        scene.assert_untouched()

    @pytest.mark.parametrize(
        "name",
        [
            b"./a/../../escaped",
            b"./a//b",
            b"./a/./b",
            b"./.",
            b"./",
            b"./a/",
            b"./a\x00b",
            b"/",
        ],
    )
    async def test_names_that_are_not_normalised_are_refused(
        self, vps: VpsServer, scene: Scene, monkeypatch: pytest.MonkeyPatch, name: bytes
    ) -> None:
        line = _sha(PWNED).encode() + b"  " + name + b"\n"
        scene.listing(monkeypatch, scene.honest_line() + line)
        error = await scene.download_fails(vps)
        assert error.code == ErrorCode.COPY_INCOMPLETE
        scene.assert_untouched()

    async def test_a_name_listed_twice_is_refused(
        self, vps: VpsServer, scene: Scene, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        scene.listing(monkeypatch, scene.honest_line() * 2)
        error = await scene.download_fails(vps)
        assert error.code == ErrorCode.COPY_INCOMPLETE
        assert "session.db" in error.detail
        scene.assert_untouched()


class TestSymlinksInTheRemoteTree:
    """A symlink on the VPS never becomes a way out of the local staging dir."""

    def _link_out(self, scene: Scene) -> None:
        # relative, so on this one machine it points at the VPS's victim from the remote dir
        # and would point at the PBX's victim if copied as a link into the staging dir
        (scene.remote.parent / "victim").mkdir()
        (scene.remote.parent / "victim" / "pwned").write_bytes(PWNED)
        (scene.remote.parent / "victim" / "precious").write_bytes(PWNED)
        (scene.remote / "link").symlink_to("../victim")

    async def test_a_listed_symlink_and_a_path_through_it_are_refused(
        self, vps: VpsServer, scene: Scene, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self._link_out(scene)
        scene.listing(
            monkeypatch,
            scene.honest_line()
            + f"{_sha(PWNED)}  ./link\n{_sha(PWNED)}  ./link/pwned\n".encode(),
        )
        error = await scene.download_fails(vps)
        assert error.code == ErrorCode.COPY_INCOMPLETE
        assert not (scene.victim / "pwned").exists()
        scene.assert_untouched()

    async def test_a_path_through_a_remote_symlink_is_refused(
        self, vps: VpsServer, scene: Scene, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self._link_out(scene)
        scene.listing(monkeypatch, scene.honest_line() + f"{_sha(PWNED)}  ./link/pwned\n".encode())
        error = await scene.download_fails(vps)
        assert error.code == ErrorCode.COPY_INCOMPLETE
        assert "link/pwned" in error.detail
        scene.assert_untouched()

    async def test_a_listed_symlink_to_a_file_outside_is_refused(
        self, vps: VpsServer, scene: Scene, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self._link_out(scene)
        (scene.remote / "file_link").symlink_to("../victim/precious")
        scene.listing(monkeypatch, scene.honest_line() + f"{_sha(PWNED)}  ./file_link\n".encode())
        error = await scene.download_fails(vps)
        assert error.code == ErrorCode.COPY_INCOMPLETE
        scene.assert_untouched()

    async def test_an_honest_listing_skips_remote_symlinks(
        self, vps: VpsServer, scene: Scene
    ) -> None:
        self._link_out(scene)
        async with vps.connect() as conn:
            report = await area_copy.download(
                conn, vps_command=vps_command(), remote_dir=str(scene.remote), local_dir=scene.local
            )
        assert report.files == 1
        assert _snapshot(scene.local) == {"session.db": _sha(b"honest data")}
        assert _snapshot(scene.victim) == {"precious": _sha(b"not yours")}


class TestTheShapeOfTheListing:
    """A listing too large, or with a line that is not `<64 hex>  <name>`, fails the copy."""

    async def test_a_listing_with_too_many_entries_is_refused(
        self, vps: VpsServer, scene: Scene, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(
            vps_tree,
            "_LIST",
            """awk 'BEGIN { for (i = 0; i < 300000; i++) printf "%064d  ./f%d\\n", 0, i }'""",
        )
        error = await scene.download_fails(vps)
        assert error.code == ErrorCode.COPY_INCOMPLETE
        assert "entries" in error.detail
        scene.assert_untouched()

    async def test_a_listing_with_too_many_bytes_is_refused(
        self, vps: VpsServer, scene: Scene, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # one 100 MB line: the PBX keeps at most the bound in memory, then refuses it
        monkeypatch.setattr(
            vps_tree, "_LIST", "yes 0123456789abcdef | head -c 100000000 | tr -d '\\n'"
        )
        error = await scene.download_fails(vps)
        assert error.code == ErrorCode.COPY_INCOMPLETE
        assert "bytes" in error.detail
        scene.assert_untouched()

    async def test_a_listing_of_deeply_nested_names_is_refused_off_the_event_loop(
        self, vps: VpsServer, scene: Scene, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Lines of 8 KiB `a/a/a/…`: before the limits on names, the parents of each cost
        # 16 MB and a quarter of a second, on the event loop.
        deep = "/".join(["a"] * 4096)
        scene.listing(monkeypatch, b"".join(
            f"{_sha(b'x')}  ./{i}/{deep}\n".encode() for i in range(16)
        ))
        parsed_in: list[int] = []
        parse = listing.parse

        def spied(raw: bytes) -> Any:
            parsed_in.append(threading.get_ident())
            return parse(raw)

        monkeypatch.setattr(listing, "parse", spied)
        error = await scene.download_fails(vps)
        assert error.code == ErrorCode.COPY_INCOMPLETE
        assert "more than 4096" in error.detail, error.detail
        assert parsed_in and threading.get_ident() not in parsed_in
        scene.assert_untouched()

    @pytest.mark.parametrize(
        "line",
        [
            b"not-a-digest  ./session.db\n",
            b"%(sha)s ./session.db\n",  # one space
            b"%(sha)s *./session.db\n",  # binary-mode marker
            b"%(SHA)s  ./session.db\n",  # upper case
            b"%(sha)s0  ./session.db\n",  # 65 digits
            b"%(sha)s  ./session.db",  # no final newline: cut short
            b"\n%(sha)s  ./session.db\n",  # empty line
            b"\\%(sha)s  ./session\\tdb\n",  # an escape sha256sum never writes
            b"\\%(sha)s  ./session.db\\\n",  # a dangling backslash
            b"%(sha)s  ./session.\xffdb\n",  # not UTF-8
            b"%(sha)s  ./session.db\r\n",  # a carriage return in a name
        ],
    )
    async def test_a_malformed_line_is_refused(
        self, vps: VpsServer, scene: Scene, monkeypatch: pytest.MonkeyPatch, line: bytes
    ) -> None:
        sha = _sha(b"honest data")
        scene.listing(monkeypatch, line % {b"sha": sha.encode(), b"SHA": sha.upper().encode()})
        error = await scene.download_fails(vps)
        assert error.code == ErrorCode.COPY_INCOMPLETE
        scene.assert_untouched()


class TestStagingIsNeverFollowed:
    """A symlink found in the local staging dir is never written through."""

    async def test_a_symlink_planted_in_staging_is_not_followed(
        self, vps: VpsServer, scene: Scene, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        (scene.remote / "sub").mkdir()
        (scene.remote / "sub" / "x").write_bytes(PWNED)
        reset = local_tree.reset_dir

        def reset_and_plant(path: Path) -> None:  # something left a link in the fresh staging
            reset(path)
            (path / "sub").symlink_to(scene.victim)

        monkeypatch.setattr(local_tree, "reset_dir", reset_and_plant)
        async with vps.connect() as conn:
            with pytest.raises(MonitordError) as err:
                await area_copy.download(
                    conn, vps_command=vps_command(),
                    remote_dir=str(scene.remote), local_dir=scene.local
                )
        assert err.value.code == ErrorCode.COPY_INCOMPLETE
        assert not (scene.victim / "x").exists()
        assert (scene.local / "keep").read_bytes() == b"generation 4"
