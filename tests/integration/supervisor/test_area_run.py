"""Turning a configured service into the AreaRun the supervisor starts."""

from __future__ import annotations

from monitord.base.config import ServiceSection
from monitord.local.supervisor import area_run


class TestAreaRun:
    """Command and data-dir templates expand {area}, {data_dir}, {generation} and {side}."""

    def test_templates_are_expanded_and_other_braces_kept(self) -> None:
        section = ServiceSection(
            command=("/bin/tgd", "--area", "{area}", "--data", "{data_dir}",
                     "--gen={generation}", "--side", "{side}", '{"raw": 1}'),
            local_data_dir="/var/lib/cti/tg/{area}",
            remote_data_dir="{remote_bin_dir}/data/tg/{area}",
            min_uptime_s=4,
            env={"TZ": "UTC"},
        )
        run = area_run(service="tg", section=section, area="u1", generation=7)
        assert run.command == ("/bin/tgd", "--area", "u1", "--data", "/var/lib/cti/tg/u1",
                               "--gen=7", "--side", "local", '{"raw": 1}')
        assert (run.data_dir, run.generation, run.min_uptime_s) == ("/var/lib/cti/tg/u1", 7, 4)
        assert dict(run.env) == {"TZ": "UTC"}
