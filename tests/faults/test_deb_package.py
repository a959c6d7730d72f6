"""`make deb`'s package installs offline into a fresh Debian 12 and is usable there.

The package is built once per test run (scripts/deb.py, from requirements.lock) and
installed with `dpkg -i` into a fresh copy (an overlay) of the cached PBX root
(tests/faults/debian_root.pbx_root: Debian 12 with python3 and systemd, nothing of ours),
inside `unshare --mount --net`: no network at all, so everything monitord needs has to come
in the one file. Then the PBX half of docs/install.md runs there, as written: the commands
between its `<!-- pbx-install:begin -->` and `<!-- pbx-install:end -->` markers.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.faults import debian_root

REPO = Path(__file__).resolve().parents[2]
INSTALL_DOC = REPO / "docs" / "install.md"
WANTS_LINK = "/etc/systemd/system/multi-user.target.wants/monitord.service"
DEB_IN_ROOT = "/tmp/monitord.deb"
RUN_TIMEOUT_S = 300.0
# Both cases share the built package (conftest's session-scoped `deb`): one worker builds
# it once (make test: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("deb-package")


@pytest.fixture
def fresh_root(tmp_path: Path) -> tuple[Path, Path]:
    """(the cached PBX root, the overlay's dirs): each test gets its own empty upper layer."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is missing")
    if not debian_root.can_build_pbx_root():  # .ci/run installs mmdebstrap
        pytest.skip("needs mmdebstrap or a built PBX root")
    lower = debian_root.pbx_root()
    for name in ("upper", "work", "merged"):
        (tmp_path / name).mkdir()
    return lower, tmp_path


def in_fresh_root(lower: Path, layers: Path, deb: Path, script: str, *,
                  proc: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `script` (sh -e) as root in a fresh root made of `lower` and an empty upper layer,
    with the deb at DEB_IN_ROOT, in new mount and network namespaces (only `lo`, down);
    without /proc mounted there if not `proc` (how image builders install)."""
    merged = layers / "merged"
    outer = (
        f"mount -t overlay overlay -o lowerdir={lower},upperdir={layers / 'upper'},"
        f"workdir={layers / 'work'} {merged} && "
        + (f"mount -t proc proc {merged}/proc && " if proc else "")
        + f"cp {deb} {merged}{DEB_IN_ROOT} && exec chroot {merged} /bin/sh -ec \"$0\""
    )
    return subprocess.run(["unshare", "--mount", "--net", "sh", "-c", outer, script],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)


def pbx_install_commands() -> list[str]:
    """The shell lines of docs/install.md's PBX install block (between the markers)."""
    text = INSTALL_DOC.read_text()
    block = re.search(r"<!-- pbx-install:begin -->(.*?)<!-- pbx-install:end -->", text, re.S)
    assert block, "docs/install.md has no pbx-install block"
    code = re.findall(r"```sh\n(.*?)```", block.group(1), re.S)
    lines = [line for chunk in code for line in chunk.splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines, "the pbx-install block has no commands"
    return lines


def test_installs_offline_and_passes_its_own_checks(fresh_root: tuple[Path, Path],
                                                    deb: Path) -> None:
    lower, layers = fresh_root
    script = "\n".join([
        "! ip -o link show | grep -v ' lo:'",  # no network but loopback
        f"dpkg -i {DEB_IN_ROOT}",
        "monitord --version",
        "monitord check -c /etc/monitord/monitord.toml",
        # the unit's user reads the same config (a check as root alone can pass where the
        # service then exits 2)
        "runuser -u monitord -- monitord check -c /etc/monitord/monitord.toml",
        "systemd-analyze verify /lib/systemd/system/monitord.service",
        "dpkg-query -W -f='${Conffiles}\\n' monitord",
        "stat -c '%n %U:%G %a' /var/lib/monitord /var/spool/monitord /etc/monitord",
        # an administrator's edit survives a reinstall (the upgrade path of the scripts)
        "echo '# local edit' >> /etc/monitord/monitord.toml",
        f"dpkg -i {DEB_IN_ROOT}",
        "grep -q 'local edit' /etc/monitord/monitord.toml",
        "sed -i '/local edit/d' /etc/monitord/monitord.toml",
        "monitord --version",
        "systemctl enable monitord.service",  # (offline: the link, as on a PBX)
        "dpkg -r monitord",
        "! test -e /usr/lib/monitord",
        "test -e /etc/monitord/monitord.toml",  # a conffile stays until purge
        f"test -L {WANTS_LINK}",  # ... and so does the enablement (a reinstall keeps it)
        "dpkg --purge monitord",
        "! test -e /etc/monitord/monitord.toml",
        f"! test -L {WANTS_LINK}",  # purge leaves no dangling link
    ])
    done = in_fresh_root(lower, layers, deb, script)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    out = done.stdout
    assert re.search(r"^monitord \d+\.\d+\.\d+$", out, re.M), out
    assert out.count("configuration ok: /etc/monitord/monitord.toml") == 2, out
    assert "/etc/monitord/monitord.toml" in out.split("configuration ok")[-1], out
    assert "/var/lib/monitord monitord:monitord 750" in out, out
    assert "/var/spool/monitord monitord:monitord 750" in out, out
    assert "/etc/monitord root:monitord 750" in out, out


def test_installs_in_a_chroot_without_proc(fresh_root: tuple[Path, Path], deb: Path) -> None:
    """An image builder installs into a chroot with no /proc, where systemd-tmpfiles refuses
    to run: the postinst still makes work_dir and spool_dir, as Debian's own snippets do."""
    lower, layers = fresh_root
    script = "\n".join([
        "! test -e /proc/self",
        f"dpkg -i {DEB_IN_ROOT}",
        "stat -c '%n %U:%G %a' /var/lib/monitord /var/spool/monitord /etc/monitord",
    ])
    done = in_fresh_root(lower, layers, deb, script, proc=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "/var/lib/monitord monitord:monitord 750" in done.stdout, done.stdout
    assert "/var/spool/monitord monitord:monitord 750" in done.stdout, done.stdout
    assert "/etc/monitord root:monitord 750" in done.stdout, done.stdout


def test_the_install_docs_pbx_half_runs_as_written(fresh_root: tuple[Path, Path],
                                                   deb: Path) -> None:
    """docs/install.md's PBX commands, with `dpkg -i` taking the built package: the key is
    made readable by the monitord user and the service's user passes `check`."""
    lower, layers = fresh_root
    commands = [re.sub(r"dpkg -i \S+\.deb", f"dpkg -i {DEB_IN_ROOT}", line)
                for line in pbx_install_commands()]
    script = "\n".join([*commands,
                        "runuser -u monitord -- monitord check -c /etc/monitord/monitord.toml"])
    done = in_fresh_root(lower, layers, deb, script)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "configuration ok: /etc/monitord/monitord.toml" in done.stdout
