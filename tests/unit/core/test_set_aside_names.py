"""Where the VPS says it set a given-up copy aside is checked before the PBX records it: the
keeper later removes what the record names and `fetch-abandoned` downloads it, so a VPS that
answers `/` (or another area's copy, or a path out of `abandoned/`) must be refused."""

from __future__ import annotations

import pytest

from orchestrator import names

AREA = "5b0c6f1e-8d2a-4c1b-9e77-0a1b2c3d4e5f"
BASE = "/opt/offload"


def test_the_name_the_agent_makes_is_accepted_for_its_area_and_generation() -> None:
    name = names.set_aside_name(AREA, 7, 1_700_000_000)
    assert names.is_set_aside_name(name, area=AREA, generation=7)
    assert names.set_aside_problem(f"{BASE}/abandoned/{name}", base_dir=BASE, area=AREA,
                                   generation=7) is None
    assert names.set_aside_problem(f"{BASE}/abandoned/{name}", base_dir=BASE + "/", area=AREA,
                                   generation=7) is None


@pytest.mark.parametrize("path", [
    "/", "", f"{BASE}", f"{BASE}/abandoned", f"{BASE}/abandoned/",
    f"{BASE}/abandoned/..", f"{BASE}/data/tg/{AREA}",
    f"{BASE}/abandoned/{AREA}-g7-1/..", f"{BASE}/abandoned/../abandoned/{AREA}-g7-1",
    f"/etc/abandoned/{AREA}-g7-1", f"{BASE}/abandoned/other-g7-1",
    f"{BASE}/abandoned/{AREA}-g8-1", f"{BASE}/abandoned/{AREA}-g7-1\n",
    f"{BASE}/abandoned/.{AREA}-g7-1", None, 7,
])
def test_anything_else_is_refused_with_a_reason(path: object) -> None:
    problem = names.set_aside_problem(path, base_dir=BASE, area=AREA, generation=7)
    assert problem is not None and len(problem) < 400, path
