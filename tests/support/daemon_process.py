"""`monitord run` as a real subprocess for tests: a temp config, a free port, readiness, logs.

    async with daemon_process.running_daemon(tmp_path) as daemon:
        status, body = await daemon.request("GET", "/readyz")
        ...
    # leaving the block sends SIGTERM, waits for exit (then SIGKILL) and reaps the process

`write_config()` alone gives a config file for tests that start processes themselves, and
`DaemonProcess.start()` starts one without waiting (for duplicate-start races). stderr is read
continuously into `lines`; `events()` parses the structlog JSON lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from monitord.base import area_paths, cgroup_fence, proc_identity
from monitord.base.proc_identity import ProcessIdentity
from monitord.testing.ports import free_port

SERVICE_BLOCK = """
[services.tg]
command = ["/bin/sleep", "3600"]
local_data_dir = "{root}/data/tg/{{area}}"
remote_data_dir = "/opt/offload/data/tg/{{area}}"
"""


def write_config(
    root: Path,
    *,
    port: int | None = None,
    work_dir: Path | None = None,
    drain_timeout_s: float = 5.0,
    extra_toml: str = "",
    services: bool = True,
) -> Path:
    """A monitord.toml under `root` (work and spool dirs inside it) and return its path."""
    root.mkdir(parents=True, exist_ok=True)
    work = work_dir or root / "work"
    text = (
        "[monitord]\n"
        f'work_dir = "{work}"\n'
        f'spool_dir = "{root / "spool"}"\n'
        'owner_label = "test-pbx"\n'
        'log_format = "json"\n'
        "watchdog_interval_s = 0.5\n"
        "[http]\n"
        f'listen = "127.0.0.1:{port or free_port()}"\n'
        f"drain_timeout_s = {drain_timeout_s}\n"
    )
    if services:
        text += SERVICE_BLOCK.format(root=root)
    path = root / "monitord.toml"
    path.write_text(text + extra_toml)
    return path


def _listen_of(config_path: Path) -> str:
    import tomllib

    data = tomllib.loads(config_path.read_text())
    return str(data["http"]["listen"])


def _work_dir_of(config_path: Path) -> Path:
    import tomllib

    data = tomllib.loads(config_path.read_text())
    return Path(data["monitord"]["work_dir"])


@dataclass(frozen=True)
class ApiClient:
    """Plain HTTP calls to a monitord API at `base_url` (a subprocess or an in-process daemon).

    With `work_dir`, every request carries the daemon's API token from `work_dir/api-token`
    (read at each request: the daemon writes it at start), as an authorised operator's CLI
    does; `authorised=False` leaves it out."""

    base_url: str
    work_dir: Path | None = None

    async def request(
        self, method: str, path: str, *, json_body: Any = None, timeout_s: float = 5.0,
        authorised: bool = True,
    ) -> tuple[int, Any]:
        """One HTTP request to the daemon: (status, parsed JSON body or text)."""
        from monitord.surface import api_token

        timeout = aiohttp.ClientTimeout(total=timeout_s)
        headers = {}
        if authorised and self.work_dir is not None:
            token, _ = api_token.read(self.work_dir)
            if token is not None:
                headers["Authorization"] = f"Bearer {token}"
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.request(method, self.base_url + path, json=json_body,
                            headers=headers) as response,
        ):
            text = await response.text()
            try:
                return response.status, json.loads(text)
            except json.JSONDecodeError:
                return response.status, text

    async def status_of(self, path: str) -> int | None:
        """The HTTP status of GET `path`, or None if nothing answers."""
        try:
            status, _ = await self.request("GET", path, timeout_s=1.0)
        except (aiohttp.ClientError, TimeoutError):
            return None
        return status


@dataclass
class DaemonProcess:
    """One `monitord run` subprocess and what it wrote to stderr."""

    config_path: Path
    proc: asyncio.subprocess.Process
    base_url: str
    lines: list[str] = field(default_factory=list)
    _reader: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls, config_path: Path, *, env: Mapping[str, str] | None = None, verb: str = "run"
    ) -> DaemonProcess:
        """Start without waiting for anything (see `wait_ready`)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "monitord",
            verb,
            "-c",
            str(config_path),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        daemon = cls(config_path=config_path, proc=proc, base_url=f"http://{_listen_of(config_path)}")
        daemon._reader = asyncio.create_task(daemon._read_stderr(), name=f"stderr-{proc.pid}")
        return daemon

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.lines.append(line.decode("utf-8", "replace").rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """Parsed JSON log lines (non-JSON lines are skipped), optionally only one event."""
        parsed = []
        for line in self.lines:
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if isinstance(event, dict) and (name is None or event.get("event") == name):
                    parsed.append(event)
        return parsed

    @property
    def api(self) -> ApiClient:
        return ApiClient(self.base_url, work_dir=_work_dir_of(self.config_path))

    async def request(
        self, method: str, path: str, *, json_body: Any = None, timeout_s: float = 5.0,
        authorised: bool = True,
    ) -> tuple[int, Any]:
        return await self.api.request(method, path, json_body=json_body, timeout_s=timeout_s,
                                      authorised=authorised)

    async def status_of(self, path: str) -> int | None:
        return await self.api.status_of(path)

    async def wait_ready(self, *, timeout_s: float = 20.0) -> float:
        """Poll /readyz until 200; returns seconds waited. Fails if the process exits first."""
        started = time.monotonic()
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                raise AssertionError(
                    f"monitord exited with {self.proc.returncode} before ready:\n"
                    + "\n".join(self.lines[-20:])
                )
            if await self.status_of("/readyz") == 200:
                return time.monotonic() - started
            await asyncio.sleep(0.02)
        raise AssertionError(f"monitord not ready within {timeout_s} s:\n" + "\n".join(self.lines))

    async def wait_exit(self, *, timeout_s: float = 10.0) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout=timeout_s)
        if self._reader is not None:
            await asyncio.wait_for(self._reader, timeout=timeout_s)
        return code

    def send_signal(self, signum: int) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signum)

    async def stop(self, *, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait for exit; SIGKILL if it does not go in time. Returns the exit code."""
        self.send_signal(signal.SIGTERM)
        try:
            return await self.wait_exit(timeout_s=timeout_s)
        except TimeoutError:
            self.kill()
            await self.wait_exit(timeout_s=timeout_s)
            raise

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def close(self) -> None:
        """Make sure the process is gone and reaped and the reader finished (idempotent)."""
        if self.proc.returncode is None:
            self.kill()
        with contextlib.suppress(TimeoutError):
            await self.wait_exit(timeout_s=10.0)
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


@asynccontextmanager
async def running_daemon(
    root: Path,
    *,
    config_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 20.0,
    **config_options: Any,
) -> AsyncIterator[DaemonProcess]:
    """A ready `monitord run` (config written under `root` unless `config_path` is given)."""
    path = config_path or write_config(root, **config_options)
    daemon = await DaemonProcess.start(path, env=env)
    try:
        await daemon.wait_ready(timeout_s=ready_timeout_s)
        yield daemon
        if daemon.proc.returncode is None:
            await daemon.stop()
    finally:
        await daemon.close()
        kill_supervised(_work_dir_of(path))


def kill_supervised(work_dir: Path) -> None:
    """SIGKILL the process group of every daemon a supervisor record under `work_dir` names,
    and what is in its cgroup (removed once empty, within 2 s): monitord leaves its areas
    running when it stops, for the next one to adopt; a test that is done with them must not
    leave them, nor the log hub that waits on their output."""
    cgroups = []
    for record_path in (work_dir / area_paths.SUPERVISOR_DIR / "records").glob("*.json"):
        try:
            record = json.loads(record_path.read_text())
            identity = ProcessIdentity.from_json(record["identity"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        cgroup = record.get("cgroup")
        if isinstance(cgroup, str) and cgroup.startswith("/sys/fs/cgroup/"):
            cgroups.append(cgroup)
            with contextlib.suppress(OSError):
                cgroup_fence.kill(cgroup)
        if proc_identity.is_same_process(identity):
            proc_identity.signal_group(identity.pid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    for cgroup in cgroups:
        with contextlib.suppress(OSError):
            while cgroup_fence.populated(cgroup) and time.monotonic() < deadline:
                time.sleep(0.01)
        cgroup_fence.remove(cgroup)
