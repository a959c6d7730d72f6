"""`monitord check -c FILE [--remote] [--service NAME]`: is this configuration usable, and is
the VPS ready for a first move? Pushes, starts and moves nothing (docs/vps-setup.md): on
the VPS it only creates and removes preflight's test file, and `tunnel-lease show` takes
the lease's lock file (creating it if it is not there yet).

Without `--remote`, like `nginx -t`: monitord.toml loads (monitord.base.config), the files
it names exist (key_file, known_hosts, remote.artifacts), and the authoritative
`custom_config.json` it points at parses the way the daemon reads it
(monitord.store.spool_files). A `fence:` line says whether local areas are fenced by cgroup
or by process group only, and why, as monitord decided at its last start (it alone can tell:
it runs in its own cgroup, under its unit's sandbox; monitord.base.cgroup_fence). Deprecated
keys, quarantined entries and areas of services that are not configured are printed as
`warning:` lines; then `configuration ok: FILE`.

With `--remote`, then: one SSH connection made exactly as the tunnel keeper makes it
(monitord.remote.tunnel.ssh_connect), the interpreter probed with a bare
`{remote_python} -I -c ...`, and preflight (monitord.remote.preflight) run for each
configured service (or `--service`), with this monitord's artifacts built into a temp dir
to compare hashes — nothing is pushed and nothing is started — plus an `sftp` line
(preflight does not use SFTP; provisioning and area copies do). One line per check
(`✔` passed, `✘` failed, `–` not checked, with the reason) and a summary line. The `vps:`
line names the SSH server's version (its identification string) and the interpreter's; a
`warning:` line follows for either when it is outside the tested releases (`TESTED_OPENSSH`,
`TESTED_PYTHON`: docs/vps-setup.md), or when the server is not OpenSSH. Where the
check sees less than the daemon's preflight does, it says so instead of failing:

- forwards: only the daemon's tunnel keeper can prove them (it requests each one and does
  a round trip through it after connecting); always `–`, "checked by the daemon";
- tunnel_owner: read with a read-only `tunnel-lease show` on the VPS and judged by the
  keeper's own rule (orchestrator.tunnel_lease.decide_acquire); `–` while monitord.pyz is
  not on the VPS;
- artifacts missing or of another version (before the daemon's first connect, or after an
  upgrade): `–`, the daemon pushes them when it connects; the self-check inside the
  `agent` check needs the pushed pyz, so until then `agent` reports the interpreter probe;
- agent: sshd answers a refused direct-streamlocal channel (the kind the agent is reached
  over) and an agent that is not running alike, so check opens one to a throwaway socket
  of its own on the VPS: a refusal fails `agent` even before the agent first runs. The
  line ends with the self-check's `fence` (how the agent fences areas on the VPS);
- remote_config: needs the agent secret the daemon keeps in work_dir; `–` before it exists;
- memory: the VPS's available memory against its lease guard and remote.memory_reserve_mib
  alone: each move needs its daemon's memory on top, which only the daemon's preflight
  knows; `–` when remote_config is;
- disk_space: the free bytes and inodes under each service's data root on the VPS (the
  fixed leading part of its remote_data_dir, monitord.base.area_paths.remote_data_root)
  against the margin alone: each move needs its area's size on top, which only the
  daemon's preflight knows.

Exit codes: 0 no check failed, 1 a check failed, 2 an unusable configuration (one line
`monitord: CODE: detail` on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import re
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from monitord.base import outside_text
from orchestrator.errors import ErrorCode, MonitordError, lookup

if TYPE_CHECKING:
    import asyncssh

    from monitord.base.config import Config, RemoteSection
    from monitord.remote.agent_client import AgentClient
    from monitord.remote.preflight import CheckResult
    from monitord.remote.provisioning import LocalArtifact

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
MARKS = {"ok": "✔", "failed": "✘", "skipped": "–"}
PROBE_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 2.0
# The interpreter probe, exactly as an operator would type it on the VPS.
PYTHON_PROBE = "import sys; print(sys.version_info[:3])"
MIN_PYTHON = (3, 9)
# The releases the fault tier runs every promise on (docs/vps-setup.md, "Tested releases"):
# Debian 11 (OpenSSH 8.4, Python 3.9) to Debian 13 (OpenSSH 10.0, Python 3.13).
TESTED_OPENSSH = ((8, 4), (10, 0))
TESTED_PYTHON = (MIN_PYTHON, (3, 13))
_OPENSSH_VERSION = re.compile(r"^SSH-2\.0-OpenSSH_(\d+)\.(\d+)")
# A throwaway Unix socket in a temp dir under the bin dir ($1) that answers one connection
# with "ok", then removes itself (also on SIGTERM/SIGHUP, when the session ends first).
_SOCKET_PROBE = """
import os, signal, socket, sys, tempfile
for sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda *_: sys.exit(0))
base = sys.argv[1] if os.path.isdir(sys.argv[1]) else None
scratch = tempfile.mkdtemp(prefix=".check-sock.", dir=base)
path = os.path.join(scratch, "s")
server = socket.socket(socket.AF_UNIX)
try:
    server.bind(path)
    server.listen(1)
    server.settimeout(10)
    print(path, flush=True)
    peer, _ = server.accept()
    peer.sendall(b"ok")
    peer.close()
