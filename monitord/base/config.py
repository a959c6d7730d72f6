"""The validated configuration of `monitord run` (keys: config/monitord.toml), loaded from TOML.

Loaded by monitord.surface.cli before anything else starts. Every problem becomes one `ConfigError`
line naming the file, the key and what is wrong; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from monitord.base import log_sink, tree_digest
from orchestrator import names
from orchestrator.errors import ErrorCode, PermanentError

DEFAULT_CONFIG_PATH = Path("/etc/monitord/monitord.toml")
CONFIG_ENV = "MONITORD_CONFIG"


class ConfigError(PermanentError):
    """An unusable configuration file (CONFIG_INVALID); `detail` is the one line shown to the
    operator."""

    def __init__(self, detail: str) -> None:
        super().__init__(ErrorCode.CONFIG_INVALID, detail)

    def __str__(self) -> str:
        return self.detail


def _check_hostport(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) \
            or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {value!r}")
    return value


HostPort = Annotated[str, AfterValidator(_check_hostport)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MonitordSection(_Section):
    work_dir: Path = Path("/var/lib/monitord")
    spool_dir: Path = Path("/var/spool/monitord")
    owner_label: str = Field(default_factory=socket.gethostname, min_length=1)
    log_format: str = Field(default="auto", pattern="^(auto|json|console)$")
    reconcile_interval_s: float = Field(default=30.0, gt=0)
    cleanup_interval_s: float = Field(default=15.0, gt=0)
    park_after_failures: int = Field(default=5, ge=1)
    retry_backoff_base_s: float = Field(default=5.0, gt=0)
    retry_backoff_cap_s: float = Field(default=300.0, gt=0)
    legacy_grace_s: float = Field(default=300.0, ge=0)
    # A rollback after the destination ran brings the data it wrote back to the source. When
    # that data cannot be reached: keep the area stopped and wait for it ("preserve"), or
    # restart the source on its older data at once ("discard", recorded as an event).
    rollback_data: str = Field(default="preserve", pattern="^(preserve|discard)$")
    rollback_data_wait_s: float = Field(default=900.0, gt=0)
    # Give the VPS up by itself (for services with on_vps_lost = "home") once the tunnel has
    # been unreachable this long; None: only an operator gives a VPS up.
    vps_lost_after_s: float | None = Field(default=None, gt=0)
    # A given-up VPS copy, once set aside on the VPS, is kept this long for forensics
    # (`monitord fetch-abandoned`), then removed (monitord/engine/abandoned_data.py).
    abandoned_data_keep_s: float = Field(default=7 * 86400.0, gt=0)
    watchdog_interval_s: float = Field(default=5.0, gt=0)
    # Each area's daemon output: logs/{area}.log, rotated before it exceeds this many bytes,
    # with this many rotated files kept (monitord/base/log_sink.py, docs/operations.md).
    area_log_max_bytes: int = Field(default=log_sink.DEFAULT_MAX_BYTES,
                                    ge=log_sink.MIN_MAX_BYTES)
    area_log_keep: int = Field(default=log_sink.DEFAULT_KEEP, ge=0)


def is_loopback_listen(listen: str) -> bool:
    """True when HOST:PORT names this machine only (127.0.0.0/8, ::1 or localhost)."""
    host = listen.rpartition(":")[0].strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve beyond loopback


class HttpSection(_Section):
    listen: HostPort = "127.0.0.1:8224"
    drain_timeout_s: float = Field(default=15.0, ge=0)
    # Changes through the API need the token in work_dir/api-token (monitord/surface/
    # api_token.py), file mode 0640 with this group (None: monitord's own group): its members
    # and root may change placements. Never a group a messenger daemon runs in.
    token_group: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?$")
    # Reads need no token and the API speaks plain HTTP (a token would cross the network in
    # clear text): a listen beyond loopback must be asked for explicitly.
    allow_remote_api: bool = False

    @model_validator(mode="after")
    def _remote_api_is_explicit(self) -> HttpSection:
        if not self.allow_remote_api and not is_loopback_listen(self.listen):
            raise ValueError(
                f"http.listen {self.listen!r} is not a loopback address; the API's reads need"
                " no token and its token would cross the network in clear text; set"
                " http.allow_remote_api = true to serve it beyond this machine"
            )
        return self


# Where the agent listens under remote_bin_dir, and the TCP address it had before it was
# reached over SSH (a local forward to it is recognised and dropped by the loader).
AGENT_SOCKET = "api/agent.sock"
# The longest path a Unix socket can be bound at (sizeof(sun_path) - 1 on Linux); the VPS's
# self-check holds the same figure (monitord.vps.self_check.MAX_SOCKET_PATH).
MAX_SOCKET_PATH = 107
LEGACY_AGENT_LISTEN = "127.0.0.1:8225"


def agent_socket_under(remote_bin_dir: str) -> str:
    """The agent's Unix socket on the VPS (the agent derives the same path from its dir:
    monitord.vps.server.socket_path)."""
    return f"{remote_bin_dir.rstrip('/')}/{AGENT_SOCKET}"


class ForwardSpec(_Section):
    name: str = Field(min_length=1)
    listen: HostPort
    target: HostPort


@dataclass(frozen=True)
class JumpHop:
    """One jump host of `remote.proxy_jump`; a field left None comes from `remote.ssh_config`
    for that host, else from ssh's default (the local user name, port 22)."""

    host: str
    user: str | None = None
    port: int | None = None

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = f"{self.user}@" if self.user else ""
        return f"{user}{host}:{self.port}" if self.port else f"{user}{host}"


