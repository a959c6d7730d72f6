"""The verbs `monitord agent` (run the agent in the foreground) and `monitord agent-launch`
(its idempotent launcher: start it detached unless it already runs, wait until it is ready).

`agent` takes the agent's singleton lock on its dir first (exit 3 with a `duplicate_instance`
event when another agent holds it), adopts or stops what a previous agent left, then serves
the manager API on its Unix socket `{dir}/api/agent.sock` (monitord.vps.server). Once
listening it writes the socket's path to `{dir}/agent.address`. SIGTERM/SIGINT stop it; its
daemons stay under their lease guards. Called through monitord.vps.entry (monitord.pyz);
provisioning runs `agent-launch` over SSH.

Upgrades: a running agent records which code it runs in `{dir}/agent.version` (the SHA-256
of the monitord.pyz it was started from). `agent-launch` from a different artifact (a new
version was pushed) stops the old agent with SIGTERM — its daemons stay under their lease
guards — and starts the new one, which adopts them; from the same artifact it does nothing.

One supervisor: an agent records who started it in `{dir}/agent.supervisor` — `systemd` (the
`monitord-agent` unit runs it with `--supervised-by systemd`) or `launch`. Where the unit runs
the agent, `agent-launch` hands over to it instead of starting a second agent outside it: for
an upgrade it stops the unit's agent and waits for the unit (`Restart=always`, the same pyz
path) to start the new code; with no agent running but the unit installed, it waits for the
unit first. It starts one itself only when the unit does not within its wait. The other way
round, a unit's agent that finds the dir held by a launched agent stops that one and takes
over (its daemons stay under their guards), so the unit ends up the one supervisor.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from monitord.base import singleton

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_DUPLICATE = 3
_DUPLICATE_RETRIES = 3  # agent-launch: starts again after an agent that found the lock held
ADDRESS_NAME = "agent.address"
VERSION_NAME = "agent.version"
LOCK_NAME = "agent"
SUPERVISOR_NAME = "agent.supervisor"
AGENT_LOG_NAME = "agent.log"  # in {dir}/logs/, through a log sink (capped and rotated)
STOP_OLD_AGENT_S = 15.0
# An agent holding its lock writes its version at once, then gets ready: one that has said
# neither within this long is judged by what its version file says.
STARTING_AGENT_S = 5.0
AGENT_UNIT = "monitord-agent.service"
# With the unit installed but no agent running, how long agent-launch waits for the unit to
# start one (its Restart= delay, or its path unit noticing a first monitord.pyz) before it
# starts one itself.
UNIT_START_WAIT_S = 10.0


def code_version() -> str:
    """Which code this process runs: `sha256:<hex>` of its monitord.pyz, or `dev:<dir>` when
    it runs from an installed tree (then every launcher of that tree counts as the same)."""
    import hashlib

    from monitord.vps.area_runner import package_root

    root = Path(package_root())
    if not root.is_file():
        return f"dev:{root}"
    return "sha256:" + hashlib.sha256(root.read_bytes()).hexdigest()


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, required=True, help="remote bin dir (agent home)")
    parser.add_argument("--stop-grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL on a requested stop")
    parser.add_argument("--fence-grace", type=float, default=0.5,
                        help="seconds between SIGTERM and SIGKILL when a lease lapses")
    parser.add_argument("--log-format", default="auto", choices=("auto", "json", "console"))


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    _common_arguments(parser)
    # Set by agent-launch: the version it compares against is the one the agent records.
    parser.add_argument("--code-version", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--supervised-by", choices=("launch", "systemd"), default="launch",
                        help="who restarts this agent (the unit passes systemd)")


def add_agent_launch_arguments(parser: argparse.ArgumentParser) -> None:
    _common_arguments(parser)
    parser.add_argument("--wait", type=float, default=15.0, help="seconds to wait for ready")


def main_agent(args: argparse.Namespace) -> int:
    import asyncio

    from monitord.base import singleton
    from monitord.vps import event_log as logs

    logs.configure(args.log_format)
    log = logs.get_logger(__name__)
    base_dir: Path = args.dir.resolve()
    base_dir.mkdir(parents=True, exist_ok=True)
    lock: singleton.InstanceLock | None
    try:
        lock = singleton.acquire(base_dir, name=LOCK_NAME)
    except singleton.AlreadyRunning as e:
        lock = _take_over(base_dir, log) if args.supervised_by == "systemd" else None
        if lock is None:
            log.error("duplicate_instance", error_code="DUPLICATE_INSTANCE",
                      holder_pid=e.holder_pid, dir=str(base_dir))
            return EXIT_DUPLICATE
    with lock:
        from monitord.base import atomic_file

        version = args.code_version or code_version()
        atomic_file.atomic_write_bytes(base_dir / VERSION_NAME, (version + "\n").encode())
        atomic_file.atomic_write_bytes(base_dir / SUPERVISOR_NAME,
                                       (args.supervised_by + "\n").encode())
        try:
            return asyncio.run(_serve(args, base_dir=base_dir))
        except OSError as e:
            log.error("agent_start_failed", error_code="DAEMON_START_FAILED", detail=str(e))
            return EXIT_FAILURE


async def _serve(args: argparse.Namespace, *, base_dir: Path) -> int:
    import asyncio
    import signal

    from monitord.base import atomic_file
    from monitord.vps import server
    from monitord.vps.runtime import AgentRuntime

    address_path = base_dir / ADDRESS_NAME
    address_path.unlink(missing_ok=True)
    stop = asyncio.Event()
    failures: list[BaseException] = []

    def _fatal(error: BaseException) -> None:
        failures.append(error)
        stop.set()

    runtime = AgentRuntime(
        base_dir=base_dir,
        stop_grace_s=args.stop_grace,
        fence_grace_s=args.fence_grace,
        on_fatal=_fatal,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await runtime.start()
    socket_path = server.socket_path(base_dir)
    try:
        listener = await server.start_server(
            runtime, socket_path=socket_path, secret_path=base_dir / server.SECRET_NAME
        )
    except BaseException:
        await runtime.close()
        raise
    try:
        atomic_file.atomic_write_bytes(address_path, f"{socket_path}\n".encode())
        await stop.wait()
    finally:
        address_path.unlink(missing_ok=True)
        listener.close()
        await listener.wait_closed()
        socket_path.unlink(missing_ok=True)
        await runtime.close()
    return EXIT_FAILURE if failures else EXIT_OK


def _take_over(base_dir: Path, log: Any) -> singleton.InstanceLock | None:
    """The unit's agent found the dir held: by an agent `agent-launch` started, which it stops
    (its daemons stay under their guards, this one adopts them) before taking the lock; the
    lock, or None when the holder is the unit's own or would not let go."""
    from monitord.base import singleton

    if _supervisor(base_dir) == "systemd":
        return None  # another unit's agent: a real duplicate
    log.info("agent_taking_over", dir=str(base_dir), holder=_supervisor(base_dir))
    if not _stop_old_agent(base_dir):
        return None
    try:
        return singleton.acquire(base_dir, name=LOCK_NAME)
    except singleton.AlreadyRunning:
        return None


