"""Preflight (docs/design.md, "Transactions: phases and outcomes"): the checks run before a
service's areas leave the PBX.

`run_preflight(conn, *, config, service, …)` returns a `PreflightReport` with one
`CheckResult` per check, in a fixed order, each failing with its own stable code and a
fix hint from the error catalogue:

- auth (PREFLIGHT_AUTH): the caller's connection, made with the tunnel's key and options,
  exists and runs commands;
- arch (PREFLIGHT_ARCH): `uname -m` is x86_64;
- bin_dir (PREFLIGHT_BIN_DIR): remote_bin_dir is a directory of the login user with the
  owner's rwx and no group/other write;
- disk_space (PREFLIGHT_DISK_SPACE): the file system that will hold the area's data dir and
  its staging dir (`data_root`, the data dir's parent) has the area's footprint plus the
  margin free, in bytes and in inodes (orchestrator/disk_space.py), and the bin dir's the
  artifacts' sizes (added to the area's when both are one file system); a shortage names
  the side, the path, the bytes needed and free;
- write_test (PREFLIGHT_WRITE_TEST): a test file can be created and removed there;
- agent (PREFLIGHT_AGENT): the pushed monitord's own `self-check` passes on the VPS (Python
  version, every module imports, flock, /proc, ss, writable bin dir, socket path), naming
  each missing piece with its fix, and the agent answers GET /livez over the SSH
  connection — or is not running yet but startable by agent-launch; the detail ends with
  the self-check's `fence` line (by cgroup or by process group only, never a failure);
- artifacts (PREFLIGHT_ARTIFACTS): each artifact's SHA-256 on the VPS equals the local one;
- tunnel_owner (PREFLIGHT_TUNNEL_OWNER): input, the keeper's view of the tunnel lease;
- forwards (PREFLIGHT_FORWARDS): input, the keeper's readiness of each configured forward;
- remote_config (PREFLIGHT_REMOTE_CONFIG): the service is configured and the agent answers
  GET /v1/host with our secret (an answer of a fixed size: this runs once per area);
- memory (PREFLIGHT_MEMORY): that answer's available memory holds the area's daemon (as
  resident on the PBX), its lease guard, the moves under way and remote.memory_reserve_mib
  (orchestrator/memory_room.py); not judged when the agent is older than GET /v1/host.

The VPS-side facts come from ONE exec of a fixed shell script plus one of the self-check.
Preflight has no side effect on anything local: it reads inputs, talks to the VPS and the
agent, and never touches a local daemon or monitord's state — a failed preflight never
takes a local service down. On the VPS it only creates and removes its own test file.

Called by monitord.engine.remote_side (the PREFLIGHT phase of a move to the VPS) and
monitord.surface.check_command (`monitord check --remote`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType

import asyncssh

from monitord.base import bounded_json, logs, outside_text
from monitord.base.config import Config, RemoteSection
from monitord.remote import artifact, remote_exec
from monitord.remote.agent_client import AgentClient
from monitord.remote.provisioning import LocalArtifact
from monitord.remote.shared_facts import SharedFacts
from orchestrator import disk_space, memory_room
from orchestrator.errors import ErrorCode, MonitordError, error_for, lookup

log = logs.get_logger(__name__)

WANTED_ARCH = "x86_64"
WRITE_TEST_NAME = ".preflight-write-test"
# The self-check proves what the VPS's Python and system can do for this pyz: that does not
# change under a running connection, and it costs a Python start with every module imported
# (about 0.25 s) — so one answer serves every preflight over the connection for this long.
SELF_CHECK_MAX_AGE_S = 3600.0
# The VPS's reports are read within bounds (it may be compromised): a few KiB of lines,
# numbers in ASCII digits (str.isdigit also takes "²", which int() refuses).
MAX_REPORT_BYTES = 64 * 1024
_COUNT_RE = re.compile(r"[0-9]{1,18}")
_MODE_RE = re.compile(r"[0-7]{1,4}")
_TEXT_CHARS = 500


class CheckStatus(StrEnum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"  # could not be evaluated because an earlier check failed


# check name -> the code it fails with, in the order the report lists them.
CHECK_CODES: Mapping[str, ErrorCode] = MappingProxyType({
    "auth": ErrorCode.PREFLIGHT_AUTH,
    "arch": ErrorCode.PREFLIGHT_ARCH,
    "bin_dir": ErrorCode.PREFLIGHT_BIN_DIR,
    "disk_space": ErrorCode.PREFLIGHT_DISK_SPACE,
    "write_test": ErrorCode.PREFLIGHT_WRITE_TEST,
    "agent": ErrorCode.PREFLIGHT_AGENT,
    "artifacts": ErrorCode.PREFLIGHT_ARTIFACTS,
    "tunnel_owner": ErrorCode.PREFLIGHT_TUNNEL_OWNER,
    "forwards": ErrorCode.PREFLIGHT_FORWARDS,
    "remote_config": ErrorCode.PREFLIGHT_REMOTE_CONFIG,
    "memory": ErrorCode.PREFLIGHT_MEMORY,
})


# The checks judged on the probe's facts (shared between preflights: monitord.remote
# .shared_facts).
_PROBED = ("arch", "bin_dir", "disk_space", "write_test", "artifacts")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    """One check: its name, the code it fails with, what was found and how to fix it."""

    check: str
    code: ErrorCode
    status: CheckStatus
    detail: str
    hint: str  # the catalogue's recommended action; "" when the check passed
    # numbers for the status (a shortage's needed and free)
    facts: Mapping[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is CheckStatus.OK


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightReport:
    service: str
    results: tuple[CheckResult, ...]

    @property
    def ok(self) -> bool:
        return all(result.ok for result in self.results)

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if r.status is CheckStatus.FAILED)

    def result(self, check: str) -> CheckResult:
        return next(r for r in self.results if r.check == check)

    def first_failure(self) -> CheckResult | None:
        """The failure to report as the phase's error (checks are ordered by cause).

        None means preflight does not block the move. Every skipped check comes with a
        failed one, except one case: the agent is not running but startable, so
        remote_config could not be asked yet (`ok` is then False, this is None).
        """
        return self.failures[0] if self.failures else None


@dataclass(frozen=True, slots=True, kw_only=True)
class TunnelOwnerView:
    """The tunnel keeper's view of the tunnel lease, as preflight needs it."""

    ours: bool
    owner_id: str = ""
    owner_label: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class _RemoteFacts:
    arch: str
    user: str
    bin_dir_state: str  # "dir", "missing" or "notdir"
    bin_dir_mode: int
    bin_dir_owner: str
    write: str  # "ok", "failed" or "skipped"
    avail_bytes: int | None
    hashes: Mapping[str, str]  # artifact name -> remote SHA-256 ("-" when missing)
    bin_device: str = ""
    data_free: disk_space.Free | None = None  # the data root's file system, if asked
    data_device: str = ""
    data_where: str = ""  # the data root, or its nearest existing ancestor


