"""monitord.toml: the example documents every key, and a bad file exits 2 naming the key."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from monitord.base import config
from orchestrator.errors import ErrorCode

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "monitord.toml"
EXAMPLE_CUSTOM_CONFIG = EXAMPLE.with_name("custom_config.json")


def sections(text: str) -> dict[str, str]:
    """TOML text split by table header, e.g. {"monitord": ..., "services.tg": ...}."""
    parts: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        header = re.match(r"^\[([\w.]+)\]\s*$", line)
        if header:
            current = header.group(1)
            continue
        parts[current] = parts.get(current, "") + line + "\n"
    return parts


def documented(text: str, key: str) -> bool:
    """`key = ...` set or shown commented out, or as a field of an inline table."""
    return re.search(rf"(^|[{{,\s])#?\s*{re.escape(key)}\s*=", text, re.MULTILINE) is not None


def model_fields(model: type[BaseModel]) -> list[str]:
    return [name for name, info in model.model_fields.items() if not info.exclude]


class TestExampleDocumentsEveryKey:
    """config/monitord.toml mentions every field of the config model in its own section."""

    def test_the_example_loads(self) -> None:
        loaded = config.load(EXAMPLE)
        assert loaded.remote is not None and loaded.services

    @pytest.mark.parametrize(
        ("section", "model"),
        [
            ("monitord", config.MonitordSection),
            ("http", config.HttpSection),
            ("remote", config.RemoteSection),
            ("remote", config.ForwardSpec),
            ("services.tg", config.ServiceSection),
        ],
    )
    def test_every_field_of_the_section_is_documented(
        self, section: str, model: type[BaseModel]
    ) -> None:
        text = sections(EXAMPLE.read_text())[section]
        missing = [key for key in model_fields(model) if not documented(text, key)]
        assert missing == [], f"[{section}] in {EXAMPLE.name} does not document {missing}"

    def test_every_top_level_table_is_present(self) -> None:
        tables = {name.split(".")[0] for name in sections(EXAMPLE.read_text()) if name}
        assert set(model_fields(config.Config)) <= tables

    def test_the_example_custom_config_is_valid(self) -> None:
        from monitord.store import spool_files

        assert spool_files.read_custom_config(EXAMPLE_CUSTOM_CONFIG).entries


def run_with(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "monitord.toml"
    path.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "monitord", "run", "-c", str(path)],
        capture_output=True, text=True, timeout=60,
    )


BAD_CONFIGS = {
    "malformed TOML": ("[http\nlisten = 1\n", "invalid TOML"),
    "unknown key": ('[monitord]\nwork_dir = "/tmp/x"\ncolour = "blue"\n', "monitord.colour"),
    "wrong type": ('[http]\ndrain_timeout_s = "soon"\n', "http.drain_timeout_s"),
    "bad address": ('[http]\nlisten = "localhost"\n', "http.listen"),
    "missing required": ('[services.tg]\ncommand = ["x"]\nlocal_data_dir = "/d"\n',
                         "services.tg.remote_data_dir"),
    "unknown section": ("[colours]\nred = 1\n", "colours"),
    # a data dir that could be named `.monitord-copy`, where copies keep their own dirs
    "data dir with a leading dot": ('[services.tg]\ncommand = ["x"]\n'
                                    'local_data_dir = "/d/.{area}"\n'
                                    'remote_data_dir = "/r/{area}"\n',
                                    "services.tg.local_data_dir"),
    "data dir inside a copy dir": ('[services.tg]\ncommand = ["x"]\nlocal_data_dir = "/d/{area}"\n'
                                   'remote_data_dir = "/r/.monitord-copy/{area}"\n',
                                   "services.tg.remote_data_dir"),
}


class TestBadConfigThroughTheCli:
    """`monitord run` with a bad config exits 2 with one line naming the key, no traceback."""

    @pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
    def test_bad_config_exits_2_and_names_the_problem(self, tmp_path: Path, case: str) -> None:
        text, expected = BAD_CONFIGS[case]
        result = run_with(tmp_path, text)
        assert result.returncode == 2
        assert expected in result.stderr
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "x").exists()

    def test_missing_config_file_exits_2(self, tmp_path: Path) -> None:
        result = subprocess.run(
            [sys.executable, "-m", "monitord", "run", "-c", str(tmp_path / "absent.toml")],
            capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 2 and "cannot read" in result.stderr
        assert "Traceback" not in result.stderr


def remote_with(tmp_path: Path, **keys: object) -> dict[str, object]:
    """The TOML data of a minimal [remote] section plus `keys`."""
    return {"remote": {"host": "vps.example.net", "user": "offload",
                       "key_file": str(tmp_path / "id_ed25519"),
                       "known_hosts": str(tmp_path / "known_hosts"), **keys}}


def config_error(data: dict[str, object]) -> config.ConfigError:
    with pytest.raises(config.ConfigError) as caught:
        config.parse(data)
    return caught.value


class TestProxyJump:
    """remote.proxy_jump takes OpenSSH's ProxyJump syntax; anything else is CONFIG_INVALID."""

    @pytest.mark.parametrize(
        ("value", "hops"),
        [
            ("bastion", [config.JumpHop(host="bastion")]),
            ("admin@bastion.example.net:2222",
             [config.JumpHop(host="bastion.example.net", user="admin", port=2222)]),
            ("a@j1:22, j2", [config.JumpHop(host="j1", user="a", port=22),
                             config.JumpHop(host="j2")]),
            ("ops@[2001:db8::1]:2222", [config.JumpHop(host="2001:db8::1", user="ops",
                                                       port=2222)]),
            ("[2001:db8::1]", [config.JumpHop(host="2001:db8::1")]),
            ("me@corp@bastion", [config.JumpHop(host="bastion", user="me@corp")]),
            ("none", []),
        ],
    )
    def test_valid_chains_parse_into_hops_first_hop_first(
        self, tmp_path: Path, value: str, hops: list[config.JumpHop]
    ) -> None:
        remote = config.parse(remote_with(tmp_path, proxy_jump=value)).remote
        assert remote is not None and list(remote.jump_hops() or ()) == hops

    def test_a_hop_prints_back_as_written(self) -> None:
        chain = "a@j1:22,j2,ops@[2001:db8::1]:2222"
        assert ",".join(str(hop) for hop in config.parse_proxy_jump(chain)) == chain

    def test_unset_means_the_ssh_config_may_decide(self, tmp_path: Path) -> None:
        remote = config.parse(remote_with(tmp_path)).remote
        assert remote is not None and remote.jump_hops() is None

    @pytest.mark.parametrize(
        ("value", "named"),
        [
            ("", "''"), ("a,,b", "''"), ("j1,", "''"), ("@bastion", "'@bastion'"),
            ("admin@", "'admin@'"), ("bastion:0", "1..65535"), ("bastion:65536", "1..65535"),
            ("bastion:ssh", "1..65535"), ("bastion:", "1..65535"),
            ("2001:db8::1", "in brackets"), ("[2001:db8::1", "'[2001:db8::1'"),
            ("[::1]x", "'[::1]x'"), ("ssh://bastion", "'ssh://bastion'"),
            ("jump host", "'jump host'"),
        ],
    )
    def test_a_bad_chain_is_config_invalid_naming_the_key_and_the_hop(
        self, tmp_path: Path, value: str, named: str
    ) -> None:
        error = config_error(remote_with(tmp_path, proxy_jump=value))
        assert error.code == ErrorCode.CONFIG_INVALID
        assert "key remote.proxy_jump:" in error.detail and named in error.detail


