"""A real `monitord agent` subprocess on a temp dir, for tests.

`running_agent(base_dir)` writes `agent.secret` (unless one is there), starts the agent as it
runs on a VPS — the built monitord.pyz under the system interpreter in isolated mode
(`/usr/bin/python3 -I -S monitord.pyz agent --dir base_dir`: no site-packages, no
PYTHONPATH, so anything beyond the standard library fails here) — waits until it listens on its Unix
socket and answers /readyz, and yields an `AgentProcess` with an authorised HTTP client.
On exit it stops the agent and then kills whatever lease guards and daemons the agent left
running (by design they outlive the agent), identified by the
records in `{dir}/run/` — by pid, start time and argv, never by pid alone — and what is in
the cgroups those records name.
Used by the agent tests and by later tests that need a VPS-side agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from monitord.base import cgroup_fence, proc_identity
from monitord.base.proc_identity import ProcessIdentity
from monitord.remote import artifact

START_TIMEOUT_S = 20.0
DEFAULT_SECRET = "test-agent-secret-0123456789abcdef"


@dataclass
class AgentProcess:
    """A running agent: its dir, process, address, secret and an HTTP client."""

    base_dir: Path
    process: asyncio.subprocess.Process
    address: str  # the agent's Unix socket
    secret: str
    session: aiohttp.ClientSession
    log_path: Path
    exited_status: int | None = field(default=None)

    @property
    def url(self) -> str:
        return "http://agent"

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        auth: bool = True,
        token: str | None = None,
        timeout_s: float = 15.0,
    ) -> tuple[int, Any]:
        """(status, decoded JSON body) of one request to the agent."""
        headers = {}
        if auth:
            headers["Authorization"] = f"Bearer {token if token is not None else self.secret}"
        async with self.session.request(
            method,
            f"{self.url}{path}",
            json=json_body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            return response.status, await response.json(content_type=None)

    async def inventory(self) -> dict[str, Any]:
        status, body = await self.request("GET", "/v1/inventory")
        assert status == 200, body
        return dict(body)

    async def kill(self, sig: signal.Signals = signal.SIGKILL, *, timeout_s: float = 10.0) -> int:
        """Signal the agent and reap it; returns its exit status."""
        if self.process.returncode is None:
            self.process.send_signal(sig)
        status = await asyncio.wait_for(self.process.wait(), timeout=timeout_s)
        self.exited_status = status
        return status

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


# The interpreter a bare Debian/Ubuntu VPS has; the agent's tests run under it, isolated
# (-I: no PYTHON* variables, no user site) and without any site-packages at all (-S), so
# anything beyond the standard library fails here.
SYSTEM_PYTHON = "/usr/bin/python3"
ISOLATED = ("-I", "-S")
_PYZ_DIR = Path(tempfile.mkdtemp(prefix="monitord-test-pyz-"))


def built_pyz() -> Path:
    """This checkout's monitord.pyz, built once per test process."""
    path = _PYZ_DIR / artifact.PYZ_NAME
    if not path.exists():
        artifact.build(_PYZ_DIR)
    return path


def vps_command(*args: str) -> list[str]:
    """argv running a VPS verb exactly as on a VPS: system python3, isolated, the pyz."""
    return [SYSTEM_PYTHON, *ISOLATED, str(built_pyz()), *args]


def agent_command(base_dir: Path, *, extra_args: Sequence[str] = ()) -> list[str]:
    return vps_command("agent", "--dir", str(base_dir), "--log-format", "json", *extra_args)


def unix_session(socket_path: Path | str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket_path)))


def write_secret(base_dir: Path, secret: str) -> None:
    base_dir.mkdir(parents=True, exist_ok=True)
    path = base_dir / "agent.secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")


def kill_left_processes(base_dir: Path) -> None:
    """SIGKILL every guard (and its daemon, and what is in the daemon's cgroup) named by a
    record in `{dir}/run/`; the cgroups are removed once empty (within 2 s)."""
    cgroups = []
    for record_path in (base_dir / "run").glob("*.json"):
        try:
            record = json.loads(record_path.read_text())
            identity = ProcessIdentity.from_json(record["guard"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        cgroup = record.get("cgroup")
        if isinstance(cgroup, str) and cgroup.startswith("/sys/fs/cgroup/"):
            cgroups.append(cgroup)
            with contextlib.suppress(OSError):
                cgroup_fence.kill(cgroup)
        if not proc_identity.is_same_process(identity):
            continue
        daemons = proc_identity.children_of({identity.pid})[identity.pid]
        for pgid in (*daemons, identity.pid):
            proc_identity.signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    for cgroup in cgroups:
        with contextlib.suppress(OSError):
            while cgroup_fence.populated(cgroup) and time.monotonic() < deadline:
                time.sleep(0.01)
        cgroup_fence.remove(cgroup)


def _read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _open_log(path: Path) -> Any:
    return open(path, "wb")


async def _wait_ready(agent_dir: Path, process: asyncio.subprocess.Process, secret: str,
                      log_path: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    address_path = agent_dir / "agent.address"
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise RuntimeError(
                f"agent exited with {process.returncode}:\n{_read_log(log_path)}"
            )
        if address_path.exists():
            address = address_path.read_text().strip()
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with unix_session(address) as session, session.get(
                    "http://agent/readyz",
                    headers={"Authorization": f"Bearer {secret}"},
                    timeout=aiohttp.ClientTimeout(total=1.0),
                ) as response:
                    if response.status == 200:
                        return address
        await asyncio.sleep(0.05)
    raise TimeoutError(f"agent not ready in {START_TIMEOUT_S}s:\n{_read_log(log_path)}")


@contextlib.asynccontextmanager
async def running_agent(
    base_dir: Path,
    *,
    secret: str = DEFAULT_SECRET,
    stop_grace_s: float = 1.0,
    fence_grace_s: float = 0.3,
    extra_args: Sequence[str] = (),
    kill_daemons_on_exit: bool = True,
    command: Sequence[str] | None = None,
) -> AsyncIterator[AgentProcess]:
    """Start a real agent on `base_dir` and yield it once it is ready; stop it on exit.
    `command` replaces the built pyz's `agent --dir base_dir` (e.g. another artifact)."""
    if not (base_dir / "agent.secret").exists():
        write_secret(base_dir, secret)
    (base_dir / "agent.address").unlink(missing_ok=True)
    log_path = base_dir / f"agent-test-{time.monotonic_ns()}.log"
    args = ["--stop-grace", str(stop_grace_s), "--fence-grace", str(fence_grace_s), *extra_args]
    with _open_log(log_path) as log:
        argv = (
            [*command, "--log-format", "json", *args]
            if command is not None
            else agent_command(base_dir, extra_args=args)
        )
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    session: aiohttp.ClientSession | None = None
    try:
        address = await _wait_ready(base_dir, process, secret, log_path)
        session = unix_session(address)
        yield AgentProcess(
            base_dir=base_dir,
            process=process,
            address=address,
            secret=secret,
            session=session,
            log_path=log_path,
        )
    finally:
        if session is not None:
            await session.close()
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout=10.0)
            except TimeoutError:
                process.kill()
                await asyncio.wait_for(process.wait(), timeout=10.0)
        if kill_daemons_on_exit:
            kill_left_processes(base_dir)


async def wait_until(
    condition: Any, *, timeout_s: float, what: str, interval_s: float = 0.05
) -> None:
    """Poll `condition()` (sync or async) until it is true; fail naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)