# "$1" = bin dir, "$2" = the data root ("" for none), then artifact names. One "key value…"
# line per fact; `stat -f` gives the data root's free blocks for an unprivileged writer
# (statvfs f_bavail), its block size, free and total inodes.
_PROBE_SCRIPT = r"""
d=$1; data=$2; shift 2
echo "arch $(uname -m)"
echo "user $(id -un)"
if [ -d "$d" ]; then
  echo "bin_dir dir $(stat -c '%a %U' -- "$d")"
  t="$d/.preflight-write-test"
  if (: > "$t") 2>/dev/null && rm -f -- "$t" 2>/dev/null; then
    echo "write ok"
  else
    echo "write failed"
  fi
  where=$d
else
  if [ -e "$d" ]; then echo "bin_dir notdir 0 -"; else echo "bin_dir missing 0 -"; fi
  echo "write skipped"
  where=$d
  while [ ! -d "$where" ]; do where=$(dirname -- "$where"); done
fi
echo "avail_kb $(df -Pk -- "$where" | awk 'NR == 2 { print $4 }')"
echo "bin_dev $(stat -c %d -- "$where")"
if [ -n "$data" ]; then
  w=$data
  while [ ! -d "$w" ]; do w=$(dirname -- "$w"); done
  echo "data_fs $(stat -f -c '%a %S %d %c' -- "$w") $(stat -c %d -- "$w") $w"
fi
for name in "$@"; do
  if [ -f "$d/$name" ]; then
    h=$(sha256sum < "$d/$name")
    echo "sha ${h%% *} $name"
  else
    echo "sha - $name"
  fi
done
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class AreaNeed:
    """What the area being moved asks of the VPS: room for `usage` (its data as it will
    take the disk) plus the margin under `data_root` (where its data dir and staging dir
    will be, their parent; "" for the service's data root unknown), and `memory` (without
    it, only the lease guard and `remote.memory_reserve_mib` are judged)."""

    usage: disk_space.Usage = field(default_factory=lambda: disk_space.Usage(bytes=0))
    data_root: str = ""
    memory: memory_room.Need | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TunnelView:
    """The tunnel as its keeper sees it: who holds its lease, which forwards are ready, and
    why it is not connected (when it is not)."""

    owner: TunnelOwnerView
    forwards_ready: Mapping[str, bool]
    auth_error: str = ""


async def run_preflight(
    conn: asyncssh.SSHClientConnection | None,
    *,
    config: Config,
    service: str,
    artifacts: Sequence[LocalArtifact],
    tunnel: TunnelView,
    agent: AgentClient | None,
    need: AreaNeed | None = None,
    timeout_s: float = 10.0,
    shared: SharedFacts | None = None,
) -> PreflightReport:
    """Run every check once (see the module doc); never raises for a failed check. With
    `shared`, the VPS-side facts (probe, self-check) come from one fetch for every preflight
    over the same connection within its max age (monitord/remote/shared_facts.py)."""
    shared = shared or SharedFacts(max_age_s=0.0)
    need = need or AreaNeed()
    remote = config.remote
    if remote is None:
        raise ValueError("preflight needs a [remote] section")
    probe_key = ("probe", None if conn is None else _conn_key(conn), need.data_root,
                 tuple((a.name, a.sha256) for a in artifacts))

    async def probe() -> _RemoteFacts | MonitordError | None:
        if conn is None:
            return None
        try:
            return await shared.get(
                probe_key,
                lambda: _probe(conn, remote=remote, artifacts=artifacts,
                               data_root=need.data_root, timeout_s=timeout_s),
            )
        except MonitordError as e:
            return e

    async def self_check() -> tuple[SelfCheckLine, ...] | str:
        # Run alongside the probe; its answer counts only if the probe finds our pyz there.
        if conn is None:
            return "no SSH connection"
        return await _shared_self_check(conn, remote=remote, artifacts=artifacts,
                                        shared=shared, timeout_s=timeout_s)

    # Independent round trips, at once: a preflight is part of every move's wall time.
    probed, alive_detail, checked = await asyncio.gather(
        probe(), _agent_alive(agent), self_check()
    )
    results = _vps_results(probed, remote=remote, artifacts=artifacts, need=need,
                           auth_error=tunnel.auth_error if conn is None else None,
                           self_check=(alive_detail, checked))
    if alive_detail is None and agent is not None:
        results.update(await _agent_results(config, service=service, agent=agent, need=need))
    else:
        results["remote_config"] = _skipped(
            "remote_config", f"the agent does not answer ({alive_detail})"
        )
        results["memory"] = _skipped("memory", f"the agent does not answer ({alive_detail})")
    results.update(_tunnel_results(tunnel, remote=remote))

    report = PreflightReport(
        service=service, results=tuple(results[check] for check in CHECK_CODES)
    )
    if any(not results[check].ok for check in _PROBED):
        shared.drop(probe_key)  # what failed is asked afresh next time (it may be fixed now)
    log.info(
        "preflight",
        service=service,
        ok=report.ok,
        failed=[str(r.code) for r in report.failures],
        skipped=[r.check for r in report.results if r.status is CheckStatus.SKIPPED],
    )
    return report


def _vps_results(
    probed: _RemoteFacts | MonitordError | None, *, remote: RemoteSection,
    artifacts: Sequence[LocalArtifact], need: AreaNeed, auth_error: str | None,
    self_check: tuple[str | None, tuple[SelfCheckLine, ...] | str],
) -> dict[str, CheckResult]:
    """What the SSH session told: auth, the probe's checks and the self-check's. A missing
    connection is `auth_error` (None: there is one)."""
    results: dict[str, CheckResult] = {}
    facts = probed if isinstance(probed, _RemoteFacts) else None
    if auth_error is not None:
        results["auth"] = _failed("auth", auth_error or "no SSH connection to the VPS")
    elif facts is None:
        results["auth"] = _failed("auth", f"the SSH session cannot run commands: {probed}")
    else:
        results["auth"] = _ok("auth", f"{facts.user}@{remote.host}:{remote.port}")
    pyz = _pyz_of(artifacts)
    if facts is None:
        for check in ("arch", "bin_dir", "disk_space", "write_test", "artifacts"):
            results[check] = _skipped(check, "needs a working SSH session")
        results["agent"] = _skipped("agent", "the self-check needs a working SSH session")
        return results
    results.update(_judge_facts(facts, remote=remote, artifacts=artifacts,
                                usage=need.usage, data_root=need.data_root))
    if pyz is not None and facts.hashes.get(pyz.name) != pyz.sha256:
        results["agent"] = _skipped(
            "agent", f"the self-check needs this monitord's {pyz.name} on the VPS (artifacts)"
        )
    else:
        results["agent"] = _judge_agent(*self_check)
    return results


async def _agent_results(
    config: Config, *, service: str, agent: AgentClient, need: AreaNeed
) -> dict[str, CheckResult]:
    """What the agent answers with our secret: the service's configuration, the memory."""
    assert config.remote is not None
    remote_config, host = await _remote_config(config, service=service, agent=agent)
    memory = need.memory or memory_room.Need(daemon_bytes=None)
    memory = replace(memory, reserve_bytes=config.remote.memory_reserve_mib * disk_space.MIB)
    judged = (_judge_memory(host, memory) if remote_config.ok
              else _skipped("memory", "needs the agent's answer (remote_config)"))
    return {"remote_config": remote_config, "memory": judged}