class TestSshConfig:
    """remote.ssh_config must name a readable file; a set port wins over its Port."""

    def test_a_readable_file_is_accepted_and_its_port_may_apply(self, tmp_path: Path) -> None:
        ssh_config = tmp_path / "ssh_config"
        ssh_config.write_text("Host vps\n  HostName 192.0.2.7\n  Port 2222\n")
        remote = config.parse(remote_with(tmp_path, ssh_config=str(ssh_config))).remote
        assert remote is not None and remote.ssh_config == ssh_config
        assert not remote.port_is_set()
        explicit = config.parse(remote_with(tmp_path, ssh_config=str(ssh_config), port=22))
        assert explicit.remote is not None and explicit.remote.port_is_set()

    def test_without_ssh_config_the_default_port_applies(self, tmp_path: Path) -> None:
        remote = config.parse(remote_with(tmp_path)).remote
        assert remote is not None and remote.port_is_set() and remote.port == 22

    @pytest.mark.parametrize("kind", ["missing", "directory"])
    def test_a_missing_file_or_a_directory_is_config_invalid(
        self, tmp_path: Path, kind: str
    ) -> None:
        path = tmp_path / "ssh_config"
        if kind == "directory":
            path.mkdir()
        error = config_error(remote_with(tmp_path, ssh_config=str(path)))
        assert error.code == ErrorCode.CONFIG_INVALID
        expected = f"key remote.ssh_config: {str(path)!r} is not a readable file"
        assert error.detail == f"<config>: {expected}"