except OSError:
    pass
finally:
    server.close()
    if os.path.exists(path):
        os.unlink(path)
    os.rmdir(scratch)
"""


class CheckUsageError(Exception):
    """An unusable configuration: exit 2 with `monitord: CODE: detail`."""

    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Validated:
    """A configuration that loads, and what the operator should still read about it."""

    path: Path
    config: Config
    notes: tuple[str, ...]  # printed as they are (the placement summary)
    warnings: tuple[str, ...]  # printed as `warning: ...`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c", "--config", type=Path, default=None,
        help="monitord.toml (default: $MONITORD_CONFIG, then /etc/monitord/monitord.toml)",
    )
    parser.add_argument(
        "--remote", action="store_true",
        help="also check the VPS: SSH as the tunnel does, then preflight; pushes and starts"
             " nothing",
    )
    parser.add_argument(
        "--service", default=None, help="with --remote: preflight this service only"
    )


def main(args: argparse.Namespace) -> int:
    from monitord.base import config as config_module
    from monitord.base import logs

    # Log lines (preflight's summary, asyncssh's warnings) go to stderr, and only warnings:
    # stdout is the report.
    logs.configure("auto", level=logging.WARNING)
    path: Path = args.config or config_module.default_path()
    try:
        validated = validate(path)
        services = _services_to_check(validated.config, args.service, path=path)
        if args.remote and validated.config.remote is None:
            raise CheckUsageError(
                ErrorCode.CONFIG_INVALID, f"{path}: no [remote] section, nothing to check remotely"
            )
    except CheckUsageError as e:
        print(f"monitord: {e.code}: {e.detail}", file=sys.stderr)
        return EXIT_USAGE
    for note in validated.notes:
        print(note)
    for warning in validated.warnings:
        print(f"warning: {warning}")
    print(f"configuration ok: {path}")
    if not args.remote:
        return EXIT_OK
    try:
        return asyncio.run(check_remote(validated.config, services=services))
    except CheckUsageError as e:
        print(f"monitord: {e.code}: {e.detail}", file=sys.stderr)
        return EXIT_USAGE


# -- the configuration ---------------------------------------------------------------------


def validate(path: Path) -> Validated:
    """Load monitord.toml and the custom_config.json it names, as the daemon would."""
    from monitord.base import config as config_module
    from monitord.store import spool_files

    try:
        config = config_module.load(path)
    except config_module.ConfigError as e:
        raise CheckUsageError(ErrorCode.CONFIG_INVALID, e.detail) from e
    warnings = [f"deprecated: {message}" for message in
                (config.remote.deprecations if config.remote else ())]
    if config.remote is not None:
        _check_remote_files(config.remote, path=path)

    placement_path = config.monitord.spool_dir / spool_files.CUSTOM_CONFIG_NAME
    try:
        placement = spool_files.read_custom_config(placement_path)
    except spool_files.ConfigCorrupt as e:
        raise CheckUsageError(ErrorCode.CONFIG_CORRUPT, e.detail) from e
    for invalid in placement.invalid:
        warnings.append(f"{invalid.code}: {placement_path}: {invalid.detail} (quarantined:"
                        " never started, never sent to the VPS)")
    for area in placement.entries:
        if area.service not in config.services:
            warnings.append(
                f"{ErrorCode.UNKNOWN_SERVICE}: {placement_path}: area {area.uuid} is of service"
                f" {area.service!r}, which {path} does not configure (the daemon leaves it alone)"
            )
    if placement_path.exists():
        remote = sum(1 for entry in placement.entries if entry.location == "remote")
        note = (f"placement: {placement_path}: {len(placement.entries)} area(s),"
                f" {len(placement.entries) - remote} local, {remote} remote")
    else:
        note = f"placement: {placement_path} does not exist yet (no areas)"
    return Validated(path=path, config=config, notes=(note, fence_line(config)),
                     warnings=tuple(warnings))


def fence_line(config: Config) -> str:
    """`fence: …`: how local areas are fenced, from what monitord said at its last start."""
    from monitord.base import area_paths, cgroup_fence

    state_dir = config.monitord.work_dir / area_paths.SUPERVISOR_DIR
    try:
        fences = cgroup_fence.read_note(state_dir)
    except OSError as e:
        return (f"fence: not known: cannot read {state_dir / cgroup_fence.NOTE_NAME}:"
                f" {e.strerror or e} (run as the daemon's user)")
    except ValueError:
        return f"fence: not known: {state_dir / cgroup_fence.NOTE_NAME} is not monitord's"
    if fences is None:
        return ("fence: not known yet: monitord says at its start whether local areas are"
                " fenced by cgroup or by process group only")
    return f"fence: {fences.describe('local areas')}"


def _check_remote_files(remote: RemoteSection, *, path: Path) -> None:
    """The files [remote] names must be readable: the daemon needs every one of them."""
    named = [("remote.key_file", remote.key_file)]
    if remote.known_hosts is not None:
        named.append(("remote.known_hosts", remote.known_hosts))
    named += [(f"remote.artifacts[{i}]", p) for i, p in enumerate(remote.artifacts)]
    for key, file in named:
        try:
            with file.open("rb"):
                pass
        except OSError as e:
            raise CheckUsageError(
                ErrorCode.CONFIG_INVALID, f"{path}: key {key}: cannot read {file}: "
                f"{e.strerror or e}"
            ) from e


def _services_to_check(config: Config, only: str | None, *, path: Path) -> tuple[str, ...]:
    if only is None:
        return tuple(config.services)
    if only not in config.services:
        configured = ", ".join(config.services) or "none"
        raise CheckUsageError(ErrorCode.UNKNOWN_SERVICE,
                              f"service {only!r} is not configured in {path} ({configured})")
    return (only,)


# -- the VPS -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PythonProbe:
    """What `{remote_python} -I -c ...` said: the version, or why there is none."""

    version: tuple[int, ...] | None
    detail: str

    @property
    def usable(self) -> bool:
        return self.version is not None and self.version[:2] >= MIN_PYTHON


@dataclass(frozen=True, slots=True)
class VpsFacts:
    """What check finds out once per VPS, before preflight runs for each service."""

    python: PythonProbe
    server_version: str  # the SSH server's identification line, e.g. SSH-2.0-OpenSSH_10.0p2
    refused_channel: str  # why sshd refuses the agent's kind of channel, or ""
    owner: OwnerJudgement
    sftp: CheckResult
    secret_problem: str  # why remote_config cannot be asked, or ""


async def check_remote(config: Config, *, services: Sequence[str]) -> int:
    """Connect, probe, run preflight per service, print the lines; the exit code."""
    from monitord.remote import agent_channel, artifact
    from monitord.remote.agent_client import AgentClient
    from monitord.remote.tunnel import ssh_connect

    remote = config.remote
    assert remote is not None
    started = time.monotonic()
    timeout_s = max(PROBE_TIMEOUT_S, remote.connect_timeout_s)
    with tempfile.TemporaryDirectory(prefix="monitord-check-") as build_dir:
        pyz = artifact.build(Path(build_dir))  # only its hash and size are compared
        artifacts = artifact.local_artifacts(remote, agent=pyz)

    conn: asyncssh.SSHClientConnection | None = None
    auth_error = ""
    try:
        conn = await ssh_connect.open_connection(remote)
    except MonitordError as e:
        if e.code == ErrorCode.CONFIG_INVALID:  # e.g. remote.ssh_config's ProxyJump
            raise CheckUsageError(ErrorCode.CONFIG_INVALID, e.detail) from e
        auth_error = f"{e.code}: {e.detail}"

    @contextlib.asynccontextmanager
    async def session() -> AsyncIterator[asyncssh.SSHClientConnection]:
        assert conn is not None
        yield conn

    counts = {"ok": 0, "failed": 0, "skipped": 0}
    pending_push = False
    try:
        facts = await _vps_facts(conn, config=config, timeout_s=timeout_s)
        print(f"vps: {ssh_connect.describe(remote)}: "
              + (f"{remote.remote_python} -I is {facts.python.detail},"
                 f" SSH server {describe_ssh_server(facts.server_version)}" if conn else
                 "not connected"))
        if conn is not None:
            for warning in release_warnings(facts.server_version, facts.python.version):
                print(f"warning: {warning}")
        secret, _ = _read_secret(config)
        agent = None if conn is None else AgentClient(
            channel=agent_channel.over_ssh(session, remote.agent_socket()),
            secret=secret or b"-", timeout_s=timeout_s,
        )
        for service in services or ("",):
            results = await _service_results(conn, config=config, service=service,
                                             artifacts=artifacts, agent=agent, facts=facts,
                                             auth_error=auth_error, timeout_s=timeout_s)
            pending_push = pending_push or conn is not None and any(
                r.check == "artifacts" and r.status == "skipped" for r in results
            )
            if len(services) > 1:
                print(f"service {service}:")
            for result in results:
                counts[str(result.status)] += 1
                print(format_line(result))
    finally:
        if conn is not None:
            conn.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(conn.wait_closed(), CLOSE_TIMEOUT_S)
    print(f"summary: {counts['ok']} passed, {counts['failed']} failed,"
          f" {counts['skipped']} not checked ({time.monotonic() - started:.1f} s)")
    if pending_push:
        print(f"note: the daemon pushes {artifact.PYZ_NAME} (and the service binaries) and starts"
              " the agent when it connects; run this again then for the self-check")
    return EXIT_FAILED if counts["failed"] else EXIT_OK


async def _vps_facts(
    conn: asyncssh.SSHClientConnection | None, *, config: Config, timeout_s: float
) -> VpsFacts:
    remote = config.remote
    assert remote is not None
    python = await _probe_python(conn, remote=remote, timeout_s=timeout_s)
    return VpsFacts(
        python=python,
        server_version="" if conn is None else str(conn.get_extra_info("server_version") or ""),
        refused_channel=await _streamlocal_refused(conn, remote=remote, python=python,
                                                   timeout_s=timeout_s),
        owner=await _tunnel_owner(conn, config=config, timeout_s=timeout_s),
        sftp=await _probe_sftp(conn, timeout_s=timeout_s),
        secret_problem=_read_secret(config)[1],
    )


async def _service_results(
    conn: asyncssh.SSHClientConnection | None, *, config: Config, service: str,
    artifacts: Sequence[LocalArtifact], agent: AgentClient | None, facts: VpsFacts,
    auth_error: str, timeout_s: float,
) -> list[CheckResult]:
    """One service's preflight, each result as check can state it, the sftp line second."""
    from monitord.base import area_paths
    from monitord.remote.preflight import AreaNeed, TunnelOwnerView, TunnelView, run_preflight

    remote = config.remote
    assert remote is not None
    report = await run_preflight(
        conn, config=config, service=service, artifacts=artifacts,
        # The free space under the service's data root on the VPS, against the margin alone
        # (a move adds its area's size: its own preflight judges that).
        need=AreaNeed(
            data_root=area_paths.remote_data_root(config, service=service) if service else ""),
        # Judged here instead (facts.owner, and forwards "checked by the daemon"): these
        # inputs only keep preflight from failing what it cannot know.
        tunnel=TunnelView(
            owner=TunnelOwnerView(ours=True), auth_error=auth_error,
            forwards_ready={f.name: True
                            for f in (*remote.reverse_forwards, *remote.local_forwards)},
        ),
        agent=agent, timeout_s=timeout_s,
    )
    results = [_adjust(result, remote=remote, facts=facts, has_service=bool(service))
               for result in report.results]
    results.insert(1, facts.sftp)
    return results


