"""`monitord check` as an operator runs it (a real `python -m monitord` subprocess): the
configuration alone like `nginx -t`, and with --remote the VPS (the in-process SSH server,
the pushed pyz under the system python3), one line per check and an exit code."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from monitord.base import cgroup_fence
from monitord.local.supervisor import LocalSupervisor
from monitord.remote import artifact, provisioning
from monitord.remote.provisioning import LocalArtifact
from monitord.testing.vps_server import VpsServer
from orchestrator.tunnel_lease import LeaseRecord, SessionIdentity
from tests.integration.operator.conftest import CliResult, run_cli
from tests.support import ssh_keys
from tests.support.agent_process import SYSTEM_PYTHON
from tests.support.sshd import can_run_sshd, running_sshd

TIMEOUT_S = 30.0
VALID_AREA = "5b0c6f1e-8d2a-4c1b-9e77-0a1b2c3d4e5f"
CHECKS = ("auth", "sftp", "arch", "bin_dir", "disk_space", "write_test", "agent", "artifacts",
          "tunnel_owner", "forwards", "remote_config", "memory")

SERVICE = """
[services.tg]
command = ["/bin/sleep", "3600"]
local_data_dir = "{root}/data/tg/{{area}}"
remote_data_dir = "{{remote_bin_dir}}/data/tg/{{area}}"
"""


def write_config(root: Path, remote: str = "") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "monitord.toml"
    path.write_text(
        "[monitord]\n"
        f'work_dir = "{root / "work"}"\n'
        f'spool_dir = "{root / "spool"}"\n'
        'owner_label = "test-pbx"\n'
        + remote + SERVICE.format(root=root)
    )
    return path


def write_placement(root: Path, document: object) -> None:
    spool = root / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    (spool / "custom_config.json").write_text(json.dumps(document))


@dataclass(frozen=True)
class Line:
    mark: str
    code: str
    detail: str


def check_lines(stdout: str) -> dict[str, Line]:
    """check name -> its line, for every `✔`/`✘`/`–` line of the report."""
    lines: dict[str, Line] = {}
    for raw in stdout.splitlines():
        if raw[:1] in ("✔", "✘", "–"):
            mark, check, code, detail = raw.split(maxsplit=3)
            lines[check] = Line(mark, code, detail)
    return lines


class TestConfigurationOnly:
    """Without --remote the configuration is checked like `nginx -t`: 0 ok, 2 and one line."""

    async def test_a_valid_configuration_is_ok(self, tmp_path: Path) -> None:
        config = write_config(tmp_path)
        write_placement(tmp_path, {"custom_daemons": [
            {"uuid": VALID_AREA, "service": "tg", "location": "local"},
        ]})
        result = await run_cli("check", "-c", str(config))
        assert (result.code, result.stderr) == (0, "")
        assert result.stdout.splitlines() == [
            f"placement: {tmp_path / 'spool' / 'custom_config.json'}: 1 area(s), 1 local,"
            " 0 remote",
            "fence: not known yet: monitord says at its start whether local areas are fenced"
            " by cgroup or by process group only",
            f"configuration ok: {config}",
        ]

    async def test_the_fence_line_says_how_monitord_fences_local_areas_and_why(
        self, tmp_path: Path
    ) -> None:
        # what monitord decided at its start, in its own cgroup: here, this test's process
        config = write_config(tmp_path)
        supervisor = LocalSupervisor(state_dir=tmp_path / "work" / "supervisor")
        result = await run_cli("check", "-c", str(config))
        assert result.code == 0, result.stderr
        [line] = [line for line in result.stdout.splitlines() if line.startswith("fence: ")]
        assert line == f"fence: {supervisor.fences.describe('local areas')}"
        # and where it could not, why, and what that leaves open
        cgroup_fence.write_note(supervisor.state_dir, cgroup_fence.Fences(None, why=(
            "cgroup v2 (/sys/fs/cgroup) is mounted read-only for monitord (systemd's"
            " ProtectControlGroups=yes)")))
        result = await run_cli("check", "-c", str(config))
        assert ("fence: local areas are fenced by process group only: cgroup v2"
                " (/sys/fs/cgroup) is mounted read-only for monitord (systemd's"
                " ProtectControlGroups=yes): a daemon's child that calls setsid() escapes the"
                " fence\n") in result.stdout

    async def test_broken_toml_exits_2_with_one_line(self, tmp_path: Path) -> None:
        config = tmp_path / "monitord.toml"
        config.write_text("[monitord\nwork_dir = 1\n")
        result = await run_cli("check", "-c", str(config))
        assert (result.code, result.stdout) == (2, "")
        assert len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith(f"monitord: CONFIG_INVALID: {config}: invalid TOML: ")

    async def test_a_wrong_custom_config_shape_exits_2(self, tmp_path: Path) -> None:
        config = write_config(tmp_path)
        write_placement(tmp_path, [{"uuid": VALID_AREA}])
        result = await run_cli("check", "-c", str(config))
        assert result.code == 2
        assert result.stderr == (f"monitord: CONFIG_CORRUPT: {tmp_path / 'spool'}"
                                 "/custom_config.json: top level: expected an object, got list\n")

    async def test_quarantined_entries_and_unknown_services_are_warnings(
        self, tmp_path: Path
    ) -> None:
        config = write_config(tmp_path)
        write_placement(tmp_path, {"custom_daemons": [
            {"uuid": "../escape", "service": "tg"},
            {"uuid": VALID_AREA, "service": "fax", "location": "remote"},
        ]})
        result = await run_cli("check", "-c", str(config))
        assert result.code == 0, result.stderr
        warnings = [line for line in result.stdout.splitlines() if line.startswith("warning: ")]
        assert len(warnings) == 2, result.stdout
        assert warnings[0].startswith("warning: AREA_ID_INVALID: ")
        assert "custom_daemons[0].uuid" in warnings[0] and "quarantined" in warnings[0]
        assert warnings[1].startswith("warning: UNKNOWN_SERVICE: ") and "'fax'" in warnings[1]
        assert result.stdout.endswith(f"configuration ok: {config}\n")

    async def test_a_manager_local_forward_is_a_deprecation_warning(self, tmp_path: Path) -> None:
        key, known = tmp_path / "id_ed25519", tmp_path / "known_hosts"
        key.write_text("not read by check\n")
        known.write_text("")
        config = write_config(tmp_path, remote=(
            "[remote]\n"
            'host = "vps.example.net"\nuser = "offload"\n'
            f'key_file = "{key}"\nknown_hosts = "{known}"\n'
            'agent_listen = "127.0.0.1:8225"\n'
            'local_forwards = [{name = "manager", listen = "127.0.0.1:8226",'
            ' target = "127.0.0.1:8225"}]\n'
        ))
        result = await run_cli("check", "-c", str(config))
        assert result.code == 0, result.stderr
        warnings = [line for line in result.stdout.splitlines() if line.startswith("warning: ")]
        assert warnings == [
            "warning: deprecated: remote: agent_listen and local_forwards 'manager' ignored"
            " (deprecated): the agent is now reached over the SSH connection itself; remove them"
        ]

    async def test_a_missing_key_file_exits_2(self, tmp_path: Path) -> None:
        config = write_config(tmp_path, remote=(
            "[remote]\n"
            'host = "vps.example.net"\nuser = "offload"\n'
            f'key_file = "{tmp_path / "absent"}"\nknown_hosts = "{tmp_path / "absent"}"\n'
        ))
        result = await run_cli("check", "-c", str(config))
        assert result.code == 2
        assert result.stderr == (f"monitord: CONFIG_INVALID: {config}: key remote.key_file:"
                                 f" cannot read {tmp_path / 'absent'}: No such file or directory\n")


# -- --remote --------------------------------------------------------------------------------


@pytest.fixture
async def vps(tmp_path: Path) -> AsyncIterator[VpsServer]:
    async with VpsServer(work_dir=tmp_path / "vps") as server:
        yield server


@pytest.fixture
def bin_dir() -> Iterator[Path]:
    """remote_bin_dir, 0700, on a short path (the agent's socket path must fit 107 bytes);
    the agent a test started there is stopped at the end."""
    root = Path(tempfile.mkdtemp(prefix="mc-", dir="/tmp"))
    path = root / "offload"
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        _stop_agent(path)
        shutil.rmtree(root, ignore_errors=True)


def _stop_agent(path: Path) -> None:
    try:
        pid = int((path / "agent.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)  # polling an outside process against a deadline
    os.kill(pid, signal.SIGKILL)


def remote_toml(*, host: str, port: int, user: str, key_file: Path, known_hosts: Path,
                bin_dir: Path) -> str:
    return (
        "[remote]\n"
        f'host = "{host}"\nport = {port}\nuser = "{user}"\n'
        f'key_file = "{key_file}"\nknown_hosts = "{known_hosts}"\n'
        f'remote_bin_dir = "{bin_dir}"\nremote_python = "{SYSTEM_PYTHON}"\n'
    )


@dataclass
class Installation:
    """A PBX config pointing at a VPS, and how to provision that VPS."""

    root: Path
    bin_dir: Path
    config: Path

    async def provision(self, *, start_agent: bool) -> None:
        """What the daemon does at its first connect: push, write the secret, maybe launch."""
        from monitord.base.config import load
        from monitord.remote.tunnel import ssh_connect

        secret = secrets.token_hex(16).encode()
        (self.root / "work").mkdir(parents=True, exist_ok=True)
        (self.root / "work" / "agent.secret").write_bytes(secret + b"\n")
        remote = load(self.config).remote
        assert remote is not None
        pyz = artifact.build(self.root / "build")
        conn = await ssh_connect.open_connection(remote)
        async with conn:
            await asyncio.wait_for(provisioning.provision(
                conn, remote=remote, artifacts=[LocalArtifact.from_info(pyz)], secret=secret,
                start_agent=start_agent,
            ), TIMEOUT_S)

    async def check(self, config: Path | None = None) -> CliResult:
        return await run_cli("check", "-c", str(config or self.config), "--remote")


@pytest.fixture
def installation(tmp_path: Path, vps: VpsServer, bin_dir: Path) -> Installation:
    config = write_config(tmp_path / "pbx", remote=remote_toml(
        host=vps.host, port=vps.port, user=vps.username, key_file=vps.key_file,
        known_hosts=vps.known_hosts, bin_dir=bin_dir,
    ))
    return Installation(root=tmp_path / "pbx", bin_dir=bin_dir, config=config)


class TestRemote:
    """--remote connects like the tunnel and runs preflight without pushing or starting."""

    async def test_every_check_passes_after_provisioning(
        self, installation: Installation
    ) -> None:
        await installation.provision(start_agent=True)
        result = await installation.check()
        assert result.code == 0, result.stdout + result.stderr
        lines = check_lines(result.stdout)
        assert list(lines) == list(CHECKS)
        assert {c for c, line in lines.items() if line.mark != "✔"} == {"forwards"}, result.stdout
        assert lines["forwards"].mark == "–"
        assert lines["forwards"].detail.startswith("checked by the daemon")
        assert lines["agent"].detail.startswith("answers over the SSH connection")
        assert lines["tunnel_owner"].detail.startswith("free: no tunnel lease")
        assert lines["remote_config"].code == "PREFLIGHT_REMOTE_CONFIG"
        assert (lines["sftp"].code, lines["sftp"].detail) == (
            "PROVISION_FAILED", "the SFTP subsystem answers")
        assert f": {SYSTEM_PYTHON} -I is 3." in result.stdout
        assert lines["memory"].code == "PREFLIGHT_MEMORY"
        assert "MiB available" in lines["memory"].detail
        assert lines["memory"].detail.endswith("each move needs its daemon's memory on top"
                                               " (the daemon's preflight checks it)")
        assert "summary: 11 passed, 0 failed, 1 not checked (" in result.stdout
        # the socket probe for the agent's kind of channel left nothing behind
        assert not list(installation.bin_dir.glob(".check-sock.*"))

    async def test_a_world_writable_bin_dir_fails_with_its_code_and_fix(
        self, installation: Installation
    ) -> None:
        await installation.provision(start_agent=False)
        installation.bin_dir.chmod(0o777)
        result = await installation.check()
        assert result.code == 1, result.stdout + result.stderr
        lines = check_lines(result.stdout)
        failed = {check: line for check, line in lines.items() if line.mark == "✘"}
        assert list(failed) == ["bin_dir"]
        assert failed["bin_dir"].code == "PREFLIGHT_BIN_DIR"
        assert "mode 0777" in failed["bin_dir"].detail
        assert failed["bin_dir"].detail.endswith(
            " — fix: Create remote_bin_dir owned by remote.user with mode 0700, then retry.")
        assert lines["agent"].detail.startswith("not running")
        assert "summary: 8 passed, 1 failed, 3 not checked (" in result.stdout

    async def test_before_the_first_push_it_says_what_the_daemon_will_do(
        self, installation: Installation
    ) -> None:
        result = await installation.check()
        assert result.code == 0, result.stdout + result.stderr
        lines = check_lines(result.stdout)
        not_checked = {check for check, line in lines.items() if line.mark == "–"}
        assert not_checked == {"agent", "artifacts", "tunnel_owner", "forwards", "remote_config",
                               "memory"}
        assert "not on the VPS yet" in lines["artifacts"].detail
        assert lines["agent"].detail.startswith("self-check not run")
        assert f"{SYSTEM_PYTHON} -I is 3." in lines["agent"].detail
        assert "no agent secret yet" in lines["remote_config"].detail
        assert "no agent secret yet" in lines["memory"].detail
        assert "note: the daemon pushes monitord.pyz" in result.stdout
        assert not (installation.bin_dir / "monitord.pyz").exists()  # nothing was pushed

    async def test_a_live_lease_of_another_node_fails_tunnel_owner(
        self, installation: Installation
    ) -> None:
        await installation.provision(start_agent=False)
        now = time.time()
        record = LeaseRecord(
            owner_id="b7e1c0de-0000-4000-8000-000000000002", owner_label="pbx-02",
            acquired_at=now, renewed_at=now, ttl=600.0,
            session=SessionIdentity(sshd_pid=1, sshd_start_ticks=1, ssh_connection="x"),
        )
        (installation.bin_dir / "tunnel_lease.json").write_text(json.dumps(record.to_dict()))
        result = await installation.check()
        assert result.code == 1, result.stdout + result.stderr
        line = check_lines(result.stdout)["tunnel_owner"]
        assert (line.mark, line.code) == ("✘", "PREFLIGHT_TUNNEL_OWNER")
        assert "held by pbx-02 (b7e1c0de-" in line.detail and "— fix: " in line.detail



@pytest.mark.root
@pytest.mark.skipif(not can_run_sshd(), reason="needs root and /usr/sbin/sshd")
class TestAgainstOpenSsh:
    """Against OpenSSH: `restrict,port-forwarding` in authorized_keys is all monitord needs,
    and a key with plain `restrict` (no forwarding, so no channel to the agent) fails the
    agent check although the agent runs."""

    async def test_restrict_with_port_forwarding_passes_and_plain_restrict_fails_agent(
        self, tmp_path: Path, bin_dir: Path
    ) -> None:
        allowed = ssh_keys.generate(tmp_path / "keys" / "allowed", comment="pbx")
        restricted = ssh_keys.generate(tmp_path / "keys" / "restricted", comment="pbx")
        extra = (f"restrict,port-forwarding {allowed.public_line}",
                 f"restrict {restricted.public_line}")
        async with running_sshd(tmp_path / "sshd", extra_authorized=extra) as sshd:
            configs = {
                name: write_config(tmp_path / name, remote=remote_toml(
                    host=sshd.host, port=sshd.port, user=sshd.user, key_file=key.private_path,
                    known_hosts=sshd.known_hosts, bin_dir=bin_dir,
                ))
                for name, key in (("allowed", allowed), ("restricted", restricted))
            }
            installation = Installation(root=tmp_path / "allowed", bin_dir=bin_dir,
                                        config=configs["allowed"])
            await installation.provision(start_agent=True)  # exec + SFTP with that key
            (tmp_path / "restricted" / "work").mkdir(parents=True)
            shutil.copy(tmp_path / "allowed" / "work" / "agent.secret",
                        tmp_path / "restricted" / "work" / "agent.secret")
            green = await installation.check()
            refused = await installation.check(configs["restricted"])
        assert green.code == 0, green.stdout + green.stderr
        assert check_lines(green.stdout)["agent"].detail.startswith(
            "answers over the SSH connection")
        assert refused.code == 1, refused.stdout + refused.stderr
        failed = {c: line for c, line in check_lines(refused.stdout).items() if line.mark == "✘"}
        assert list(failed) == ["agent"]
        assert failed["agent"].detail.startswith(
            "sshd refuses direct-streamlocal channels (the agent's): ")
        assert "AllowStreamLocalForwarding" in failed["agent"].detail