def parse_proxy_jump(value: str) -> tuple[JumpHop, ...]:
    """OpenSSH's ProxyJump: `[user@]host[:port]` hops, comma-separated, first hop first,
    IPv6 addresses in brackets; "none" is no jump host at all. Raises ValueError."""
    if value.strip().lower() == "none":
        return ()
    return tuple(_parse_jump_hop(hop.strip()) for hop in value.split(","))


def _parse_jump_hop(hop: str) -> JumpHop:
    user, at, address = hop.rpartition("@")  # a user name may itself contain "@"
    if address.startswith("["):
        host, _, tail = address[1:].partition("]")
        garbled = "]" not in address or (tail != "" and not tail.startswith(":"))
        port = tail[1:] if tail else None
    else:
        host, colon, rest = address.partition(":")
        garbled = ":" in rest  # an IPv6 address without brackets
        port = rest if colon else None
    if (garbled or not host or (at and not user)
            or any(c.isspace() or c in "/[]@," for c in host) or any(c.isspace() for c in user)):
        raise ValueError(
            f"jump host {hop!r} is not [user@]host[:port] (hops are comma-separated;"
            " an IPv6 address goes in brackets)"
        )
    if port is not None and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"jump host {hop!r}: the port must be in 1..65535")
    return JumpHop(host=host, user=user or None, port=int(port) if port is not None else None)