def _tunnel_results(tunnel: TunnelView, *, remote: RemoteSection) -> dict[str, CheckResult]:
    """What the keeper says: the tunnel lease's holder and the forwards' readiness."""
    results: dict[str, CheckResult] = {}
    if tunnel.owner.ours:
        results["tunnel_owner"] = _ok("tunnel_owner", "this node holds the tunnel lease")
    else:
        other = tunnel.owner.owner_label or tunnel.owner.owner_id or "unknown owner"
        results["tunnel_owner"] = _failed(
            "tunnel_owner", f"the tunnel lease is held by {other} ({tunnel.owner.owner_id})"
        )
    wanted = [f.name for f in (*remote.reverse_forwards, *remote.local_forwards)]
    not_ready = [name for name in wanted if not tunnel.forwards_ready.get(name, False)]
    if not_ready:
        results["forwards"] = _failed("forwards", f"not ready: {', '.join(not_ready)}")
    else:
        results["forwards"] = _ok("forwards", f"ready: {', '.join(wanted)}")
    return results


async def warm(
    conn: asyncssh.SSHClientConnection, *, config: Config,
    artifacts: Sequence[LocalArtifact], shared: SharedFacts,
    timeout_s: float = 10.0,
) -> None:
    """Fetch, on a connection just made, the fact every later preflight over it needs and
    that keeps longest: the VPS's self-check (a Python start there). So the first move after
    a connect does not wait for it. A self-check that could not run is not kept; the
    preflight asks again and reports it."""
    if config.remote is not None:
        await _shared_self_check(conn, remote=config.remote, artifacts=artifacts,
                                 shared=shared, timeout_s=timeout_s)


