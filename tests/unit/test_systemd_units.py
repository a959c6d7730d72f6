"""The systemd units run monitord and its agent as dedicated users with a hardened sandbox,
and their Documentation= points at documents that ship with the project."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
UNITS = ("monitord.service", "monitord-agent.service")
DOC_PREFIX = "file:/usr/share/doc/monitord/"  # docs/*.md are installed there (operations.md)
HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateDevices": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "RestrictSUIDSGID": "yes",
    "RestrictRealtime": "yes",
    "RestrictNamespaces": "yes",
    "LockPersonality": "yes",
    "SystemCallArchitectures": "native",
    "UMask": "0077",
    # the daemons outlive the unit's process and need the same /tmp after a restart
    "PrivateTmp": "no",
    "KillMode": "process",
    # the unit's cgroup is delegated: areas get cgroups of their own (with
    # ProtectControlGroups=no in a drop-in: docs/operations.md, "systemd and the daemons")
    "Delegate": "yes",
}
# What starting daemons as per-service users needs, and nothing more (tests/integration/
# test_privilege_drop.py runs a non-root monitord and guard with exactly these).
CAPABILITIES = {
    "monitord.service": {"CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_DAC_OVERRIDE",
                         "CAP_KILL", "CAP_SYS_PTRACE"},
    "monitord-agent.service": {"CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_DAC_OVERRIDE",
                               "CAP_KILL"},
}


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (a key may be repeated); comments and blanks skipped."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not KEY=VALUE"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit.get(section, {}).get(key)
    assert values, f"[{section}] {key}= is not set"
    assert len(values) == 1, f"[{section}] {key}= is set {len(values)} times"
    return values[0]


@pytest.mark.parametrize("name", UNITS)
class TestUnits:
    """Each unit: a non-root user, the hardening keys, capabilities only for the drop."""

    def test_runs_as_a_dedicated_user_not_root(self, name: str) -> None:
        unit = parse_unit(REPO_ROOT / "systemd" / name)
        assert one(unit, "Service", "User") not in ("", "root", "0")

    def test_sets_every_hardening_key(self, name: str) -> None:
        unit = parse_unit(REPO_ROOT / "systemd" / name)
        wrong = {key: unit["Service"].get(key) for key, value in HARDENING.items()
                 if unit["Service"].get(key) != [value]}
        assert wrong == {}, f"{name}: expected {HARDENING}"
        assert one(unit, "Service", "ReadWritePaths").split()
        assert one(unit, "Service", "SystemCallFilter").startswith("@system-service")

    def test_holds_only_the_capabilities_the_privilege_drop_needs(self, name: str) -> None:
        unit = parse_unit(REPO_ROOT / "systemd" / name)
        ambient = set(one(unit, "Service", "AmbientCapabilities").split())
        bounding = set(one(unit, "Service", "CapabilityBoundingSet").split())
        assert ambient == bounding == CAPABILITIES[name]

    def test_each_capability_says_why_it_is_needed_and_what_else_it_allows(
        self, name: str
    ) -> None:
        """Together they come close to root: the unit names each on a line of its own with
        its purpose and an `Also:` (what a compromised process could do with it), and
        docs/operations.md has a row for each with both."""
        text = (REPO_ROOT / "systemd" / name).read_text()
        unit = parse_unit(REPO_ROOT / "systemd" / name)
        rows = {
            cells[0].strip("` "): cells
            for line in (REPO_ROOT / "docs" / "operations.md").read_text().splitlines()
            if line.startswith("| `CAP_")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]
        }
        for capability in one(unit, "Service", "AmbientCapabilities").split():
            explained = re.search(
                rf"^#\s+{capability}\s+\S.*(\n#\s{{10,}}.*)*", text, re.MULTILINE)
            assert explained, f"{name}: no comment line of its own for {capability}"
            assert "Also:" in explained.group(0), f"{name}: {capability} lacks its 'Also:'"
            assert capability in rows, f"docs/operations.md: no row for {capability}"
            assert len(rows[capability]) == 3 and all(rows[capability]), rows[capability]

    def test_documentation_points_at_shipped_documents(self, name: str) -> None:
        unit = parse_unit(REPO_ROOT / "systemd" / name)
        urls = one(unit, "Unit", "Documentation").split()
        files = [url for url in urls if url.startswith("file:")]
        assert files, urls
        for url in files:
            assert url.startswith(DOC_PREFIX), url
            assert (REPO_ROOT / "docs" / url.removeprefix(DOC_PREFIX)).is_file(), url


def test_the_install_steps_put_the_docs_where_the_units_point() -> None:
    install = (REPO_ROOT / "docs" / "operations.md").read_text()
    assert DOC_PREFIX.removeprefix("file:").rstrip("/") in install


def test_the_agent_units_command_line_is_one_the_agent_accepts() -> None:
    """ExecStart runs the pyz isolated and with arguments the agent verb parses (a stale
    option would make it exit 2 at every start, which the unit never retries)."""
    import shlex

    from monitord.vps import entry

    argv = shlex.split(one(parse_unit(REPO_ROOT / "systemd" / "monitord-agent.service"), "Service",
                           "ExecStart"))
    assert argv[:3] == ["/usr/bin/python3", "-I", "/opt/offload/monitord.pyz"]
    args = entry.build_parser(only=argv[3]).parse_args(argv[3:])
    assert args.verb == "agent" and str(args.dir) == "/opt/offload"
    assert args.supervised_by == "systemd", "the agent must know the unit restarts it"


def test_the_agent_unit_is_its_one_supervisor_and_waits_for_its_code() -> None:
    """Restart=always (an upgrade stops the unit's agent for the unit to start the new pyz),
    and the path unit starts it once the pyz exists — the very file ExecStart runs."""
    import shlex

    service = parse_unit(REPO_ROOT / "systemd" / "monitord-agent.service")
    path = parse_unit(REPO_ROOT / "systemd" / "monitord-agent.path")
    pyz = shlex.split(one(service, "Service", "ExecStart"))[2]
    assert one(service, "Service", "Restart") == "always"
    assert one(service, "Unit", "ConditionPathExists") == pyz
    assert one(path, "Path", "PathExists") == pyz
    assert one(path, "Path", "Unit") == "monitord-agent.service"
    assert one(path, "Install", "WantedBy")


def test_systemd_analyze_accepts_the_agent_units(tmp_path: Path) -> None:
    import shutil
    import subprocess

    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    for name in ("monitord-agent.service", "monitord-agent.path"):
        shutil.copy(REPO_ROOT / "systemd" / name, tmp_path / name)
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(tmp_path / "monitord-agent.path"),
         str(tmp_path / "monitord-agent.service")],
        capture_output=True, text=True, timeout=60, check=False,
        env={"SYSTEMD_UNIT_PATH": f"{tmp_path}:", "PATH": "/usr/bin:/bin"},
    )
    # Only the units' own lines count: the host's unrelated units may be reported too.
    ours = [line for line in result.stderr.splitlines() if "monitord-agent" in line
            and "/usr/bin/python3" not in line]
    assert ours == [] and result.returncode == 0, result.stderr


def test_the_pbx_unit_keeps_its_children_and_survives_one_killed_for_memory() -> None:
    """docs/operations.md, "systemd and the daemons": the daemons outlive monitord inside its
    unit (KillMode=process; the next monitord adopts them), and a daemon the kernel kills
    for memory is the supervisor's to restart, not a reason to stop the unit (OOMPolicy=stop,
    systemd's default, would)."""
    unit = parse_unit(REPO_ROOT / "systemd" / "monitord.service")
    assert one(unit, "Service", "KillMode") == "process"
    assert one(unit, "Service", "OOMPolicy") == "continue"
    # the daemons run with monitord's sandbox and outlive it: nothing that a restart of the
    # unit tears down may be theirs
    assert one(unit, "Service", "PrivateTmp") == "no"
    assert "RuntimeDirectory" not in unit["Service"]


def test_the_packaged_unit_runs_the_packaged_command() -> None:
    """The Debian package ships systemd/monitord.service as it is: ExecStart names the
    package's /usr/bin/monitord (scripts/deb.py), with a verb and options the CLI parses."""
    import shlex

    from monitord.surface import cli

    argv = shlex.split(one(parse_unit(REPO_ROOT / "systemd" / "monitord.service"), "Service",
                           "ExecStart"))
    assert argv[0] == "/usr/bin/monitord"
    args = cli.build_parser(only=argv[1]).parse_args(argv[1:])
    assert args.verb == "run" and str(args.config) == "/etc/monitord/monitord.toml"
