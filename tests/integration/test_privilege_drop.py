"""Least privilege: a service's daemons run as its `user` / `group` on both sides, with no
capabilities, their data dir handed over to that user; an unknown user is a clear error and
starts nothing; and a non-root monitord (or guard) holding exactly the systemd unit's
capabilities can do all of it, and still adopts its daemons after a crash; the API token it
writes is readable by its group's members and by no service user."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from monitord.base import proc_identity, run_as
from monitord.base.proc_identity import ProcessIdentity
from monitord.local.supervisor import AreaRun, LocalSupervisor
from monitord.vps.area_runner import AreaRunner
from monitord.vps.lease_table import AreaSpec
from orchestrator.errors import ErrorCode
from tests.integration.test_area_logs import log_process_pids
from tests.support.agent_process import wait_until

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root (CI runs as root)"),
]

REPO_ROOT = Path(__file__).resolve().parents[2]
UNITS = REPO_ROOT / "systemd"
AREA = "5e7a0000-0000-4000-8000-000000000001"
SLEEP = shutil.which("sleep") or "/bin/sleep"
NO_SUCH_USER = "monitord-test-no-such-user"


def _create_system_user() -> str:
    name = f"monitord-test-{secrets.token_hex(4)}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--user-group",
                    "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True)
    return name


def _remove_system_user(name: str) -> None:
    subprocess.run(["userdel", name], check=True, capture_output=True)
    subprocess.run(["groupdel", name], capture_output=True)  # gone with the user, normally


@pytest.fixture
def service_user() -> Iterator[str]:
    name = _create_system_user()
    try:
        yield name
    finally:
        _remove_system_user(name)


@pytest.fixture
def monitord_user() -> Iterator[str]:
    """Stands in for the unit's `monitord` user."""
    name = _create_system_user()
    try:
        yield name
    finally:
        _remove_system_user(name)


@pytest.fixture
def shared_dir(monitord_user: str) -> Iterator[Path]:
    """A dir the unprivileged `monitord_user` can reach (pytest's tmp_path is root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="monitord-privilege-", dir="/tmp"))
    os.chmod(path, 0o755)
    entry = pwd.getpwnam(monitord_user)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def credentials(pid: int) -> dict[str, list[str]]:
    """Uid, Gid, Groups and the Cap* lines of /proc/PID/status, split into words."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups") or key.startswith("Cap"):
            found[key] = value.split()
    return found


def assert_runs_as(pid: int, user: str) -> None:
    entry = pwd.getpwnam(user)
    creds = credentials(pid)
    assert creds["Uid"] == [str(entry.pw_uid)] * 4, creds
    assert creds["Gid"] == [str(entry.pw_gid)] * 4, creds
    assert creds["Groups"] == [str(g) for g in os.getgrouplist(user, entry.pw_gid)], creds
    for key in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(creds[key][0], 16) == 0, (key, creds)


def owner(path: Path) -> str:
    return pwd.getpwuid(path.lstat().st_uid).pw_name


def unit_capabilities(unit: str) -> list[str]:
    for line in (UNITS / unit).read_text().splitlines():
        if line.startswith("AmbientCapabilities="):
            return line.partition("=")[2].split()
    raise AssertionError(f"{unit} sets no AmbientCapabilities")


def setpriv(user: str, capabilities: list[str]) -> list[str]:
    """argv prefix: run as `user` holding exactly `capabilities`, ambient (as the unit does)."""
    caps = ",".join("+" + cap.removeprefix("CAP_").lower() for cap in capabilities)
    with_caps = [f"--inh-caps={caps}", f"--ambient-caps={caps}"] if caps else []
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", *with_caps, "--"]


def python_for(user: str) -> tuple[list[str], dict[str, str]]:
    """An interpreter `user` can run with this checkout and its dependencies importable:
    ours, or else the system's of the same version (ours may live under root's home)."""
    site = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO_ROOT), site)),
           "PYTHONDONTWRITEBYTECODE": "1"}
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, shutil.which(version) or version):
        probe = subprocess.run(
            [*setpriv(user, []), python, "-c", "import monitord.local.supervisor"],
            env=env, cwd="/", capture_output=True, timeout=60,
        )
        if probe.returncode == 0:
            return [python], env
    raise AssertionError(f"no Python that {user} may run can import monitord from {REPO_ROOT}")