def describe_ssh_server(server_version: str) -> str:
    """`OpenSSH_10.0p2 Debian-7+deb13u4` from `SSH-2.0-OpenSSH_10.0p2 Debian-7+deb13u4`."""
    return server_version.removeprefix("SSH-2.0-") or "an SSH server that sent no version"


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def release_warnings(
    server_version: str, python: tuple[int, ...] | None
) -> list[str]:
    """What lies outside the tested releases (TESTED_OPENSSH, TESTED_PYTHON), one sentence
    each; [] for a VPS like one the fault tier runs on. Pure."""
    warnings: list[str] = []
    oldest, newest = TESTED_OPENSSH
    tested = (f"tested: OpenSSH {_dotted(oldest)} to {_dotted(newest)}, Python"
              f" {_dotted(TESTED_PYTHON[0])} to {_dotted(TESTED_PYTHON[1])};"
              " docs/vps-setup.md")
    found = _OPENSSH_VERSION.match(server_version)
    if found is None:
        warnings.append(
            f"the VPS's SSH server is {describe_ssh_server(server_version)!r}, not OpenSSH"
            f" ({tested}): monitord cannot recognise a session process there, so a stale"
            " session of a dead monitord is never fenced; its forwarded ports stay taken"
            " until the server drops it")
    else:
        openssh = (int(found.group(1)), int(found.group(2)))
        if openssh < oldest:
            warnings.append(
                f"OpenSSH {_dotted(openssh)} on the VPS is older than any supported release"
                f" ({tested}): upgrade the VPS to Debian 11 or newer")
        elif openssh[0] > newest[0]:
            warnings.append(
                f"OpenSSH {_dotted(openssh)} on the VPS is newer than any tested release"
                f" ({tested}): expected to work, not yet proven")
    if python is not None and python[:2] < TESTED_PYTHON[0]:
        warnings.append(
            f"Python {_dotted(python)} on the VPS is older than supported ({tested}): the"
            " agent cannot run there")
    elif python is not None and python[:2] > TESTED_PYTHON[1]:
        warnings.append(
            f"Python {_dotted(python)} on the VPS is newer than any tested release"
            f" ({tested}): expected to work, not yet proven")
    return warnings


