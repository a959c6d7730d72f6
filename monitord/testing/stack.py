"""A whole offload installation on one machine: PBX monitord, an SSH "VPS", fake areas.

Used by `monitord demo` and by the end-to-end tests. Everything is real except the VPS's
operating system: the VPS is the in-process asyncssh server (`VpsServer`) on loopback, and
what runs "on" it (the agent from the pushed monitord.pyz, the lease guards, the remote
daemons) are real processes started over SSH exec. monitord itself runs as a real
`monitord run` subprocess, so tests can kill it with SIGKILL at any moment.

Fake messenger daemons report heartbeats to a split-brain `Detector`: local ones directly,
remote ones through the tunnel's reverse forward (as real daemons reach NATS), so a remote
daemon that lost its tunnel falls silent, exactly like the real thing.

    async with Stack(root, services={"tg": 3}) as stack:
        await stack.place("tg", "remote")
        await stack.wait_settled(timeout_s=60)
        assert stack.detector.overlaps() == []

Every process a stack started is killed when it closes (found by the stack's root path in
its command line or environment), so nothing leaks between tests.

With `StackOptions(external_vps=ExternalVps(...))` the VPS is a real SSH server instead (the
fault tier runs OpenSSH in a network namespace): the stack then starts no `VpsServer`, the
detector listens on every address so remote daemons reach it directly at
`ExternalVps.observer_host`, and whoever built that VPS kills what runs on it. With
`nats_target` the `nats` reverse forward leads to a real NATS server and remote daemons
report through an extra `heartbeat` reverse forward instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from monitord.base import proc_identity
from monitord.base.task_owner import TaskOwner
from monitord.testing.ports import free_port
from monitord.testing.split_brain import Detector
from monitord.testing.vps_server import VpsServer

# The VPS side runs as on a bare VPS: the pushed monitord.pyz under the system python3 in
# isolated mode (no site-packages of ours). A machine without one runs it under ours.
SYSTEM_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable

PROC = Path("/proc")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {type(value).__name__}")


def to_toml(document: Mapping[str, Mapping[str, Any]]) -> str:
    """Sections of scalars, arrays and inline tables (all a monitord.toml needs)."""
    lines: list[str] = []
    for section, values in document.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(v)}" for key, v in values.items() if v is not None)
        lines.append("")
    return "\n".join(lines)


@dataclass(frozen=True)
class ExternalVps:
    """A real SSH server playing the VPS, and how processes on it reach this machine."""

    host: str
    port: int
    user: str
    key_file: Path
    known_hosts: Path
    remote_bin_dir: Path  # on the VPS; the same filesystem as this machine
    observer_host: str  # an address of this machine the VPS reaches without the tunnel
    nats_listen: str = "127.0.0.1:4222"  # the reverse forwards' listen side on the VPS
    heartbeat_listen: str = "127.0.0.1:4223"
    proxy_jump: str | None = None  # remote.proxy_jump: the jump hosts in front of the VPS
    # How the VPS starts a fake daemon (e.g. its own python3 and a copy of fake_daemon.py on
    # a VPS of another Debian release); empty: this interpreter's `-m monitord.testing...`.
    remote_daemon_argv: tuple[str, ...] = ()


@dataclass
class StackOptions:
    services: Mapping[str, int] = field(default_factory=lambda: {"tg": 2})
    area_lease_ttl_s: float = 3.0
    tunnel_lease_ttl_s: float = 6.0
    min_uptime_s: float = 0.5
    healthcheck_timeout_s: float = 8.0
    reconcile_interval_s: float = 2.0
    cleanup_interval_s: float = 1.0
    park_after_failures: int = 5
    rollback_data: str = "preserve"
    rollback_data_wait_s: float = 900.0
    parallelism: int = 4
    data_bytes: int = 4096
    remote_daemon_args: tuple[str, ...] = ()  # e.g. ("--crash-after", "0.2"): never healthy
    local_daemon_args: tuple[str, ...] = ()  # the same for the PBX's daemons
    extra_env: Mapping[str, str] = field(default_factory=dict)
    external_vps: ExternalVps | None = None  # None: the in-process VpsServer
    nats_target: str | None = None  # "host:port" of a real NATS server on this machine
    remote_overrides: Mapping[str, Any] = field(default_factory=dict)  # merged into [remote]
    monitord_overrides: Mapping[str, Any] = field(default_factory=dict)  # into [monitord]
    service_overrides: Mapping[str, Any] = field(default_factory=dict)  # into each service
    log_level: str = "info"  # `monitord run --log-level`


class Stack:
    def __init__(self, root: Path, options: StackOptions | None = None, **kw: Any) -> None:
        self.root = root.resolve()
        self.options = options or StackOptions(**kw)
        external = self.options.external_vps
        # A remote daemon on an external VPS reports to the detector directly over the
        # network too, so it must listen beyond loopback.
        self.detector = Detector(host="0.0.0.0") if external else Detector()
        # Areas whose data a test gives up on purpose (a discarding rollback): their
        # regressions are expected, every other area's are failures.
        self.accepted_data_loss: set[str] = set()
        self.vps: VpsServer | None = None
        self.daemon: asyncio.subprocess.Process | None = None
        self.log_lines: list[str] = []
        self._reader: asyncio.Task[None] | None = None
        self._tasks = TaskOwner("stack", report_crashes=False)  # the daemon's stderr readers
        self.http_port = free_port()
        self.areas: dict[str, list[str]] = {}
        self.config_path = self.root / "monitord.toml"
        self._session: aiohttp.ClientSession | None = None

    # -- set-up ------------------------------------------------------------------------------

    async def __aenter__(self) -> Stack:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        await self.detector.__aenter__()
        if self.options.external_vps is None:
            self.vps = VpsServer(work_dir=self.root / "vps-ssh")
            await self.vps.__aenter__()
        self._write_files()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        await self.start_monitord()

    def _remote_endpoint(self) -> dict[str, Any]:
        """host/port/user/key_file/known_hosts of the VPS's SSH server."""
        external = self.options.external_vps
        if external is not None:
            return {"host": external.host, "port": external.port, "user": external.user,
                    "key_file": external.key_file, "known_hosts": external.known_hosts,
                    "proxy_jump": external.proxy_jump}
        assert self.vps is not None
        remote = self.vps.remote_section(remote_bin_dir=str(self.vps_dir))
        return {"host": remote.host, "port": remote.port, "user": remote.user,
                "key_file": remote.key_file, "known_hosts": remote.known_hosts}

    def _write_files(self) -> None:
        o = self.options
        external = o.external_vps
        spool, work = self.root / "spool", self.root / "work"
        spool.mkdir(exist_ok=True)
        bin_dir = self.vps_dir
        det = f"127.0.0.1:{self.detector.port}"
        if external is None:
            nats_vps = f"127.0.0.1:{free_port()}"
            heartbeat_vps = f"127.0.0.1:{free_port()}"
            det_direct = det  # the VPS is this machine's loopback
        else:
            nats_vps = external.nats_listen
            heartbeat_vps = external.heartbeat_listen
            det_direct = f"{external.observer_host}:{self.detector.port}"
        if o.nats_target is None:
            reverse = [{"name": "nats", "listen": nats_vps, "target": det}]
            heartbeat_via_tunnel = nats_vps
        else:
            reverse = [{"name": "nats", "listen": nats_vps, "target": o.nats_target},
                       {"name": "heartbeat", "listen": heartbeat_vps, "target": det}]
            heartbeat_via_tunnel = heartbeat_vps
        fake = [sys.executable, "-m", "monitord.testing.fake_daemon", "--area", "{area}",
                "--data", "{data_dir}", "--generation", "{generation}"]
        remote_fake = fake
        if external is not None and external.remote_daemon_argv:
            remote_fake = [*external.remote_daemon_argv, *fake[3:]]
        document: dict[str, dict[str, Any]] = {
            "monitord": {
                "work_dir": work,
                "spool_dir": spool,
                "owner_label": "pbx-demo",
                "log_format": "json",
                "reconcile_interval_s": o.reconcile_interval_s,
                "cleanup_interval_s": o.cleanup_interval_s,
                "park_after_failures": o.park_after_failures,
                "rollback_data": o.rollback_data,
                "rollback_data_wait_s": o.rollback_data_wait_s,
                **o.monitord_overrides,
                "retry_backoff_base_s": 0.5,
                "retry_backoff_cap_s": 5.0,
                "legacy_grace_s": 2.0,
            },
            "http": {"listen": f"127.0.0.1:{self.http_port}", "drain_timeout_s": 2.0},
            "remote": {
                **self._remote_endpoint(),
                # The VPS side runs as on a bare VPS: the pushed pyz under python3 -I. An
                # external VPS (the faults tier's namespace) finds its own `python3` on the
                # login PATH, as in production; the in-process one runs commands with this
                # process's PATH, so it is named.
                **({} if external else {"remote_python": SYSTEM_PYTHON}),
                "remote_bin_dir": str(bin_dir),
                "connect_timeout_s": 5.0,
                "preflight_tunnel_wait_s": 3.0,
                "keepalive_interval_s": 1.0,
                "keepalive_count_max": 3,
                "reconnect_backoff_base_s": 0.2,
                "reconnect_backoff_cap_s": 2.0,
                "reconnect_max_per_minute": 60,
                "tunnel_lease_ttl_s": o.tunnel_lease_ttl_s,
                "area_lease_ttl_s": o.area_lease_ttl_s,
                "lease_safety_margin_s": 0.5,
                "reverse_forwards": reverse,
                **o.remote_overrides,
            },
        }
        entries: list[dict[str, Any]] = []
        for service, count in o.services.items():
            document[f"services.{service}"] = {
                "command": [*fake, "--side", "local", "--heartbeat", det,
                            *o.local_daemon_args],
                # Remote daemons report through the tunnel (as real ones reach NATS) AND
                # straight to the detector: the VPS is this machine, so the detector sees a
                # remote daemon even while the tunnel is cut — the split-brain check must
                # not be blind exactly when a split brain could happen.
                "remote_command": [*remote_fake, "--side", "remote", "--heartbeat",
                                   heartbeat_via_tunnel, "--heartbeat", det_direct,
                                   *o.remote_daemon_args],
                "local_data_dir": f"{self.root}/pbx/{service}/{{area}}",
                "remote_data_dir": f"{{remote_bin_dir}}/data/{service}/{{area}}",
                "min_uptime_s": o.min_uptime_s,
                "healthcheck_timeout_s": o.healthcheck_timeout_s,
                "parallelism": o.parallelism,
                **o.service_overrides,
            }
            self.areas[service] = []
            for _ in range(count):
                area = str(uuid.uuid4())
                self.areas[service].append(area)
                data = self.root / "pbx" / service / area
                data.mkdir(parents=True, exist_ok=True)
                (data / "media.bin").write_bytes(os.urandom(o.data_bytes))
                entries.append({"uuid": area, "service": service, "location": "local",
                                "phone": f"+7900{len(entries):07d}"})
        self.config_path.write_text(to_toml(document))
        (spool / "custom_config.json").write_text(json.dumps({"custom_daemons": entries},
                                                             indent=2))

    # -- monitord ----------------------------------------------------------------------------

    @property
    def hold_release(self) -> Path:
        return self.root / "release-hold"

    async def start_monitord(
        self, *, wait_ready: bool = True, env: Mapping[str, str] | None = None
    ) -> None:
        """Start `monitord run`; `env` adds variables (crash and hold points) to this run only."""
        self.hold_release.unlink(missing_ok=True)
        env = {
            **os.environ,
            "MONITORD_STACK_ROOT": str(self.root),
            "MONITORD_HOLD_RELEASE": str(self.hold_release),
            **self.options.extra_env,
            **(env or {}),
        }
        self.daemon = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "monitord", "run", "-c", str(self.config_path),
            "--log-level", self.options.log_level,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=env,
        )
        self._reader = self._tasks.spawn("monitord stderr", self._read_log(self.daemon))
        if wait_ready:
            await self.wait_until(self._ready, timeout_s=30, what="monitord ready")

    async def _read_log(self, proc: asyncio.subprocess.Process) -> None:
        """monitord's log lines, kept here and in root/monitord.log (read after a run)."""
        assert proc.stderr is not None
        with (self.root / "monitord.log").open("ab") as saved:
            while line := await proc.stderr.readline():
                saved.write(line)
                self.log_lines.append(line.decode("utf-8", "replace").rstrip("\n"))

    async def _ready(self) -> bool:
        if self.daemon is not None and self.daemon.returncode is not None:
            tail = "\n".join(self.log_lines[-30:])
            raise AssertionError(f"monitord exited with {self.daemon.returncode}:\n{tail}")
        status, _ = await self.request("GET", "/readyz")
        return status == 200

    async def stop_monitord(self, sig: int = signal.SIGTERM, *, timeout_s: float = 30) -> int:
        proc = self.daemon
        assert proc is not None
        if proc.returncode is None:
            proc.send_signal(sig)
        return await self.wait_monitord_exit(timeout_s=timeout_s)

    async def wait_monitord_exit(self, *, timeout_s: float = 30) -> int:
        """Wait for monitord to exit (by itself, e.g. at a crash point); its exit code."""
        proc = self.daemon
        assert proc is not None
        code = await asyncio.wait_for(proc.wait(), timeout_s)
        if self._reader is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reader, 5)
        return code

    def release_hold(self) -> None:
        self.hold_release.touch()

    async def wait_event(self, name: str, *, timeout_s: float = 30) -> dict[str, Any]:
        await self.wait_until(lambda: bool(self.events(name)), timeout_s=timeout_s, what=name)
        return self.events(name)[-1]

    # -- VPS faults --------------------------------------------------------------------------

    async def cut_ssh(self, *, for_s: float = 0.0) -> None:
        """Drop every SSH session; with `for_s`, refuse new ones that long (a partition)."""
        assert self.vps is not None, "an external VPS has its own fault controls"
        if for_s > 0:
            await self.vps.refuse_new_connections()
        self.vps.drop_all_sessions()
        if for_s > 0:
            await asyncio.sleep(for_s)
            await self.vps.accept_new_connections()

    async def partition(self) -> None:
        """The VPS becomes unreachable until `heal()` (sessions dropped, connects refused)."""
        assert self.vps is not None
        await self.vps.refuse_new_connections()
        self.vps.drop_all_sessions()

    async def heal(self) -> None:
        assert self.vps is not None
        await self.vps.accept_new_connections()

    @property
    def work_dir(self) -> Path:
        """monitord's work_dir on the PBX (state.db and what lives beside it)."""
        return self.root / "work"

    @property
    def vps_dir(self) -> Path:
        """remote_bin_dir on the VPS (this machine's filesystem either way)."""
        if self.options.external_vps is not None:
            return self.options.external_vps.remote_bin_dir
        return self.root / "vps" / "opt"

    def kill_agent(self, sig: int = signal.SIGKILL) -> bool:
        """Signal the agent process on the VPS (default SIGKILL; its lease guards live on;
        SIGSTOP hangs it, SIGCONT lets it go on); True if found."""
        pid_file = self.vps_dir / "agent.pid"
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            return True
        return False

    def agent_cache(self) -> dict[str, dict[str, Any]]:
        """The agent's spool cache (its custom_config.json) by area."""
        path = self.vps_dir / "spool" / "custom_config.json"
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return {e["uuid"]: e for e in document.get("custom_daemons", [])}

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        found = []
        for line in self.log_lines:
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if isinstance(event, dict) and (name is None or event.get("event") == name):
                    found.append(event)
        return found

    # -- API ---------------------------------------------------------------------------------

    def api_token(self) -> str | None:
        """The daemon's API token (work/api-token), as an authorised operator reads it; None
        before the daemon wrote it."""
        from monitord.surface import api_token

        token, _ = api_token.read(self.root / "work")
        return token

    async def request(
        self, method: str, path: str, body: Any = None, *, authorised: bool = True
    ) -> tuple[int, Any]:
        """One API request, with the API token (as the CLI sends it) unless not `authorised`."""
        assert self._session is not None
        url = f"http://127.0.0.1:{self.http_port}{path}"
        try:
            # A change is JSON, as the API requires (a bare POST would be refused).
            headers = {} if method in ("GET", "HEAD") else {"Content-Type": "application/json"}
            token = self.api_token() if authorised else None
            if token is not None:
                headers["Authorization"] = f"Bearer {token}"
            async with self._session.request(method, url, json=body, headers=headers) as resp:
                text = await resp.text()
                try:
                    return resp.status, json.loads(text) if text else None
                except ValueError:
                    return resp.status, text
        except (aiohttp.ClientError, OSError, TimeoutError):
            return 0, None

    async def status(self) -> dict[str, Any]:
        code, body = await self.request("GET", "/v1/status")
        if code != 200:
            raise AssertionError(f"GET /v1/status -> {code}")
        assert isinstance(body, dict)
        return body

    async def place(self, service: str, location: str) -> list[str]:
        code, body = await self.request(
            "PUT", f"/v1/services/{service}/placement", {"location": location}
        )
        if code != 202:
            raise AssertionError(f"placement of {service} -> {code} {body}")
        return list(body.get("transaction_ids", []))

    def committed(self) -> dict[str, dict[str, Any]]:
        """The authoritative placement as custom_config.json says right now."""
        document = json.loads((self.root / "spool" / "custom_config.json").read_text())
        return {e["uuid"]: e for e in document["custom_daemons"]}

    async def settled(self, *, expect: Mapping[str, str] | None = None) -> bool:
        """No transaction, no cleanup backlog, no drift, each area heard from on one side."""
        status = await self.status()
        if status["transactions"] or status["cleanup"]["backlog"] or not status["tunnel"].get(
            "connected"
        ):
            return False
        if any(svc["state"] != "idle" for svc in status["services"].values()):
            return False
        committed = self.committed()
        for service, areas in self.areas.items():
            want = (expect or {}).get(service)
            for area in areas:
                entry = committed[area]
                location = entry.get("location", "local")
                if want is not None and location != want:
                    return False
                alive = self.detector.alive(area)
                if len(alive) != 1 or alive[0].side != location:
                    return False
        return True

    async def wait_settled(
        self, *, expect: Mapping[str, str] | None = None, timeout_s: float = 60
    ) -> None:
        await self.wait_until(lambda: self.settled(expect=expect), timeout_s=timeout_s,
                              what=f"settled at {dict(expect or {})}")

    async def wait_seen_up(self, *, timeout_s: float = 60) -> None:
        """Until the status document shows every area's daemon up where it is placed. Settled
        (the heartbeats) can come first: a remote area's process view is the agent's next
        inventory, so a snapshot of the status taken at settled may still say `missing`."""
        async def every_area_up() -> bool:
            services = (await self.status())["services"].values()
            return all(a["process"]["health"] == "up" for s in services for a in s["areas"])
        await self.wait_until(every_area_up, timeout_s=timeout_s, what="every area seen up")

    async def wait_until(
        self, predicate: Callable[[], Any], *, timeout_s: float, what: str = "condition"
    ) -> Any:
        """The predicate's first true value (a coroutine's is awaited), asked every 0.2 s."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = predicate()
            if asyncio.iscoroutine(result):
                result = await result
            if result:
                return result
            if time.monotonic() > deadline:
                tail = "\n".join(self.log_lines[-40:])
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{tail}")
            await asyncio.sleep(0.2)

    # -- teardown ----------------------------------------------------------------------------

    async def close(self) -> None:
        if self.daemon is not None and self.daemon.returncode is None:
            with contextlib.suppress(TimeoutError, ProcessLookupError):
                await self.stop_monitord(timeout_s=20)
        if self.daemon is not None and self.daemon.returncode is None:
            self.daemon.kill()
            await self.daemon.wait()
        await asyncio.to_thread(kill_processes_under, self.root)
        if self._session is not None:
            await self._session.close()
        if self.vps is not None:
            await self.vps.__aexit__(None, None, None)
        await self.detector.close()
        await self._tasks.close()


def kill_processes_under(root: Path) -> int:
    """SIGKILL every process whose command line or environment names `root`, except us and
    our ancestors: `timeout 300 monitord demo --dir D` (or a shell running it) names D too."""
    needle = str(root).encode()
    spared = _self_and_ancestors()
    killed = 0
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) in spared:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in cmdline or needle in environ:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    return killed


def _self_and_ancestors() -> set[int]:
    chain, pid = set(), os.getpid()
    while pid > 1 and pid not in chain:
        chain.add(pid)
        parent = proc_identity.parent_of(pid)
        if parent is None:
            break
        pid = parent
    return chain


@contextlib.asynccontextmanager
async def running_stack(root: Path, **options: Any) -> AsyncIterator[Stack]:
    async with Stack(root, StackOptions(**options)) as stack:
        yield stack