class TestAgentSocketFits:
    """remote_bin_dir is refused at load when the agent's socket under it could not be bound
    (a Unix socket address holds 107 bytes), not at the agent's first start on the VPS."""

    def test_the_longest_dir_that_fits_is_accepted_one_more_byte_is_not(
        self, tmp_path: Path
    ) -> None:
        room = config.MAX_SOCKET_PATH - len("/" + config.AGENT_SOCKET)
        longest = "/" + "d" * (room - 1)
        remote = config.parse(remote_with(tmp_path, remote_bin_dir=longest + "/")).remote
        assert remote is not None and len(remote.agent_socket()) == config.MAX_SOCKET_PATH
        error = config_error(remote_with(tmp_path, remote_bin_dir=longest + "d"))
        assert error.code == ErrorCode.CONFIG_INVALID
        assert "key remote.remote_bin_dir:" in error.detail
        assert f"would be {config.MAX_SOCKET_PATH + 1} bytes" in error.detail

    def test_bytes_count_not_characters(self, tmp_path: Path) -> None:
        room = config.MAX_SOCKET_PATH - len("/" + config.AGENT_SOCKET)
        error = config_error(remote_with(tmp_path, remote_bin_dir="/" + "é" * (room // 2)))
        assert "remote.remote_bin_dir" in error.detail

    def test_the_vps_self_check_holds_the_same_limit(self) -> None:
        from monitord.vps import self_check

        assert self_check.MAX_SOCKET_PATH == config.MAX_SOCKET_PATH


class TestPreCopyRule:
    """remote.pre_copy is adaptive unless an explicit pre_copy_min_bytes asks for a fixed one."""

    def test_unset_is_adaptive_from_the_default_threshold(self, tmp_path: Path) -> None:
        remote = config.parse(remote_with(tmp_path)).remote
        assert remote is not None
        assert (remote.pre_copy, remote.pre_copy_min_bytes) == ("adaptive", 1024 * 1024)

    def test_an_explicit_threshold_alone_keeps_its_fixed_meaning(self, tmp_path: Path) -> None:
        remote = config.parse(remote_with(tmp_path, pre_copy_min_bytes=1 << 40)).remote
        assert remote is not None
        assert (remote.pre_copy, remote.pre_copy_min_bytes) == ("by_size", 1 << 40)

    def test_an_explicit_rule_wins_and_the_threshold_is_its_cold_start(
        self, tmp_path: Path
    ) -> None:
        remote = config.parse(remote_with(tmp_path, pre_copy="adaptive",
                                          pre_copy_min_bytes=4096)).remote
        assert remote is not None
        assert (remote.pre_copy, remote.pre_copy_min_bytes) == ("adaptive", 4096)

    def test_an_unknown_rule_is_config_invalid_naming_the_key(self, tmp_path: Path) -> None:
        error = config_error(remote_with(tmp_path, pre_copy="sometimes"))
        assert error.code == ErrorCode.CONFIG_INVALID
        assert "remote.pre_copy" in error.detail


SERVICE = {"command": ["/bin/true"], "local_data_dir": "/srv/{area}",
           "remote_data_dir": "/srv/{area}"}


class TestNamesAndNumbersAreAscii:
    """A service name is a name by the one pattern (orchestrator/names.py), and a port is
    ASCII digits: `str.isalnum` took letters of any script and `str.isdigit` took '²'
    (which int() refuses) and '١' (which it reads as 1)."""

    @pytest.mark.parametrize("name", ["tëlegram", "١٢", "ｔｇ", "-tg", "tg\u200b", "a" * 129])
    def test_a_service_name_outside_the_pattern_is_config_invalid(self, name: str) -> None:
        error = config_error({"services": {name: SERVICE}})
        assert error.code == ErrorCode.CONFIG_INVALID
        assert "service name" in str(error)

    @pytest.mark.parametrize("name", ["tg", "max-bot", "chats_2", "svc.v2"])
    def test_a_service_name_by_the_pattern_is_accepted(self, name: str) -> None:
        parsed = config.parse({"services": {name: SERVICE}})
        assert list(parsed.services) == [name]

    @pytest.mark.parametrize("listen", ["127.0.0.1:²", "127.0.0.1:\u0661\u0662", "127.0.0.1:+80"])
    def test_a_port_of_lookalike_digits_is_config_invalid(self, listen: str) -> None:
        error = config_error({"http": {"listen": listen}})
        assert error.code == ErrorCode.CONFIG_INVALID


class TestWarmCopy:
    """`warm_copy` says how a service's data can be copied while it runs; nothing is
    assumed: without a declaration no area is warm-copied."""

    def _service(self, **keys: object) -> dict[str, object]:
        return {"services": {"tg": {"command": ["tgd"], "local_data_dir": "/l/{area}",
                                    "remote_data_dir": "/r/{area}", **keys}}}

    def test_off_unless_declared(self) -> None:
        section = config.parse(self._service()).services["tg"]
        assert (section.warm_copy, section.warm_copy_databases) == ("off", ())

    def test_sqlite_with_the_databases_globs(self) -> None:
        section = config.parse(self._service(
            warm_copy="sqlite", warm_copy_databases=["*.sqlite", "db/*.db"],
            warm_copy_interval_s=10)).services["tg"]
        assert section.warm_copy_databases == ("*.sqlite", "db/*.db")
        assert section.warm_copy_interval_s == 10.0

    def test_or_the_services_own_snapshot_command(self) -> None:
        section = config.parse(self._service(
            warm_copy={"command": ["tgd-dump", "--to", "$MONITORD_SNAPSHOT_DIR"]})
        ).services["tg"]
        assert isinstance(section.warm_copy, config.WarmCopyCommand)
        assert (section.warm_copy.command[0], section.warm_copy.timeout_s) == ("tgd-dump", 60.0)

    @pytest.mark.parametrize(("keys", "says"), [
        ({"warm_copy": {"command": []}}, "warm_copy: key command"),
        ({"warm_copy": {"command": ["x"], "every": 1}}, "warm_copy: key every: unknown key"),
        ({"warm_copy": {"command": ["x"]}, "warm_copy_databases": ["*.db"]},
         "goes with warm_copy = \"sqlite\""),
        ({"warm_copy": 1}, 'must be "off", "sqlite" or {command = [...]}'),
        ({"warm_copy": "sqlite"}, "needs warm_copy_databases"),
        ({"warm_copy": "sqlite", "warm_copy_databases": ["/etc/*"]}, "inside the data dir"),
        ({"warm_copy": "sqlite", "warm_copy_databases": [""]}, "not empty"),
        ({"warm_copy": "sqlite", "warm_copy_databases": ["*.db"] * 65}, "at most 64"),
        ({"warm_copy": "rsync"}, "warm_copy"),
        ({"warm_copy_interval_s": 0.5}, "warm_copy_interval_s"),
    ])
    def test_a_bad_declaration_is_one_line_naming_the_key(
        self, keys: dict[str, object], says: str
    ) -> None:
        error = config_error(self._service(**keys))
        assert says in str(error) and "\n" not in str(error)
        assert error.code == ErrorCode.CONFIG_INVALID