def format_line(result: CheckResult) -> str:
    """`✔ agent         PREFLIGHT_AGENT          detail` (`— fix: hint` after a failure)."""
    from monitord.remote.preflight import CHECK_CODES

    check_width = max(len(name) for name in CHECK_CODES)
    code_width = max(len(code) for code in (*CHECK_CODES.values(), ErrorCode.PROVISION_FAILED))
    line = (f"{MARKS[str(result.status)]} {result.check:<{check_width}} "
            f"{result.code:<{code_width}}  {result.detail}")
    if result.status == "failed" and result.hint:
        line += f" — fix: {result.hint}"
    return line


async def _probe_python(
    conn: asyncssh.SSHClientConnection | None, *, remote: RemoteSection, timeout_s: float
) -> PythonProbe:
    from monitord.remote import remote_exec

    if conn is None:
        return PythonProbe(None, "not probed: no SSH connection")
    argv = [remote.remote_python, "-I", "-c", PYTHON_PROBE]
    try:
        result = await remote_exec.run(conn, argv, timeout_s=timeout_s, max_stdout=4096)
    except MonitordError as e:
        return PythonProbe(None, f"not probed: {e.detail or e.code}")
    found = re.fullmatch(r"\((\d+), (\d+), (\d+)\)", result.text.strip())
    if result.exit_status != 0 or found is None:
        why = result.stderr_tail() or outside_text.clean(result.text.strip(), limit=200)
        return PythonProbe(None, f"not runnable (exit {result.exit_status}: {why})")
    version = tuple(int(part) for part in found.groups())
    return PythonProbe(version, ".".join(str(part) for part in version))