async def _shared_self_check(
    conn: asyncssh.SSHClientConnection, *, remote: RemoteSection,
    artifacts: Sequence[LocalArtifact], shared: SharedFacts, timeout_s: float,
) -> tuple[SelfCheckLine, ...] | str:
    pyz = _pyz_of(artifacts)
    return await shared.get(
        ("self-check", _conn_key(conn), pyz.sha256 if pyz else ""),
        lambda: _self_check(conn, remote=remote, timeout_s=timeout_s),
        keep=lambda lines: not isinstance(lines, str),  # could not run: ask again
        max_age_s=SELF_CHECK_MAX_AGE_S,
    )


def _pyz_of(artifacts: Sequence[LocalArtifact]) -> LocalArtifact | None:
    return next((a for a in artifacts if a.name == artifact.PYZ_NAME), None)


def _conn_key(conn: asyncssh.SSHClientConnection) -> tuple[int, object]:
    """One connection among those that come and go (an id alone may be reused)."""
    return id(conn), conn.get_extra_info("sockname")


async def _probe(
    conn: asyncssh.SSHClientConnection,
    *,
    remote: RemoteSection,
    artifacts: Sequence[LocalArtifact],
    data_root: str,
    timeout_s: float,
) -> _RemoteFacts:
    result = await remote_exec.run_script(
        conn, _PROBE_SCRIPT,
        args=[remote.remote_bin_dir, data_root, *(a.name for a in artifacts)],
        timeout_s=timeout_s, max_stdout=MAX_REPORT_BYTES,
    )
    if result.stdout_truncated:
        raise error_for(ErrorCode.VPS_REPLY_INVALID,
                        f"preflight probe: more than {MAX_REPORT_BYTES} bytes of output")
    # Its words (arch, user, owner, paths) reach the check's detail: made safe here.
    return parse_probe_report(outside_text.clean(result.text, limit=MAX_REPORT_BYTES))


