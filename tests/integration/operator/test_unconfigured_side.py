"""A move that can only fail is refused up front: without a `[remote]` section, a move to the
VPS is 409 PREFLIGHT_REMOTE_CONFIG before anything is recorded — no wish, no transaction —
and `monitord place` says so in one line."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.operator.conftest import Browser, run_cli
from tests.integration.operator.rendered_page import parse
from tests.support import daemon_process

AREA = "5b0c6f1e-8d2a-4c1b-9e77-0a1b2c3d4e5f"


async def test_a_move_to_an_unconfigured_vps_is_refused_and_records_nothing(
    tmp_path: Path, browser: Browser
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(parents=True)
    entry = {"uuid": AREA, "service": "tg", "location": "local"}
    (spool / "custom_config.json").write_text(json.dumps({"custom_daemons": [entry]}))
    async with daemon_process.running_daemon(tmp_path) as daemon:
        for path in ("/v1/services/tg/placement", f"/v1/areas/{AREA}/placement"):
            code, body = await daemon.request("PUT", path, json_body={"location": "remote"})
            assert (code, body["error"]["code"]) == (409, "PREFLIGHT_REMOTE_CONFIG"), body
        result = await run_cli("place", "tg", "remote", "-c", str(daemon.config_path))
        assert result.code == 1 and "PREFLIGHT_REMOTE_CONFIG" in result.stderr, result
        _, status = await daemon.request("GET", "/v1/status")
        assert status["transactions"] == [] and status["services"]["tg"]["desired"] == "local"
        code, body = await daemon.request("PUT", "/v1/services/tg/placement",
                                          json_body={"location": "local"})
        assert code == 202, body
        # ... and the page does not offer it
        page = parse(await browser.dump_dom(daemon.api.base_url + "/"))
        assert page.one("body").attrs.get("data-loaded") == "1"
        [row] = [r for r in page.find_all("tr") if r.attrs.get("data-service") == "tg"]
        [remote] = [b for b in row.find_all("button") if b.attrs.get("data-location") == "remote"]
        assert "disabled" in remote.attrs and "no VPS" in remote.attrs["title"], remote.attrs
    assert json.loads((spool / "custom_config.json").read_text())["custom_daemons"] == [entry]


async def test_without_a_remote_section_a_give_up_still_waits_out_the_lease_bound(
    tmp_path: Path
) -> None:
    """The `[remote]` section removed and monitord restarted while an area runs on the VPS:
    that copy may run on for up to its lease's TTL after the last renewal, which was before
    this start — never at minus infinity. So the give-up is refused until then."""
    spool = tmp_path / "spool"
    spool.mkdir(parents=True)
    entry = {"uuid": AREA, "service": "tg", "location": "remote", "generation": 3}
    (spool / "custom_config.json").write_text(json.dumps({"custom_daemons": [entry]}))
    async with daemon_process.running_daemon(tmp_path) as daemon:
        code, body = await daemon.request("POST", "/v1/services/tg/give-up", json_body={})
        assert (code, body["error"]["code"]) == (409, "VPS_NOT_FENCED"), body
        assert body["retry_after_s"] >= 1, body
    assert json.loads((spool / "custom_config.json").read_text())["custom_daemons"] == [entry]