async def _probe_sftp(
    conn: asyncssh.SSHClientConnection | None, *, timeout_s: float
) -> CheckResult:
    """Preflight does not use SFTP, provisioning and every area copy do: start and end one
    SFTP session (it reads and writes nothing)."""
    from monitord.remote import ssh_errors
    from monitord.remote.preflight import CheckResult, CheckStatus

    code = ErrorCode.PROVISION_FAILED
    if conn is None:
        return CheckResult(check="sftp", code=code, status=CheckStatus.SKIPPED,
                           detail="needs a working SSH session", hint="")
    try:
        with ssh_errors.translated(code=code, during="start SFTP"):
            async with asyncio.timeout(timeout_s):
                client = await conn.start_sftp_client()
        client.exit()
    except MonitordError as e:
        return CheckResult(
            check="sftp", code=code, status=CheckStatus.FAILED, detail=e.detail,
            hint="keep the `Subsystem sftp` line in sshd_config (monitord pushes its files and"
                 " copies areas over SFTP) and no ForceCommand for the login user",
        )
    return CheckResult(check="sftp", code=code, status=CheckStatus.OK,
                       detail="the SFTP subsystem answers", hint="")


def _read_secret(config: Config) -> tuple[bytes | None, str]:
    """The agent secret the daemon keeps (never created here), or why there is none."""
    from monitord.surface.wiring import SECRET_FILE

    path = config.monitord.work_dir / SECRET_FILE
    try:
        secret = path.read_bytes().strip()
    except FileNotFoundError:
        return None, (f"no agent secret yet ({path}): the daemon creates it and pushes it at its"
                      " first connect")
    except OSError as e:
        return None, f"cannot read {path}: {e.strerror or e} (run as the daemon's user)"
    return (secret, "") if secret else (None, f"{path} is empty")