def parse_probe_report(text: str) -> _RemoteFacts:
    """The probe script's `KEY VALUE…` lines. The VPS wrote them: a mode or a size that is
    not ASCII digits of bounded length reads as unknown (0, None), which the checks then
    report; an empty line is skipped."""
    fields: dict[str, list[str]] = {}
    hashes: dict[str, str] = {}
    for line in text.splitlines():
        if not line.split():
            continue
        key, *values = line.split()
        if key == "sha" and len(values) == 2:
            hashes[values[1]] = values[0]
        else:
            fields[key] = values
    found = fields.get("bin_dir", [])
    bin_dir = found + ["missing", "0", "-"][len(found):]  # a short line padded, field by field
    avail = fields.get("avail_kb", [])
    data_free, data_device, data_where = _data_fs(fields.get("data_fs", []))
    return _RemoteFacts(
        arch=" ".join(fields.get("arch", [])),
        user=" ".join(fields.get("user", [])),
        bin_dir_state=bin_dir[0],
        bin_dir_mode=int(bin_dir[1], 8) if _MODE_RE.fullmatch(bin_dir[1]) else 0,
        bin_dir_owner=bin_dir[2],
        write=(fields.get("write") or ["failed"])[0],
        avail_bytes=int(avail[0]) * 1024 if avail and _COUNT_RE.fullmatch(avail[0]) else None,
        hashes=hashes,
        bin_device=" ".join(fields.get("bin_dev", [])),
        data_free=data_free, data_device=data_device, data_where=data_where,
    )


def _data_fs(values: list[str]) -> tuple[disk_space.Free | None, str, str]:
    """(free space, device, path) of the probe's `data_fs` line: `stat -f`'s available
    blocks, block size, free and total inodes, then the device and the path measured."""
    if len(values) < 6 or not all(_COUNT_RE.fullmatch(v) for v in values[:4]):
        return None, "", ""
    blocks, block_size, inodes, total = (int(v) for v in values[:4])
    free = disk_space.Free(bytes=blocks * block_size, inodes=inodes, total_inodes=total)
    return free, values[4], " ".join(values[5:])


def _judge_facts(
    facts: _RemoteFacts,
    *,
    remote: RemoteSection,
    artifacts: Sequence[LocalArtifact],
    usage: disk_space.Usage,
    data_root: str,
) -> dict[str, CheckResult]:
    out: dict[str, CheckResult] = {}
    d = remote.remote_bin_dir

    if facts.arch == WANTED_ARCH:
        out["arch"] = _ok("arch", facts.arch)
    else:
        out["arch"] = _failed("arch", f"the VPS is {facts.arch or 'unknown'}, not {WANTED_ARCH}")

    if facts.bin_dir_state != "dir":
        state = "is missing" if facts.bin_dir_state == "missing" else "is not a directory"
        out["bin_dir"] = _failed("bin_dir", f"{d} {state}")
    elif facts.bin_dir_owner != facts.user:
        out["bin_dir"] = _failed(
            "bin_dir", f"{d} belongs to {facts.bin_dir_owner}, not the login user {facts.user}"
        )
    elif facts.bin_dir_mode & 0o022 or facts.bin_dir_mode & 0o700 != 0o700:
        out["bin_dir"] = _failed(
            "bin_dir", f"{d} has mode {facts.bin_dir_mode:04o}; want 0700 (no group/other write)"
        )
    else:
        out["bin_dir"] = _ok("bin_dir", f"{d} mode {facts.bin_dir_mode:04o} owner {facts.user}")

    out["disk_space"] = _judge_space(facts, bin_dir=d, artifacts=artifacts,
                                     usage=usage, data_root=data_root)

    if facts.write == "ok":
        out["write_test"] = _ok("write_test", f"created and removed {d}/{WRITE_TEST_NAME}")
    elif facts.write == "skipped":
        out["write_test"] = _skipped("write_test", f"{d} is not a directory")
    else:
        out["write_test"] = _failed(
            "write_test", f"could not create and remove {d}/{WRITE_TEST_NAME}"
        )

    wrong = [
        f"{a.name} (VPS {facts.hashes.get(a.name, '-')[:12]}, local {a.sha256[:12]})"
        for a in artifacts
        if facts.hashes.get(a.name) != a.sha256
    ]
    if wrong:
        out["artifacts"] = _failed("artifacts", "missing or different: " + "; ".join(wrong))
    else:
        out["artifacts"] = _ok("artifacts", f"{len(artifacts)} artifact(s) match by SHA-256")
    return out