class TestLocalDaemonsRunAsTheirServiceUser:
    """The local supervisor starts a service's daemon as its user, data dir handed over."""

    async def test_the_daemon_runs_as_the_user_without_capabilities_and_owns_its_data(
        self, tmp_path: Path, service_user: str
    ) -> None:
        data_dir = tmp_path / "data" / AREA
        (data_dir / "sub").mkdir(parents=True)
        (data_dir / "sub" / "copied-back.db").write_bytes(b"monitord wrote this")
        outside = tmp_path / "outside-file"
        outside.write_bytes(b"not the daemon's")
        os.link(outside, data_dir / "hard-link")  # may point anywhere: never given away
        (data_dir / "passwd-link").symlink_to("/etc/passwd")
        supervisor = LocalSupervisor(state_dir=tmp_path / "state", stop_grace_s=1.0)
        run = AreaRun(service="tg", area=AREA, generation=1, command=(SLEEP, "600"),
                      data_dir=str(data_dir), user=service_user)
        try:
            view = await supervisor.start_area(run)
            assert view.state == "running" and view.pid is not None
            assert_runs_as(view.pid, service_user)
            environ = Path(f"/proc/{view.pid}/environ").read_bytes().split(b"\0")
            assert f"USER={service_user}".encode() in environ
            for path in (data_dir, data_dir / "sub", data_dir / "sub" / "copied-back.db",
                         data_dir / "passwd-link"):
                assert owner(path) == service_user, path
            assert owner(Path("/etc/passwd")) == "root"
            assert owner(outside) == "root"
            log = supervisor.logs_dir / f"{AREA}.log"
            await wait_until(log.exists, timeout_s=20, what="the hub to open the log")
            assert owner(log) == "root"  # the hub writes it as monitord: not the daemon's
            assert await supervisor.stop_area(AREA)
        finally:
            await supervisor.close()
            assert await supervisor.stop_all()

    async def test_an_unknown_user_is_SERVICE_USER_UNKNOWN_and_nothing_starts(
        self, tmp_path: Path
    ) -> None:
        supervisor = LocalSupervisor(state_dir=tmp_path / "state")
        run = AreaRun(service="tg", area=AREA, generation=1, command=(SLEEP, "600"),
                      data_dir=str(tmp_path / "data"), user=NO_SUCH_USER)
        try:
            with capture_logs() as events:
                view = await supervisor.start_area(run)
            assert view.state == "backoff" and view.pid is None
            [failed] = [e for e in events if e["event"] == "daemon_spawn_failed"]
            assert failed["error_code"] == "SERVICE_USER_UNKNOWN"
            assert NO_SUCH_USER in failed["detail"]
            assert log_process_pids(supervisor.logs_dir) == []
            assert not (supervisor.state_dir / "log-pipes").exists() \
                or not os.listdir(supervisor.state_dir / "log-pipes")
        finally:
            await supervisor.close()
            assert await supervisor.stop_all()

    async def test_a_non_root_monitord_with_the_units_capabilities_drops_and_adopts(
        self, shared_dir: Path, monitord_user: str, service_user: str
    ) -> None:
        python, env = python_for(monitord_user)
        state_dir = shared_dir / "state"
        runs = json.dumps([{"service": "tg", "area": AREA, "generation": 1,
                            "command": [SLEEP, "600"], "user": service_user,
                            "data_dir": str(shared_dir / "data" / AREA)}])
        argv = [*setpriv(monitord_user, unit_capabilities("monitord.service")), *python,
                "-m", "tests.integration.supervisor.supervisor_host", str(state_dir), runs]

        async def start_monitord() -> asyncio.subprocess.Process:
            host = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd="/", stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL)
            assert host.stdout is not None
            line = await asyncio.wait_for(host.stdout.readline(), timeout=60)
            assert line.strip() == b"ready", line
            return host

        async def kill(host: asyncio.subprocess.Process) -> None:
            if host.returncode is None:
                host.kill()
                await host.wait()

        record_path = state_dir / "records" / f"{AREA}.json"
        log = state_dir / "logs" / f"{AREA}.log"
        hosts = [await start_monitord()]
        try:
            daemon = ProcessIdentity.from_json(json.loads(record_path.read_text())["identity"])
            uid = str(pwd.getpwnam(monitord_user).pw_uid)
            assert credentials(hosts[0].pid)["Uid"][0] == uid
            assert_runs_as(daemon.pid, service_user)
            assert owner(shared_dir / "data" / AREA) == service_user
            await kill(hosts[0])  # monitord crashes; the daemon, another user's, lives on
            hosts.append(await start_monitord())  # must find it, and adopt it
            await kill(hosts[1])
            record = json.loads(record_path.read_text())
            assert ProcessIdentity.from_json(record["identity"]) == daemon
            marked = proc_identity.find_by_environ("MONITORD_SUPERVISOR", str(state_dir))
            assert [identity.pid for identity, _ in marked] == [daemon.pid]  # no duplicate
        finally:
            for host in hosts:
                await kill(host)
            for identity, _ in proc_identity.find_by_environ("MONITORD_SUPERVISOR",
                                                              str(state_dir)):
                proc_identity.signal_group(identity.pid, signal.SIGKILL)
            await wait_until(lambda: not log_process_pids(log.parent)
                             and not proc_identity.find_by_environ(
                                 "MONITORD_SUPERVISOR", str(state_dir)), timeout_s=20,
                             what="the daemons and their log hub to end")


