"""Secrets and file modes: the bundle redacts by allow-list, the CLI writes it 0600 from
creation, a commit keeps custom_config.json's mode and owner, the `[remote]` host-key and
the old agent forward's deprecation, and the agent's name check."""

from __future__ import annotations

import argparse
import io
import json
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest

from monitord.base import atomic_file, config
from monitord.store import spool_files
from monitord.surface import bundle, client_commands
from monitord.vps import runtime

R = bundle.REDACTED


def members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {
            Path(m.name).name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
        }


class TestBundleAllowList:
    """Only keys known to be safe keep their values, per section."""

    @pytest.mark.parametrize("key", ["API_KEY", "DB_PASS", "AWS_CREDS", "MY_TOKEN", "x_secret"])
    def test_secret_looking_env_and_unknown_keys_are_redacted(self, key: str) -> None:
        cfg = {
            "remote": {"host": "vps", "key_file": "/etc/monitord/id", key: "v4lue"},
            "services": {"tg": {
                "local_data_dir": "/d/{area}", "parallelism": 4, "min_uptime_s": 3.0,
                "env": {key: "v4lue", "PLAIN": "v4lue"},
                "command": ["tg", "--password", "v4lue"], "future_field": "v4lue",
            }},
            key: "v4lue",
        }
        text = members(bundle.build({"config.json": cfg}))["config.json"]
        assert b"v4lue" not in text
        shown = json.loads(text)
        assert shown["remote"] == {"host": "vps", "key_file": "/etc/monitord/id", key: R}
        assert shown["services"]["tg"] == {
            "local_data_dir": "/d/{area}", "parallelism": 4, "min_uptime_s": 3.0,
            "env": R, "command": R, "future_field": R,
        }
        assert shown[key] == R

    def test_secret_looking_key_is_redacted_even_in_a_known_section(self) -> None:
        events = [{"event": "x", "service": "tg", "api_key": "k", "detail": "ok", "blob": {}}]
        assert bundle.redact(events, "events.json") == [
            {"event": "x", "service": "tg", "api_key": R, "detail": "ok", "blob": R}
        ]

    def test_custom_config_keeps_only_the_placement(self) -> None:
        raw = json.dumps({
            "custom_daemons": [
                {"uuid": "u1", "service": "tg", "location": "remote", "generation": 3,
                 "phone": "+79001234567", "session": "abc", "DB_PASS": "pw"},
            ],
            "license": "L-123",
        }).encode()
        text = members(bundle.build({"custom_config.json": raw}))["custom_config.json"]
        for leaked in (b"+79001234567", b"abc", b"pw", b"L-123"):
            assert leaked not in text
        assert json.loads(text) == {
            "custom_daemons": [
                {"uuid": "u1", "service": "tg", "location": "remote", "generation": 3,
                 "phone": R, "session": R, "DB_PASS": R},
            ],
            "license": R,
        }

    def test_a_spool_file_that_is_not_json_is_not_shown(self) -> None:
        raw = b'{"custom_daemons": [{"uuid": "u1", "phone": "+79001234567"'
        text = members(bundle.build({"custom_config.json": raw}))["custom_config.json"]
        assert b"+79001234567" not in text and b"not valid JSON" in text

    def test_names_and_counts_are_kept(self) -> None:
        status = {
            "counts": {"local": 1, "remote": 2},
            "services": {"tg": {"state": "idle", "counts": {"remote": 2}, "extra": "x"}},
            "tunnel": {"state": "connected", "lease": {"owner_id": "o", "ttl": 6.0}},
        }
        assert bundle.redact(status, "status.json") == {
            "counts": {"local": 1, "remote": 2},
            "services": {"tg": {"state": "idle", "counts": {"remote": 2}, "extra": R}},
            "tunnel": {"state": "connected", "lease": {"owner_id": "o", "ttl": 6.0}},
        }
        remote_state = json.dumps(
            {"tg": {"parked": True, "fail_count": 5, "last_error": "E: x", "token": "t"}}
        )
        assert json.loads(members(bundle.build({"remote_state.json": remote_state}))[
            "remote_state.json"
        ]) == {"tg": {"parked": True, "fail_count": 5, "last_error": "E: x", "token": R}}