def _judge_space(
    facts: _RemoteFacts, *, bin_dir: str, artifacts: Sequence[LocalArtifact],
    usage: disk_space.Usage, data_root: str,
) -> CheckResult:
    """The bin dir's file system holds the artifacts not there yet; the data root's holds
    the area once more plus the margin (both on one file system: the sum)."""
    to_push = sum(a.size for a in artifacts if facts.hashes.get(a.name) != a.sha256)
    if not data_root:  # no area in view: the bin dir's file system, as before
        needed = usage.bytes + to_push
        if facts.avail_bytes is None:
            return _failed("disk_space", f"could not read free space under {bin_dir}")
        if facts.avail_bytes < needed:
            return _failed("disk_space",
                           f"VPS: {facts.avail_bytes} bytes free under {bin_dir}, {needed} needed")
        return _ok("disk_space", f"{facts.avail_bytes} bytes free, {needed} needed")
    if facts.data_free is None:
        return _failed("disk_space", f"could not read free space under {data_root}")
    same_fs = facts.data_device != "" and facts.data_device == facts.bin_device
    usage = disk_space.Usage(bytes=usage.bytes + (to_push if same_fs else 0),
                             inodes=usage.inodes)
    short = disk_space.shortage(side="VPS", path=data_root, usage=usage, free=facts.data_free)
    if short is not None:
        return _failed("disk_space", short.detail(), facts=short.facts())
    if not same_fs and facts.avail_bytes is not None and facts.avail_bytes < to_push:
        return _failed("disk_space", f"VPS: {facts.avail_bytes} bytes free under {bin_dir},"
                                     f" the artifacts need {to_push}")
    want = disk_space.needed(usage)
    inodes = facts.data_free.inodes
    return _ok("disk_space", f"VPS: {facts.data_free.bytes} bytes free under {data_root}"
                             f" ({want.bytes} needed with the margin)"
                             + (f", {inodes} inodes free" if inodes is not None else ""))


async def _agent_alive(agent: AgentClient | None) -> str | None:
    """None when GET /livez answers over the SSH connection, else why not."""
    if agent is None:
        return "no SSH connection to reach it over"
    try:
        await agent.call_livez()
    except MonitordError as e:
        return f"GET /livez: {e.detail or e.code}"
    return None


@dataclass(frozen=True, slots=True)
class SelfCheckLine:
    """One line of the VPS's `monitord.pyz self-check` (monitord.vps.self_check)."""

    check: str
    ok: bool
    detail: str
    fix: str


async def _self_check(
    conn: asyncssh.SSHClientConnection | None, *, remote: RemoteSection, timeout_s: float
) -> tuple[SelfCheckLine, ...] | str:
    """The self-check's lines, or why it could not run."""
    if conn is None:
        return "no SSH connection to run the self-check over"
    argv = [*artifact.remote_command(remote), "self-check", "--dir", remote.remote_bin_dir]
    try:
        result = await remote_exec.run(conn, argv, timeout_s=timeout_s,
                                       max_stdout=MAX_REPORT_BYTES)
    except MonitordError as e:
        return f"`{' '.join(argv)}` failed: {e}"
    lines = []
    for raw in result.text.splitlines():
        line = _self_check_line(raw)
        if line is not None:
            lines.append(line)
    if not lines:
        return (f"`{' '.join(argv)}` exited {result.exit_status} without a report: "
                f"{result.stderr_tail()}")
    return tuple(lines)