def _supervisor(base_dir: Path) -> str:
    try:
        return (base_dir / SUPERVISOR_NAME).read_text().strip() or "launch"
    except OSError:
        return "launch"


def _unit_installed() -> bool:
    """Whether the agent's systemd unit is installed and enabled on this VPS (asked of
    systemctl, which any user may ask; False without systemd)."""
    try:
        shown = subprocess.run(
            ["systemctl", "show", AGENT_UNIT, "--property=LoadState,UnitFileState"],
            capture_output=True, text=True, timeout=5, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    fields = dict(line.partition("=")[::2] for line in shown.stdout.splitlines())
    return fields.get("LoadState") == "loaded" and fields.get("UnitFileState") in (
        "enabled", "enabled-runtime", "static", "linked")


def _wait_ready(base_dir: Path, *, version: str, wait_s: float) -> bool:
    """Whether an agent of `version` is ready on `base_dir` within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if _ready(base_dir) and _running_version(base_dir) == version:
            return True
        time.sleep(0.1)  # poll interval of a bounded wait for another process
    return False


def _ready(base_dir: Path) -> bool:
    """The agent holds its lock, is listening and answers /readyz."""
    from monitord.base import singleton
    from monitord.vps import server

    if not singleton.is_held(base_dir, name=LOCK_NAME):
        return False
    try:
        secret = (base_dir / server.SECRET_NAME).read_text().strip()
        status = server.probe(server.socket_path(base_dir), "/readyz", secret=secret)
    except OSError:
        return False
    return status == 200


def _running_version(base_dir: Path) -> str:
    try:
        return (base_dir / VERSION_NAME).read_text().strip()
    except OSError:
        return "unknown"


def _holder_version(base_dir: Path, *, wanted: str) -> str:
    """The version of the agent holding `base_dir`'s lock. One that says another version
    and is not ready may be an agent still starting (another launcher's, this moment): it
    takes the lock before it writes its version, so the file still says the previous
    agent's. It gets STARTING_AGENT_S to say `wanted` or be ready before it is judged."""
    from monitord.base import singleton

    running = _running_version(base_dir)
    deadline = time.monotonic() + STARTING_AGENT_S
    while running != wanted and not _ready(base_dir) and time.monotonic() < deadline:
        if not singleton.is_held(base_dir, name=LOCK_NAME):
            break  # it has gone: the caller starts one
        time.sleep(0.05)  # poll interval of a bounded wait for another process
        running = _running_version(base_dir)
    return running


def _stop_old_agent(base_dir: Path) -> bool:
    """SIGTERM the agent holding `base_dir` (verified by its command line), wait for the lock."""
    import signal

    from monitord.base import singleton

    pid = singleton.read_holder_pid(base_dir / f"{LOCK_NAME}.pid")
    if pid is not None:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            cmdline = []
        # Only a process that is an agent of this very dir; a reused PID is left alone.
        if b"agent" in cmdline and str(base_dir).encode() in cmdline:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + STOP_OLD_AGENT_S
    while singleton.is_held(base_dir, name=LOCK_NAME):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # poll interval of a bounded wait for another process's lock
    return True


def main_agent_launch(args: argparse.Namespace) -> int:

    from monitord.base import log_sink, singleton
    from monitord.vps import event_log as logs
    from monitord.vps.area_runner import vps_command, vps_environment

    logs.configure(args.log_format)
    log = logs.get_logger(__name__)
    base_dir: Path = args.dir.resolve()
    base_dir.mkdir(parents=True, exist_ok=True)
    wanted = code_version()
    if singleton.is_held(base_dir, name=LOCK_NAME):
        running = _holder_version(base_dir, wanted=wanted)
        if running == wanted:
            return EXIT_OK
        by_unit = _supervisor(base_dir) == "systemd"
        log.info("agent_upgrading", dir=str(base_dir), running=running, new=wanted,
                 supervisor="systemd" if by_unit else "launch")
        if not _stop_old_agent(base_dir):
            log.error("agent_upgrade_failed", error_code="DAEMON_STOP_FAILED", dir=str(base_dir),
                      detail="the running agent did not release its lock")
            return EXIT_FAILURE
        # The unit restarts its agent from the same pyz path, now the new code.
        if by_unit and _wait_ready(base_dir, version=wanted, wait_s=args.wait):
            log.info("agent_restarted_by_unit", dir=str(base_dir), version=wanted)
            return EXIT_OK
    elif _unit_installed():
        if _wait_ready(base_dir, version=wanted, wait_s=min(args.wait, UNIT_START_WAIT_S)):
            log.info("agent_started_by_unit", dir=str(base_dir), version=wanted)
            return EXIT_OK
        log.warning("agent_unit_silent", dir=str(base_dir), unit=AGENT_UNIT,
                    detail="the unit did not start the agent: starting it outside the unit")
    (base_dir / "logs").mkdir(exist_ok=True)
    env = vps_environment(dict(os.environ))
    argv = vps_command("agent", "--dir", str(base_dir), "--stop-grace", str(args.stop_grace),
                       "--fence-grace", str(args.fence_grace), "--log-format", "json",
                       "--code-version", wanted)

    def spawn() -> subprocess.Popen[bytes]:
        # agent.log through a log sink, capped and rotated like an area's log (docs/agent.md)
        child, _ = log_sink.spawn_logged(
            argv, env=env, sink_env=vps_environment(dict(os.environ)),
            sink_argv=vps_command("log-sink", *log_sink.arguments(
                path=base_dir / "logs" / AGENT_LOG_NAME, max_bytes=log_sink.DEFAULT_MAX_BYTES,
                keep=log_sink.DEFAULT_KEEP)),
        )
        return child

    child = spawn()
    retries = _DUPLICATE_RETRIES
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        if _ready(base_dir):
            log.info("agent_launched", pid=child.pid, dir=str(base_dir))
            return EXIT_OK
        if child.poll() is not None and not singleton.is_held(base_dir, name=LOCK_NAME):
            # It died and nobody holds the lock now. If it found the lock held, that was
            # another launcher's probe (is_held takes the lock for an instant) or an agent
            # that has gone since: start it again, a few times at most.
            if child.returncode != EXIT_DUPLICATE or retries == 0:
                break
            retries -= 1
            child = spawn()
        time.sleep(0.05)
    log.error("agent_launch_failed", error_code="DAEMON_START_FAILED", dir=str(base_dir),
              exit_status=child.poll())
    return EXIT_FAILURE


# The verbs this module serves (monitord.surface.cli): verb -> (add arguments, run).
VERBS = {
    "agent": (add_agent_arguments, main_agent),
    "agent-launch": (add_agent_launch_arguments, main_agent_launch),
}