class RemoteSection(_Section):
    host: str = Field(min_length=1)
    port: int = Field(default=22, gt=0, lt=65536)
    user: str = Field(min_length=1)
    key_file: Path
    known_hosts: Path | None = None  # None only in the demo: see accept_any_host_key
    accept_any_host_key: bool = False  # demo only; never in production
    # Jump hosts before `host` (OpenSSH's ProxyJump syntax; "none": not even the ssh_config's).
    # Each hop is opened with key_file and known_hosts too (monitord/remote/tunnel/ssh_connect.py).
    proxy_jump: str | None = None
    # An OpenSSH client config file read at every connect (Host blocks: HostName, Port, User
    # of a jump host, ProxyJump, ...); the keys of this section win over it.
    ssh_config: Path | None = None
    remote_bin_dir: str = "/opt/offload"
    remote_python: str = "python3"
    # How the VPS runs monitord's own verbs (agent, agent-launch, tunnel-lease, self-check):
    # the pushed single-file artifact under the VPS's python3 in isolated mode (-I: no
    # PYTHON* variables, no user site-packages; it needs only the standard library).
    remote_monitord: tuple[str, ...] = (
        "{remote_python}", "-I", "{remote_bin_dir}/monitord.pyz"
    )
    connect_timeout_s: float = Field(default=10.0, gt=0)
    # A migration's preflight waits this long for a tunnel that is (re)connecting before
    # it counts as failed (SSH_UNREACHABLE); covers start-up and short link blips.
    preflight_tunnel_wait_s: float = Field(default=30.0, ge=0)
    # Memory a move to the VPS leaves free there beyond the area's daemon, its lease guard
    # and the moves under way (orchestrator/memory_room.py): for sshd, the agent and
    # whatever else the VPS runs. 0: only what the areas themselves need is judged.
    memory_reserve_mib: int = Field(default=64, ge=0)
    keepalive_interval_s: float = Field(default=5.0, gt=0)
    keepalive_count_max: int = Field(default=3, ge=1)
    reconnect_backoff_base_s: float = Field(default=1.0, gt=0)
    reconnect_backoff_cap_s: float = Field(default=30.0, gt=0)
    reconnect_max_per_minute: int = Field(default=6, ge=1)
    # A second, idle connection kept logged in so that a reconnect after one connection
    # dies skips the login (monitord/remote/tunnel/standby.py).
    standby_connection: bool = True
    # Which areas a move pre-copies (orchestrator/pre_copy.py): "adaptive" skips an area
    # whose bytes take less time to send, at the copy throughput monitord measured, than a
    # pre-copy's measured fixed cost (its round trips: staging, SFTP, the VPS's digest);
    # "by_size" skips an area smaller than pre_copy_min_bytes. Not set: "by_size" when
    # pre_copy_min_bytes is set (an explicit threshold is kept as it was), else "adaptive".
    pre_copy: Literal["adaptive", "by_size"] = "adaptive"
    # "by_size": the threshold. "adaptive": the threshold until copies have been timed, and
    # its scale after (it stays within 1/16 and 16 times this). 0: pre-copy every area.
    pre_copy_min_bytes: int = Field(default=1024 * 1024, ge=0)
    # The most of the link warm copies take, in bytes per second over the copies' own time
    # and the pause after each (monitord/engine/warm_copier.py); None: as fast as the link,
    # which they still give up at once to any move.
    warm_copy_max_rate: int | None = Field(default=None, gt=0)
    tunnel_lease_ttl_s: float = Field(default=30.0, gt=0)
    area_lease_ttl_s: float = Field(default=30.0, gt=0)
    lease_clock_margin: float = Field(default=0.1, ge=0)
    lease_safety_margin_s: float = Field(default=2.0, ge=0)
    reverse_forwards: tuple[ForwardSpec, ...] = (
        ForwardSpec(name="nats", listen="127.0.0.1:4222", target="127.0.0.1:4222"),
        ForwardSpec(name="license", listen="127.0.0.1:8222", target="127.0.0.1:8222"),
    )
    local_forwards: tuple[ForwardSpec, ...] = ()
    # Set by the loader, never by the file: keys that are still accepted but do nothing.
    deprecations: tuple[str, ...] = Field(default=(), exclude=True)
    artifacts: tuple[Path, ...] = ()  # extra files pushed to remote_bin_dir (daemon binaries)

    @model_validator(mode="after")
    def _host_key_policy(self) -> RemoteSection:
        if self.known_hosts is None and not self.accept_any_host_key:
            raise ValueError("known_hosts is required (accept_any_host_key is for the demo only)")
        if self.known_hosts is not None and self.accept_any_host_key:
            raise ValueError(
                "remote.accept_any_host_key = true conflicts with remote.known_hosts"
                f" = {str(self.known_hosts)!r}: set only known_hosts (accept_any_host_key"
                " would skip the host key check it asks for)"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _pre_copy_rule(cls, data: Any) -> Any:
        """`pre_copy` not given: an explicit `pre_copy_min_bytes` keeps its fixed meaning."""
        if isinstance(data, dict) and "pre_copy" not in data:
            data = {**data,
                    "pre_copy": "by_size" if "pre_copy_min_bytes" in data else "adaptive"}
        return data

    @model_validator(mode="before")
    @classmethod
    def _agent_over_ssh(cls, data: Any) -> Any:
        """The agent is reached over the SSH connection itself: a configuration written for
        the old local forward to its TCP port still loads, with one warning, the forward
        dropped (no socket on the PBX must carry the agent's secret)."""
        if not isinstance(data, dict) or "deprecations" in data:
            return data
        data = dict(data)
        old_target = data.pop("agent_listen", None)
        forwards = data.get("local_forwards")
        dropped: list[Any] = []
        if isinstance(forwards, list | tuple):
            kept: list[Any] = []
            for forward in forwards:
                is_manager = isinstance(forward, dict) and (
                    forward.get("name") == "manager"
                    or forward.get("target") in (old_target, LEGACY_AGENT_LISTEN)
                )
                (dropped if is_manager else kept).append(forward)
            data["local_forwards"] = kept
        ignored = ["agent_listen"] if old_target is not None else []
        ignored += [f"local_forwards {f.get('name', '?')!r}" for f in dropped]
        if ignored:
            data["deprecations"] = (
                f"remote: {' and '.join(ignored)} ignored (deprecated): the agent is now"
                " reached over the SSH connection itself; remove them",
            )
        return data

    @field_validator("remote_bin_dir")
    @classmethod
    def _agent_socket_fits(cls, value: str) -> str:
        """Refused here, not by the agent failing to bind on the VPS at the first connect."""
        socket_path = agent_socket_under(value)
        size = len(socket_path.encode())
        if size > MAX_SOCKET_PATH:
            raise ValueError(
                f"the agent's socket {socket_path!r} would be {size} bytes, more than a Unix"
                f" socket address holds ({MAX_SOCKET_PATH}): choose a shorter remote_bin_dir"
                " (for example /opt/offload)")
        return value

    @field_validator("proxy_jump")
    @classmethod
    def _proxy_jump_parses(cls, value: str | None) -> str | None:
        if value is not None:
            parse_proxy_jump(value)
        return value

    @field_validator("ssh_config")
    @classmethod
    def _ssh_config_readable(cls, value: Path | None) -> Path | None:
        if value is not None and not (value.is_file() and os.access(value, os.R_OK)):
            raise ValueError(f"{str(value)!r} is not a readable file")
        return value

    def jump_hops(self) -> tuple[JumpHop, ...] | None:
        """The hops of proxy_jump; None when it is not set (the ssh_config's ProxyJump, if
        any, applies then), () for "none"."""
        return None if self.proxy_jump is None else parse_proxy_jump(self.proxy_jump)

    def port_is_set(self) -> bool:
        """Whether `port` applies: given in the file, or no ssh_config whose Port could."""
        return "port" in self.model_fields_set or self.ssh_config is None

    @field_validator("reverse_forwards", "local_forwards")
    @classmethod
    def _unique_names(cls, forwards: tuple[ForwardSpec, ...]) -> tuple[ForwardSpec, ...]:
        names = [f.name for f in forwards]
        if len(names) != len(set(names)):
            raise ValueError(f"forward names must be unique, got {names}")
        return forwards

    def agent_socket(self) -> str:
        return agent_socket_under(self.remote_bin_dir)


# The most globs a service names for its SQLite databases (the agent takes as many).
WARM_COPY_MAX_GLOBS = 64


class WarmCopyCommand(_Section):
    """`warm_copy = {command = [...]}`: the service's own snapshot, run on the VPS in the
    area's data dir as its daemon runs (user, group, env; {area}, {data_dir}, {generation}
    expanded), leaving a consistent copy in $MONITORD_SNAPSHOT_DIR within `timeout_s`."""

    command: tuple[str, ...] = Field(min_length=1)
    timeout_s: float = Field(default=60.0, gt=0, le=3600)


class ServiceSection(_Section):
    command: tuple[str, ...] = Field(min_length=1)
    local_data_dir: str
    remote_data_dir: str
    remote_command: tuple[str, ...] | None = None  # default: command with remote paths
    min_uptime_s: float = Field(default=3.0, ge=0)
    probe: tuple[str, ...] | None = None  # optional health probe command, {area} expanded
    healthcheck_timeout_s: float = Field(default=30.0, gt=0)
    parallelism: int = Field(default=4, ge=1)
    env: dict[str, str] = Field(default_factory=dict)
    # Run the daemons as this user / group (default: as monitord); it must exist on both
    # sides. The data dir is handed over to it before each start (monitord/base/run_as.py).
    user: str | None = Field(default=None, min_length=1)
    group: str | None = Field(default=None, min_length=1)
    # When the VPS has been unreachable monitord.vps_lost_after_s: "wait" for it (or for an
    # operator's give-up), or bring the areas "home" on the PBX's own copy by itself.
    on_vps_lost: str = Field(default="wait", pattern="^(wait|home)$")
    # A remote area's data copied to the PBX while it runs, so that a lost VPS costs at most
    # a few intervals of it (orchestrator/warm_copy.py): "off", or "sqlite" — the files
    # matching `warm_copy_databases` (globs on paths inside the data dir) are SQLite
    # databases, copied by SQLite's backup API on the VPS; every other file as it is, checked
    # unchanged during its copy — or {command = [...]}, the service's own snapshot command.
    # Off by default: a daemon's files copied while it writes them are torn unless the
    # service says how they are consistent.
    warm_copy: Literal["off", "sqlite"] | WarmCopyCommand = "off"
    warm_copy_databases: tuple[str, ...] = ()
    warm_copy_interval_s: float = Field(default=30.0, ge=1.0)

    @field_validator("warm_copy", mode="before")
    @classmethod
    def _warm_copy_kind(cls, value: Any) -> Any:
        """One readable line for each wrong kind (a union's own errors name its members)."""
        if isinstance(value, dict):
            try:
                return WarmCopyCommand.model_validate(value)
            except ValidationError as e:
                raise ValueError(_first_error(e)) from e
        if value not in ("off", "sqlite"):
            raise ValueError('must be "off", "sqlite" or {command = [...]}')
        return value

    @field_validator("warm_copy_databases")
    @classmethod
    def _database_globs(cls, globs: tuple[str, ...]) -> tuple[str, ...]:
        if len(globs) > WARM_COPY_MAX_GLOBS:
            raise ValueError(f"at most {WARM_COPY_MAX_GLOBS} globs")
        for glob in globs:
            if not glob or len(glob) > 255 or glob.startswith("/") or "\0" in glob:
                raise ValueError(f"{glob!r:.80}: a glob of a path inside the data dir"
                                 " (not empty, not absolute, at most 255 characters)")
        return globs

    @model_validator(mode="after")
    def _warm_copy_declared(self) -> ServiceSection:
        if isinstance(self.warm_copy, WarmCopyCommand) and self.warm_copy_databases:
            raise ValueError("warm_copy_databases goes with warm_copy = \"sqlite\", not with"
                             " a snapshot command")
        if self.warm_copy == "sqlite" and not self.warm_copy_databases:
            raise ValueError('warm_copy = "sqlite" needs warm_copy_databases, the globs of'
                             " the service's SQLite databases")
        return self

    @field_validator("local_data_dir", "remote_data_dir")
    @classmethod
    def _no_data_dir_in_copy_dirs(cls, template: str) -> str:
        """A copy keeps its own dirs in `.monitord-copy/` beside the data dir
        (monitord.base.tree_digest.copy_dir), out of every area's reach because an area id
        never starts with a dot: so the template's last component may not either, nor may
        any component be that dir."""
        parts = template.rstrip("/").split("/")
        if parts[-1].startswith("."):
            raise ValueError(f"{template!r}: the last component may not start with '.'")
        if tree_digest.COPY_DIR_NAME in parts:
            raise ValueError(f"{template!r}: {tree_digest.COPY_DIR_NAME} is a copy's own dir")
        return template


class Config(_Section):
    monitord: MonitordSection = MonitordSection()
    http: HttpSection = HttpSection()
    remote: RemoteSection | None = None
    services: dict[str, ServiceSection] = Field(default_factory=dict)
    source: Path | None = Field(default=None, exclude=True)

    @field_validator("services")
    @classmethod
    def _service_names(cls, services: dict[str, ServiceSection]) -> dict[str, ServiceSection]:
        for name in services:  # the one pattern of names (str.isalnum took any script)
            reason = names.why_invalid(name)
            if reason is not None:
                raise ValueError(f"service name: {reason}")
        return services


def default_path() -> Path:
    """-c default: $MONITORD_CONFIG, then /etc/monitord/monitord.toml."""
    env = os.environ.get(CONFIG_ENV)
    return Path(env) if env else DEFAULT_CONFIG_PATH


def _key_path(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        else:
            parts.append(item)
    return ".".join(parts) or "(top level)"


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    key = _key_path(tuple(p for p in first["loc"] if p not in ("function-after",)))
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"key {key}: unknown key"
    if kind == "missing":
        return f"key {key}: required key is missing"
    msg = first["msg"].removeprefix("Value error, ")
    more = len(err.errors()) - 1
    return f"key {key}: {msg}" + (f" (and {more} more problem(s))" if more else "")


def parse(data: dict[str, Any], *, source: Path | None = None) -> Config:
    """Validate already-parsed TOML data; raises ConfigError with one readable line."""
    where = str(source) if source else "<config>"
    try:
        return Config.model_validate({**data, "source": source})
    except ValidationError as e:
        raise ConfigError(f"{where}: {_first_error(e)}") from e


def load(path: Path) -> Config:
    """Read and validate a monitord.toml; raises ConfigError with one readable line."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from e
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text at byte {e.start}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e
    return parse(data, source=path)