def _self_check_line(raw: str) -> SelfCheckLine | None:
    """One report line of the self-check, None for anything else (bounded JSON, an object
    whose check, detail and fix are strings and ok a boolean)."""
    try:
        doc = bounded_json.loads(raw)
    except bounded_json.JsonRefused:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("ok"), bool):
        return None
    texts = [doc.get("check"), doc.get("detail"), doc.get("fix", "")]
    if not all(isinstance(text, str) for text in texts):
        return None
    check, detail, fix = (outside_text.clean(str(text), limit=_TEXT_CHARS) for text in texts)
    return SelfCheckLine(check=check, ok=doc["ok"], detail=detail, fix=fix)


def _judge_agent(
    alive_detail: str | None, self_check: tuple[SelfCheckLine, ...] | str
) -> CheckResult:
    if isinstance(self_check, str):
        why = f"; the agent does not answer ({alive_detail})" if alive_detail else ""
        return _failed("agent", f"self-check: {self_check}{why}")
    failed = [line for line in self_check if not line.ok]
    if failed:
        detail = "; ".join(
            f"{line.check}: {line.detail}" + (f" (fix: {line.fix})" if line.fix else "")
            for line in failed
        )
        return _failed("agent", f"the VPS cannot run the agent: {detail}")
    python = next((line.detail for line in self_check if line.check == "python"), "")
    fence = "".join(f"; fence: {line.detail}" for line in self_check if line.check == "fence")
    if alive_detail is None:
        return _ok("agent", f"answers over the SSH connection; self-check passed ({python})"
                            f"{fence}")
    return _ok("agent", f"not running ({alive_detail}) but startable by agent-launch; "
                        f"self-check passed ({python}){fence}")


async def _remote_config(
    config: Config, *, service: str, agent: AgentClient
) -> tuple[CheckResult, memory_room.Host | None]:
    """The check, and the VPS's memory from the same answer (None: an older agent)."""
    if service not in config.services:
        return _failed("remote_config", f"service {service!r} is not configured"), None
    # Our secret is proven by an answer of a fixed size: a preflight runs once per area, and
    # a whole inventory in each (every area's entry and process) made a hundred areas' moves
    # cost both sides a hundred inventories of a hundred areas.
    try:
        host = await agent.host()
    except MonitordError as e:
        if e.code == ErrorCode.AGENT_UNAUTHORIZED:
            return _failed("remote_config", "the agent rejected our secret"), None
        return _failed("remote_config", f"GET /v1/host failed: {e.detail or e.code}"), None
    return _ok("remote_config", "the agent answers with our secret"), host


def _judge_memory(host: memory_room.Host | None, need: memory_room.Need) -> CheckResult:
    if host is None:
        return _ok("memory", "not judged: the agent is older than GET /v1/host")
    if host.available_bytes is None:
        return _ok("memory", "not judged: the VPS's kernel does not say MemAvailable")
    short = memory_room.shortage(host, need)
    if short is not None:
        return _failed("memory", short.detail(), facts=short.facts())
    return _ok("memory", f"VPS: {disk_space.mib_text(host.available_bytes)} available,"
                         f" {disk_space.mib_text(need.total_bytes)} needed with the reserve")


def _ok(check: str, detail: str) -> CheckResult:
    return CheckResult(check=check, code=CHECK_CODES[check], status=CheckStatus.OK,
                       detail=detail, hint="")


def _failed(check: str, detail: str, *, facts: Mapping[str, object] | None = None
            ) -> CheckResult:
    code = CHECK_CODES[check]
    return CheckResult(check=check, code=code, status=CheckStatus.FAILED, detail=detail,
                       hint=lookup(code).action, facts=dict(facts or {}))


def _skipped(check: str, detail: str) -> CheckResult:
    code = CHECK_CODES[check]
    return CheckResult(check=check, code=code, status=CheckStatus.SKIPPED, detail=detail,
                       hint=lookup(code).action)

