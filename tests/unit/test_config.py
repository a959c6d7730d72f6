"""monitord.toml: the example documents every key, and a bad file exits 2 naming the key."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from monitord.base import config

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