def _read_owner_id(work_dir: Path) -> str:
    """This installation's owner id if the daemon has made one (never created here)."""
    from monitord.store.owner_id import OWNER_ID_FILE

    try:
        return str(uuid.UUID((work_dir / OWNER_ID_FILE).read_text().strip()))
    except (OSError, ValueError):
        return ""


@dataclass(frozen=True, slots=True)
class OwnerJudgement:
    status: str  # "ok", "failed" or "skipped"
    detail: str


async def _tunnel_owner(
    conn: asyncssh.SSHClientConnection | None, *, config: Config, timeout_s: float
) -> OwnerJudgement:
    """The tunnel lease on the VPS, judged as the keeper's acquire would judge it."""
    from monitord.remote import artifact
    from monitord.remote.tunnel.lease_client import LeaseClient
    from orchestrator import tunnel_lease

    remote = config.remote
    assert remote is not None
    if conn is None:
        return OwnerJudgement("skipped", "not checked: no SSH connection")
    ours = _read_owner_id(config.monitord.work_dir)
    label = config.monitord.owner_label
    client = LeaseClient(prefix=artifact.remote_command(remote), remote_dir=remote.remote_bin_dir,
                         owner_id=ours or "-", owner_label=label,
                         ttl_s=remote.tunnel_lease_ttl_s, timeout_s=timeout_s)
    try:
        record, vps_now = await client.show(conn)
    except MonitordError as e:
        if e.code == ErrorCode.PROVISION_FAILED:
            return OwnerJudgement("skipped", f"not checked: needs {artifact.PYZ_NAME} on the VPS"
                                             " (tunnel-lease show)")
        return OwnerJudgement("failed", f"tunnel-lease show: {e.detail or e.code}")
    if record is None:
        return OwnerJudgement("ok", "free: no tunnel lease on the VPS (the daemon takes it when"
                                    " it connects)")
    decision = tunnel_lease.decide_acquire(
        record, owner_id=ours or "-", owner_label=label, ttl=remote.tunnel_lease_ttl_s,
        session=tunnel_lease.SessionIdentity(sshd_pid=0, sshd_start_ticks=0, ssh_connection=""),
        now=vps_now, holder_session_alive=True,
    )
    holder = f"{record.owner_label} ({record.owner_id})"
    if decision.action is tunnel_lease.LeaseAction.REFUSE_CONFLICT:
        return OwnerJudgement("failed", f"the tunnel lease is {decision.reason}")
    if record.owner_id == ours:
        return OwnerJudgement("ok", f"held by this node, {holder}: the daemon's own tunnel")
    return OwnerJudgement("ok", f"held by {holder} but expired: the daemon takes it over when"
                                " it connects")


