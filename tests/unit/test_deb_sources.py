"""What the Debian package is built from (scripts/deb.py), checked without building it:
the lock pins every runtime dependency with a hash, and the packaged config is the example
with its [remote] section switched off in the one way docs/install.md switches it on.
The package itself is installed and run in tests/faults/test_deb_package.py."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from types import ModuleType

from monitord.base import config as config_module

REPO = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([a-z0-9-]+)==(\S+) \\\n    --hash=sha256:([0-9a-f]{64})$", re.M)


def _deb() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deb", REPO / "scripts" / "deb.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_lock_pins_every_runtime_dependency_with_a_hash() -> None:
    text = (REPO / "requirements.lock").read_text()
    pins = PIN.findall(text)
    body = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(body) == 2 * len(pins), "a line of the lock is neither a pin nor its hash"
    names = [name for name, _, _ in pins]
    assert names == sorted(names) and len(set(names)) == len(names)
    wanted = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    missing = {_name(r) for r in wanted} - set(names)
    assert missing == set(), f"pyproject.toml's dependencies not in requirements.lock: {missing}"


def test_the_packaged_config_loads_without_remote_and_the_documented_sed_restores_it(
        tmp_path: Path) -> None:
    deb = _deb()
    example = (REPO / "config" / "monitord.toml").read_text()
    packaged = deb.packaged_config(example)
    (tmp_path / "packaged.toml").write_text(packaged)
    loaded = config_module.load(tmp_path / "packaged.toml")
    assert loaded.remote is None
    assert set(loaded.services) == set(config_module.load(REPO / "config/monitord.toml").services)
    # docs/install.md: sed -i 's/^#~ //' /etc/monitord/monitord.toml
    assert re.sub(r"(?m)^#~ ", "", packaged) == example
    assert "sed -i 's/^#~ //' /etc/monitord/monitord.toml" in (
        REPO / "docs" / "install.md").read_text()


def test_the_package_depends_on_the_python_its_wheels_are_for() -> None:
    """The lock resolves for one CPython minor version (its compiled wheels): the package's
    Depends admits exactly that python3 and no other."""
    deb = _deb()
    target = deb.TARGET_PIP_ARGS[deb.TARGET_PIP_ARGS.index("--python-version") + 1]
    major, minor = (int(part) for part in target.split("."))
    bounds = dict(re.findall(r"python3 \((>=|<<) ([0-9.]+)\)", deb.DEPENDS))
    assert bounds == {">=": f"{major}.{minor}", "<<": f"{major}.{minor + 1}"}, deb.DEPENDS
    assert f"cp{major}{minor}" in deb.TARGET_PIP_ARGS  # the ABI of the compiled wheels