class TestBundleFileMode:
    """`monitord bundle` writes the file 0600 from its creation, never wider."""

    def test_the_file_is_0600_before_it_takes_the_name(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        output = tmp_path / "out.tar.gz"
        seen: list[int] = []
        real_replace = os.replace

        def replace(src: Any, dst: Any) -> None:
            seen.append(stat.S_IMODE(os.stat(src).st_mode))
            real_replace(src, dst)

        monkeypatch.setattr(atomic_file.os, "replace", replace)
        monkeypatch.setattr(client_commands, "_load", lambda args: config.parse({}))
        monkeypatch.setattr(
            client_commands.Client, "request", lambda self, method, path: (200, b"payload")
        )
        old_umask = os.umask(0)
        try:
            code = client_commands.main_bundle(
                argparse.Namespace(config=None, output=output, offline=False))
        finally:
            os.umask(old_umask)
        assert code == 0
        assert seen == [0o600], "the bundle existed with a wider mode than 0600"
        assert stat.S_IMODE(output.stat().st_mode) == 0o600
        assert output.read_bytes() == b"payload"


class TestCustomConfigKeepsModeAndOwner:
    """A commit rewrites custom_config.json with the mode and owner it had."""

    def _config(self, path: Path) -> spool_files.CustomConfig:
        path.write_text(json.dumps({"custom_daemons": [{"uuid": "u1", "service": "tg"}]}))
        return spool_files.read_custom_config(path)

    def test_mode_is_kept(self, tmp_path: Path) -> None:
        path = tmp_path / "custom_config.json"
        self._config(path)
        os.chmod(path, 0o640)
        spool_files.update_area_placement(path, uuid="u1", location="remote", generation=1)
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
        assert spool_files.read_custom_config(path).entry("u1") == spool_files.AreaEntry(
            uuid="u1", service="tg", location="remote", generation=1
        )

    @pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")
    def test_owner_is_kept(self, tmp_path: Path) -> None:
        path = tmp_path / "custom_config.json"
        self._config(path)
        os.chown(path, 33, 33)  # e.g. www-data, the PHP UI
        spool_files.update_area_placement(path, uuid="u1", location="remote", generation=1)
        st = path.stat()
        assert (st.st_uid, st.st_gid) == (33, 33)
        assert stat.S_IMODE(st.st_mode) == 0o644

    def test_a_chown_not_allowed_fails_unless_the_owner_already_matches(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        path = tmp_path / "custom_config.json"
        config_ = self._config(path)
        before = path.read_bytes()
        mine = (os.getuid(), os.getgid())

        def refuse(fd: int, uid: int, gid: int) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(atomic_file.os, "fchown", refuse)
        atomic_file.atomic_write_bytes(path, b"{}", owner=mine)  # already ours: fine
        assert path.read_bytes() == b"{}"
        path.write_bytes(before)
        with pytest.raises(PermissionError):
            atomic_file.atomic_write_bytes(path, b"{}", owner=(mine[0] + 1, mine[1]))
        assert path.read_bytes() == before
        assert [p.name for p in tmp_path.iterdir()] == ["custom_config.json"]
        spool_files.write_custom_config(path, config_)  # owner matches: the write goes on


REMOTE = {"host": "vps", "user": "offload", "key_file": "/etc/monitord/id_ed25519"}


class TestRemoteRules:
    """`[remote]`: no accept_any_host_key beside known_hosts; the agent's old TCP forward is
    recognised, dropped and named once."""

    def test_accept_any_host_key_with_known_hosts_is_an_error(self) -> None:
        with pytest.raises(config.ConfigError) as e:
            config.parse({"remote": {
                **REMOTE, "known_hosts": "/etc/monitord/known_hosts",
                "accept_any_host_key": True,
            }})
        line = str(e.value)
        assert "\n" not in line
        assert "accept_any_host_key" in line and "known_hosts" in line

    def test_accept_any_host_key_alone_is_still_the_demo(self) -> None:
        assert config.parse({"remote": {**REMOTE, "accept_any_host_key": True}}).remote

    def test_the_old_manager_forward_loads_with_one_deprecation_and_is_dropped(self) -> None:
        parsed = config.parse({"remote": {
            **REMOTE, "known_hosts": "/k", "agent_listen": "127.0.0.1:8225",
            "local_forwards": [
                {"name": "manager", "listen": "127.0.0.1:8226", "target": "127.0.0.1:8225"},
                {"name": "console", "listen": "127.0.0.1:9000", "target": "127.0.0.1:9000"},
            ],
        }})
        assert parsed.remote is not None
        assert [f.name for f in parsed.remote.local_forwards] == ["console"]
        assert len(parsed.remote.deprecations) == 1
        line = parsed.remote.deprecations[0]
        assert "agent_listen" in line and "'manager'" in line and "SSH connection" in line

    def test_a_forward_to_the_old_agent_port_is_recognised_by_its_target(self) -> None:
        parsed = config.parse({"remote": {**REMOTE, "known_hosts": "/k", "local_forwards": [
            {"name": "api", "listen": "127.0.0.1:8226", "target": "127.0.0.1:8225"},
        ]}})
        assert parsed.remote is not None and parsed.remote.local_forwards == ()
        assert len(parsed.remote.deprecations) == 1

    def test_a_current_configuration_has_no_deprecation_and_no_local_forward(self) -> None:
        parsed = config.parse({"remote": {**REMOTE, "known_hosts": "/k"}})
        assert parsed.remote is not None
        assert parsed.remote.deprecations == () and parsed.remote.local_forwards == ()
        assert parsed.remote.agent_socket() == "/opt/offload/api/agent.sock"

    def test_the_agent_socket_path_is_the_one_the_agent_listens_on(self) -> None:
        from monitord.vps import server

        parsed = config.parse({"remote": {**REMOTE, "known_hosts": "/k",
                                          "remote_bin_dir": "/srv/off/"}})
        assert parsed.remote is not None
        assert parsed.remote.agent_socket() == str(server.socket_path(Path("/srv/off")))


class TestAgentNameCheck:
    """The agent's names match the whole string: no trailing newline slips through."""

    @pytest.mark.parametrize("value", ["tg\n", "area-1\n", "a\nb", ""])
    def test_names_with_newlines_are_refused(self, value: str) -> None:
        with pytest.raises(runtime.AgentError) as e:
            runtime.check_name("area", value)
        assert e.value.status == 400

    def test_a_plain_name_passes(self) -> None:
        assert runtime.check_name("area", "3bbcb5d3-8813.x_y") == "3bbcb5d3-8813.x_y"