async def _streamlocal_refused(
    conn: asyncssh.SSHClientConnection | None, *, remote: RemoteSection, python: PythonProbe,
    timeout_s: float,
) -> str:
    """Why sshd refuses the kind of channel the agent is reached over, or "" (it lets one
    through, or it could not be tried: then the other checks say why). sshd answers a
    refused direct-streamlocal channel and a socket nobody listens on alike, so this opens
    one to a throwaway socket that does listen, whether or not the agent runs."""
    from monitord.remote import remote_exec, ssh_errors

    if conn is None or not python.usable:
        return ""
    argv = [remote.remote_python, "-I", "-c", _SOCKET_PROBE, remote.remote_bin_dir]
    try:
        with ssh_errors.translated(code=ErrorCode.PREFLIGHT_AGENT, during="socket probe"):
            async with asyncio.timeout(timeout_s):
                process = await conn.create_process(remote_exec.command_line(argv),
                                                    encoding=None)
                try:
                    path = (await process.stdout.readline()).decode(errors="replace").strip()
                    if not path.startswith("/"):
                        return ""
                    try:
                        reader, writer = await conn.open_unix_connection(path)
                    except ssh_errors.SSH_ERRORS as e:
                        refusal = ssh_errors.channel_refusal(e)
                        if refusal is None:
                            raise
                        return f"sshd refuses direct-streamlocal channels (the agent's): {refusal}"
                    try:
                        await reader.read(2)
                    finally:
                        writer.close()
                    await process.wait(check=False)
                finally:
                    process.close()
    except MonitordError:
        return ""
    return ""


def _adjust(
    result: CheckResult, *, remote: RemoteSection, facts: VpsFacts, has_service: bool,
) -> CheckResult:
    """Preflight's result as `check` can state it (see the module doc)."""
    from monitord.remote.preflight import CheckStatus

    python, owner = facts.python, facts.owner
    refused_channel, secret_problem = facts.refused_channel, facts.secret_problem
    status = CheckStatus
    replace = dataclasses.replace
    if result.check == "forwards":
        names = ", ".join(f.name for f in (*remote.reverse_forwards, *remote.local_forwards))
        return replace(result, status=status.SKIPPED, detail=(
            f"checked by the daemon: its tunnel keeper requests {names or 'none'} and proves"
            " each with a round trip after connecting (monitord status --json shows them)"))
    if result.check == "tunnel_owner":
        return replace(result, status=status(owner.status), detail=owner.detail,
                       hint=lookup(result.code).action if owner.status == "failed" else "")
    if result.check == "artifacts" and result.status is status.FAILED:
        return replace(result, status=status.SKIPPED, detail=(
            f"{result.detail.removeprefix('missing or different: ')}: not on the VPS yet or"
            " another version; the daemon pushes them when it connects"))
    if result.check == "agent" and result.status is status.SKIPPED and python.version:
        if python.usable:
            return replace(result, detail=(
                f"self-check not run: it needs this monitord's monitord.pyz on the VPS;"
                f" {remote.remote_python} -I is {python.detail}"))
        return replace(result, status=status.FAILED, detail=(
            f"{remote.remote_python} -I is {python.detail}, the agent needs >= 3.9"),
            hint="install python3 >= 3.9 or point remote.remote_python at one")
    if result.check == "agent" and result.status is status.SKIPPED and python.detail.startswith(
            "not runnable"):
        return replace(result, status=status.FAILED, detail=(
            f"{remote.remote_python} -I is {python.detail}"),
            hint="install python3 (apt-get install python3) or set remote.remote_python")
    if result.check == "agent" and refused_channel:
        return replace(result, status=status.FAILED, detail=refused_channel, hint=(
            "in sshd_config AllowTcpForwarding yes, AllowStreamLocalForwarding local (or yes)"
            " and no PermitOpen; in authorized_keys restrict,port-forwarding and no permitopen"))
    if result.check == "agent" and "(fix: " in result.detail:
        return replace(result, hint="")  # the self-check named each fix; the catalogue's is vaguer
    if result.check == "disk_space" and result.status is status.OK:
        return replace(result, detail=f"{result.detail}; each move needs its area's size on"
                                      " top (the daemon's preflight checks it)")
    if result.check == "memory" and result.status is status.OK:
        return replace(result, detail=f"{result.detail}; each move needs its daemon's memory"
                                      " on top (the daemon's preflight checks it)")
    if result.check in ("remote_config", "memory") and not has_service:
        return replace(result, status=status.SKIPPED, detail="no [services] configured",
                       hint="")
    if result.check in ("remote_config", "memory") and secret_problem \
            and result.status is not status.OK:
        return replace(result, status=status.SKIPPED, detail=f"not checked: {secret_problem}")
    return result


# The verb this module serves (monitord.surface.cli): verb -> (add arguments, run).
VERBS = {"check": (add_arguments, main)}
