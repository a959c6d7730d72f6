"""The diagnostic bundle redacts secrets and never carries private key material."""

from __future__ import annotations

import io
import json
import tarfile

import asyncssh
import pytest

from monitord.surface import bundle


def _members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {
            m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
        }


class TestRedaction:
    """Secret-named values are replaced wherever they sit in a section."""

    def test_nested_secret_keys_are_redacted(self) -> None:
        # Allow-list: a nested secret is redacted inside a kept container, and an unknown
        # key ("x") is redacted whole (the deny-list used to show it).
        section = {"remote": {
            "host": "vps", "agent_secret": "s3cr3t",
            "local_forwards": [{"name": "m", "token": 1}], "x": [{"token": 1}],
        }}
        assert bundle.redact(section, "config.json") == {"remote": {
            "host": "vps", "agent_secret": "<redacted>",
            "local_forwards": [{"name": "m", "token": "<redacted>"}], "x": "<redacted>",
        }}

    def test_bundle_contains_sections_without_secret_values(self) -> None:
        data = bundle.build({"config.json": {"key_file": "/etc/k", "password": "hunter2"}})
        members = _members(data)
        text = members["monitord-bundle/config.json"]
        assert b"/etc/k" in text and b"hunter2" not in text


class TestKeyMaterial:
    """A section holding a private key is replaced, whatever its name."""

    def test_private_key_never_leaves_in_a_bundle(self) -> None:
        key = asyncssh.generate_private_key("ssh-ed25519").export_private_key().decode()
        data = bundle.build({"events.log": f"something\n{key}\n", "ok.txt": "fine"})
        members = _members(data)
        assert b"PRIVATE KEY" not in b"".join(members.values())
        assert members["monitord-bundle/ok.txt"] == b"fine"
        assert b"redacted" in members["monitord-bundle/events.log"]


class TestVersion:
    """Every bundle says which monitord and which Python wrote it, before any other section."""

    def test_version_json_comes_first_and_names_monitord_and_python(self) -> None:
        import json
        import platform

        from monitord import __version__

        data = bundle.build({"status.json": {"services": {}}})
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            names = tar.getnames()
        assert names[0] == "monitord-bundle/version.json"
        version = json.loads(_members(data)["monitord-bundle/version.json"])
        assert version["monitord"] == __version__
        assert version["python"] == platform.python_version()


class TestHostileSpoolFiles:
    """A spool file another user wrote is shown as a note, never an exception: huge
    numbers, deep nesting and NaN cannot stop the bundle."""

    @pytest.mark.parametrize("raw", [
        b'{"custom_daemons": [{"uuid": "a1", "generation": ' + b"9" * 5000 + b"}]}",
        b'{"custom_daemons": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}",
        b'{"custom_daemons": [' + b"[" * 900 + b"]" * 900 + b"]}",
        b'{"custom_daemons": [{"uuid": "a1", "generation": NaN}]}',
    ], ids=["5000 digits", "100000 deep", "900 deep", "NaN"])
    def test_the_section_is_a_note_and_the_rest_is_packed(self, raw: bytes) -> None:
        data = bundle.build({"custom_config.json": raw, "status.json": {"areas": []}})
        members = _members(data)
        shown = members["monitord-bundle/custom_config.json"]
        assert shown.startswith(b"<redacted>: custom_config.json is")
        assert json.loads(members["monitord-bundle/status.json"]) == {"areas": []}
