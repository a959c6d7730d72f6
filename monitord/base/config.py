"""The validated configuration of `monitord run` (keys: config/monitord.toml), loaded from TOML.

Called by the CLI before anything else starts. Every problem becomes one `ConfigError`
line naming the file, the key and what is wrong; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

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
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
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
    watchdog_interval_s: float = Field(default=5.0, gt=0)


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
    # The API has no authentication: a listen beyond loopback must be asked for explicitly.
    allow_remote_api: bool = False

    @model_validator(mode="after")
    def _remote_api_is_explicit(self) -> HttpSection:
        if not self.allow_remote_api and not is_loopback_listen(self.listen):
            raise ValueError(
                f"http.listen {self.listen!r} is not a loopback address and the API has no"
                " authentication; set http.allow_remote_api = true to serve it beyond this"
                " machine"
            )
        return self


class ForwardSpec(_Section):
    name: str = Field(min_length=1)
    listen: HostPort
    target: HostPort


class RemoteSection(_Section):
    host: str = Field(min_length=1)
    port: int = Field(default=22, gt=0, lt=65536)
    user: str = Field(min_length=1)
    key_file: Path
    known_hosts: Path | None = None  # None only in the demo: see accept_any_host_key
    accept_any_host_key: bool = False  # demo only; never in production
    remote_bin_dir: str = "/opt/offload"
    remote_python: str = "python3"
    # How the VPS runs monitord's own verbs (agent, agent-launch, tunnel-lease): the pushed
    # single-file artifact by default; tests on one machine point it at this interpreter.
    remote_monitord: tuple[str, ...] = ("{remote_python}", "{remote_bin_dir}/monitord.pyz")
    connect_timeout_s: float = Field(default=10.0, gt=0)
    # A migration's preflight waits this long for a tunnel that is (re)connecting before
    # it counts as failed (SSH_UNREACHABLE); covers start-up and short link blips.
    preflight_tunnel_wait_s: float = Field(default=30.0, ge=0)
    keepalive_interval_s: float = Field(default=5.0, gt=0)
    keepalive_count_max: int = Field(default=3, ge=1)
    reconnect_backoff_base_s: float = Field(default=1.0, gt=0)
    reconnect_backoff_cap_s: float = Field(default=30.0, gt=0)
    reconnect_max_per_minute: int = Field(default=6, ge=1)
    tunnel_lease_ttl_s: float = Field(default=30.0, gt=0)
    area_lease_ttl_s: float = Field(default=30.0, gt=0)
    lease_clock_margin: float = Field(default=0.1, ge=0)
    lease_safety_margin_s: float = Field(default=2.0, ge=0)
    agent_listen: HostPort = "127.0.0.1:8225"
    reverse_forwards: tuple[ForwardSpec, ...] = (
        ForwardSpec(name="nats", listen="127.0.0.1:4222", target="127.0.0.1:4222"),
        ForwardSpec(name="license", listen="127.0.0.1:8222", target="127.0.0.1:8222"),
    )
    local_forwards: tuple[ForwardSpec, ...] = (
        ForwardSpec(name="manager", listen="127.0.0.1:8226", target="127.0.0.1:8225"),
    )
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

    @field_validator("agent_listen")
    @classmethod
    def _agent_listen_loopback(cls, value: str) -> str:
        if not is_loopback_listen(value):
            raise ValueError(
                f"must be a loopback address (127.0.0.0/8, ::1 or localhost), got {value!r}:"
                " the agent's manager API is reached only through the tunnel"
            )
        return value

    @field_validator("reverse_forwards", "local_forwards")
    @classmethod
    def _unique_names(cls, forwards: tuple[ForwardSpec, ...]) -> tuple[ForwardSpec, ...]:
        names = [f.name for f in forwards]
        if len(names) != len(set(names)):
            raise ValueError(f"forward names must be unique, got {names}")
        return forwards

    def manager_forward(self) -> ForwardSpec | None:
        """The local forward that reaches the agent's manager API, if configured."""
        for forward in self.local_forwards:
            if forward.target == self.agent_listen or forward.name == "manager":
                return forward
        return None


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


class Config(_Section):
    monitord: MonitordSection = MonitordSection()
    http: HttpSection = HttpSection()
    remote: RemoteSection | None = None
    services: dict[str, ServiceSection] = Field(default_factory=dict)
    source: Path | None = Field(default=None, exclude=True)

    @field_validator("services")
    @classmethod
    def _service_names(cls, services: dict[str, ServiceSection]) -> dict[str, ServiceSection]:
        for name in services:
            if not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"service name {name!r} must be letters, digits, '-' or '_'")
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
