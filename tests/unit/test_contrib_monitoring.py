"""The alert rules and the Grafana dashboard in contrib/ read only what monitord serves: the
rules pass `promtool check rules`, and every monitord_* name either uses is a family of
GET /metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from monitord.base.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "contrib" / "prometheus" / "monitord.rules.yml"
DASHBOARD = ROOT / "contrib" / "grafana" / "monitord-dashboard.json"
_NAME = re.compile(r"\bmonitord_[a-z_]+")
_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def _served() -> set[str]:
    text = Metrics().render().decode()
    return {family.name for family in text_string_to_metric_families(text)}


def _family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed")
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 12 rules found" in result.stdout


@pytest.mark.parametrize("where", ["rules", "dashboard"])
def test_every_monitord_name_used_is_served(where: str) -> None:
    text = RULES.read_text() if where == "rules" else "\n".join(_dashboard_exprs())
    used = {_family(name) for name in _NAME.findall(text)}
    assert used, "nothing read?"
    assert used - _served() == set()


def test_the_rules_cover_what_an_operator_is_paged_for() -> None:
    alerts = set(re.findall(r"- alert: (\w+)", RULES.read_text()))
    assert {"MonitordServiceParked", "MonitordTunnelDown", "MonitordTunnelConflict",
            "MonitordAreaDown", "MonitordCrashLoop", "MonitordCleanupStuck",
            "MonitordConfigCorrupt", "MonitordDowntimeHigh", "MonitordWarmCopyOverdue"} <= alerts


def test_a_name_that_is_not_served_would_be_caught() -> None:
    assert _family("monitord_area_restarts_total") in _served()
    assert _family("monitord_no_such_thing_total") not in _served()