class TestRemoteDaemonsRunAsTheirServiceUser:
    """The agent's area runner has the guard start the daemon as the service's user."""

    async def test_the_daemon_runs_as_the_user_and_the_guard_stays_the_agents(
        self, tmp_path: Path, service_user: str
    ) -> None:
        runner = AreaRunner(base_dir=tmp_path / "vps", stop_grace_s=1.0, fence_grace_s=0.3)
        data_dir = tmp_path / "vps" / "data" / "tg" / AREA
        data_dir.mkdir(parents=True)
        (data_dir / "copied.db").write_bytes(b"sftp wrote this")
        spec = AreaSpec(area=AREA, service="tg", generation=1, owner_id="owner",
                        command=(SLEEP, "600"), data_dir=str(data_dir))
        runner.grant(spec, ttl_s=60)
        handle = runner.spawn(spec, user=service_user)
        try:
            await wait_until(lambda: runner.daemon_pids([handle])[handle.pid] is not None,
                             timeout_s=20, what="the guard to start the daemon")
            daemon_pid = runner.daemon_pids([handle])[handle.pid]
            assert daemon_pid is not None
            assert_runs_as(daemon_pid, service_user)
            assert credentials(handle.pid)["Uid"][0] == str(os.getuid())
            assert owner(data_dir) == owner(data_dir / "copied.db") == service_user
        finally:
            assert await runner.stop(handle, fence=False)
        # the hub wrote the guard's last lines and ended the area's FIFO
        assert not [n for n in os.listdir(runner.pipes.pipes_dir) if n.startswith(AREA)]
        runner.close()

    async def test_an_unknown_user_fails_the_spawn_before_anything_starts(
        self, tmp_path: Path
    ) -> None:
        runner = AreaRunner(base_dir=tmp_path / "vps", stop_grace_s=1.0, fence_grace_s=0.3)
        spec = AreaSpec(area=AREA, service="tg", generation=1, owner_id="owner",
                        command=(SLEEP, "600"), data_dir=str(tmp_path / "data"))
        runner.grant(spec, ttl_s=60)
        with pytest.raises(run_as.ServiceUserUnknown) as failed:
            runner.spawn(spec, user=NO_SUCH_USER)
        assert failed.value.code == ErrorCode.SERVICE_USER_UNKNOWN  # in the catalogue
        assert isinstance(failed.value, OSError)  # the agent's spawn path handles it as such
        assert list(runner.run_dir.glob("*.json")) == []
        assert log_process_pids(runner.logs_dir) == []

    async def test_a_non_root_guard_with_the_units_capabilities_drops_and_fences(
        self, shared_dir: Path, monitord_user: str, service_user: str
    ) -> None:
        python, env = python_for(monitord_user)
        agent = pwd.getpwnam(monitord_user)
        runner = AreaRunner(base_dir=shared_dir / "vps", stop_grace_s=1.0, fence_grace_s=0.3)
        spec = AreaSpec(area=AREA, service="tg", generation=1, owner_id="owner",
                        command=(SLEEP, "600"), data_dir=str(shared_dir / "data"))
        runner.grant(spec, ttl_s=60)
        for path in (runner.base_dir, runner.leases_dir, runner.lease_path(AREA)):
            os.chown(path, agent.pw_uid, agent.pw_gid)  # the agent's own files
        who = run_as.resolve(user=service_user, group=None)
        assert who is not None and who.uid is not None
        guard = await asyncio.create_subprocess_exec(
            *setpriv(monitord_user, unit_capabilities("monitord-agent.service")), *python,
            "-m", "monitord.vps", "lease-guard", "--lease-file", str(runner.lease_path(AREA)),
            "--fence-grace", "0.3", "--uid", str(who.uid), "--gid", str(who.gid),
            "--groups", ",".join(map(str, who.groups)), "--", SLEEP, "600",
            env=env, cwd="/", stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await wait_until(lambda: proc_identity.children_of({guard.pid})[guard.pid],
                             timeout_s=30, what="the guard to start the daemon")
            [daemon_pid] = proc_identity.children_of({guard.pid})[guard.pid]
            assert_runs_as(daemon_pid, service_user)
            runner.revoke(AREA)  # the lease lapses: the guard must be able to kill the daemon
            status = await asyncio.wait_for(guard.wait(), timeout=30)
            assert guard.stderr is not None
            said = await guard.stderr.read()
            assert status == 75, said  # EXIT_LEASE_LAPSED, after a fence that worked
            assert b'"fence_done"' in said and b'"escalated": false' in said
            assert not proc_identity.is_alive(daemon_pid)
        finally:
            if guard.returncode is None:
                guard.kill()
                await guard.wait()


class TestTheAgentsApiCarriesTheUser:
    """The owner's create request names the service's user and the area log's cap; the
    agent (the pyz under the system python3) starts the daemon as that user."""

    async def test_a_create_with_a_user_runs_the_daemon_as_that_user(
        self, tmp_path: Path, service_user: str
    ) -> None:
        from tests.support.agent_process import running_agent

        async with running_agent(tmp_path / "vps") as agent:
            data_dir = agent.base_dir / "data" / "tg" / AREA
            body = {"service": "tg", "generation": 1, "owner_id": "owner", "lease_ttl_s": 30,
                    "command": [SLEEP, "600"], "data_dir": str(data_dir), "env": {},
                    "user": service_user, "log_max_bytes": 4096, "log_keep": 1}
            status, answer = await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
            assert status == 201, answer

            async def daemon_pid() -> int | None:
                processes = (await agent.inventory())["processes"]
                return processes[0]["pid"] if processes and processes[0]["alive"] else None

            await wait_until(daemon_pid, timeout_s=20, what="the daemon to start")
            pid = await daemon_pid()
            assert pid is not None
            assert_runs_as(pid, service_user)
            assert owner(data_dir) == service_user
            cached = json.loads((agent.base_dir / "spool" / "custom_config.json").read_text())
            entry = cached["custom_daemons"][0]
            assert (entry["user"], entry["log_max_bytes"], entry["log_keep"]) == (
                service_user, 4096, 1)
            status, _ = await agent.request("POST", f"/v1/areas/{AREA}/stop?generation=1")
            assert status == 200

    async def test_a_stop_hands_the_data_back_so_the_copy_can_read_it(
        self, tmp_path: Path, service_user: str
    ) -> None:
        """The copy after a stop runs over SFTP as the agent's (the SSH) user: a file the
        daemon created 0600 as its service user is the agent's again once it is stopped."""
        from tests.support.agent_process import running_agent

        async with running_agent(tmp_path / "vps") as agent:
            data_dir = agent.base_dir / "data" / "tg" / AREA
            script = "umask 077; mkdir -p db; echo secret > db/session; exec sleep 600"
            body = {"service": "tg", "generation": 1, "owner_id": "owner", "lease_ttl_s": 30,
                    "command": ["/bin/sh", "-c", script], "data_dir": str(data_dir),
                    "env": {}, "user": service_user}
            status, answer = await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
            assert status == 201, answer
            written = data_dir / "db" / "session"
            await wait_until(written.exists, timeout_s=20, what="the daemon to write")
            assert owner(written) == service_user and written.stat().st_mode & 0o077 == 0
            status, _ = await agent.request("POST", f"/v1/areas/{AREA}/stop?generation=1")
            assert status == 200
            me = pwd.getpwuid(os.getuid()).pw_name
            assert {owner(p) for p in (data_dir, data_dir / "db", written)} == {me}

    async def test_a_user_that_is_not_a_name_is_refused_with_400(
        self, tmp_path: Path
    ) -> None:
        from tests.support.agent_process import running_agent

        async with running_agent(tmp_path / "vps") as agent:
            body = {"service": "tg", "generation": 1, "owner_id": "owner", "lease_ttl_s": 30,
                    "command": [SLEEP, "600"], "data_dir": str(agent.base_dir / "d"),
                    "env": {}, "user": "../root"}
            status, answer = await agent.request("PUT", f"/v1/areas/{AREA}", json_body=body)
            assert (status, answer["error"]["code"]) == (400, "BAD_REQUEST")
            assert (await agent.inventory())["entries"] == []


class TestTheApiTokenFollowsItsGroup:
    """The API token a non-root monitord writes is readable by root and the members of its
    group (so they may change placements through the API and the CLI), and by no other user:
    not by a messenger daemon's service user (docs/design.md, "Local authorization")."""

    READ = ("import json, sys; from pathlib import Path; from monitord.surface import api_token;"
            " print(json.dumps(api_token.read(Path(sys.argv[1]))))")

    def test_the_group_decides_who_reads_the_token(
        self, shared_dir: Path, monitord_user: str, service_user: str
    ) -> None:
        python, env = python_for(monitord_user)

        def run(user: str, groups: list[str], code: str) -> str:
            extra = [f"--groups={','.join(groups)}"] if groups else ["--clear-groups"]
            done = subprocess.run(
                ["setpriv", f"--reuid={user}", f"--regid={user}", *extra, "--", *python,
                 "-c", code, str(shared_dir)],
                env=env, cwd="/", capture_output=True, text=True, timeout=60,
            )
            assert done.returncode == 0, done.stderr
            return done.stdout.strip()

        written = run(monitord_user, [], "import sys; from pathlib import Path;"
                      " from monitord.surface import api_token;"
                      " print(api_token.ensure(Path(sys.argv[1]), None).written)")
        assert written == "missing"
        path = shared_dir / "api-token"
        entry = pwd.getpwnam(monitord_user)
        st = path.lstat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (entry.pw_uid, entry.pw_gid, 0o640)

        from monitord.surface import api_token

        token, why = api_token.read(shared_dir)  # root
        assert token is not None and why == ""
        member = json.loads(run(service_user, [monitord_user], self.READ))
        assert member == [token, ""]
        outsider = json.loads(run(service_user, [], self.READ))
        assert outsider[0] is None
        assert outsider[1] == f"cannot read {path}: Permission denied"


NOBODY = 65534


class TestHandOverFollowsNoLinkAnotherUserPlanted:
    """`hand_over` walks to the data dir one component at a time, by descriptor: a symlink
    in a directory the service user can write (its own parent dir, say) is refused, so it
    cannot redirect the chown to a file of root's; a symlink set up in a directory only
    root (or monitord) can write is followed, as a data dir on another disk needs."""

    @pytest.fixture
    def base(self) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="hand-over-") as raw:
            base = Path(raw)
            base.chmod(0o755)
            victim = base / "victim"
            victim.mkdir()
            (victim / "secret").write_text("root's")
            (victim / "area").mkdir()
            tenant = base / "cti"  # the service user's own dir: it may plant links here
            tenant.mkdir()
            os.chown(tenant, NOBODY, NOBODY)
            yield base

    def _owners(self, base: Path) -> set[int]:
        victim = base / "victim"
        return {p.stat().st_uid for p in (victim, victim / "secret", victim / "area")}

    def test_a_link_as_the_data_dir_in_the_users_dir_is_refused(self, base: Path) -> None:
        link = base / "cti" / "area"
        link.symlink_to(base / "victim")
        os.lchown(link, NOBODY, NOBODY)
        who = run_as.RunAs(uid=NOBODY, gid=NOBODY, groups=())
        with pytest.raises(OSError):
            run_as.hand_over(link, who)
        assert self._owners(base) == {0}, "the chown followed the user's link"

    def test_a_link_higher_up_in_the_users_dir_is_refused(self, base: Path) -> None:
        link = base / "cti" / "svc"
        link.symlink_to(base / "victim")
        who = run_as.RunAs(uid=NOBODY, gid=NOBODY, groups=())
        with pytest.raises(OSError):
            run_as.hand_over(link / "area", who)
        assert self._owners(base) == {0}, "the chown followed the user's link"

    def test_a_link_root_set_up_is_followed(self, base: Path) -> None:
        real = base / "disk2" / "area"
        real.mkdir(parents=True)
        (real / "data").write_text("x")
        (base / "area-link").symlink_to(real)
        who = run_as.RunAs(uid=NOBODY, gid=NOBODY, groups=())
        run_as.hand_over(base / "area-link", who)
        assert (real.stat().st_uid, (real / "data").stat().st_uid) == (NOBODY, NOBODY)
        assert self._owners(base) == {0}

    def test_a_plain_data_dir_in_the_users_dir_is_handed_over(self, base: Path) -> None:
        area = base / "cti" / "area"
        area.mkdir()
        (area / "sub").mkdir()
        (area / "sub" / "f").write_text("x")
        run_as.hand_over(area, run_as.RunAs(uid=NOBODY, gid=NOBODY, groups=()))
        assert {p.stat().st_uid for p in (area, area / "sub", area / "sub" / "f")} == {NOBODY}
