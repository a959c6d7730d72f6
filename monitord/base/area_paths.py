"""Where an area lives on each side: the service section's templates, expanded.

A service's `command`, `local_data_dir`, `remote_command` and `remote_data_dir` are
templates over {area}, {data_dir}, {generation}, {side} and {remote_bin_dir}. They are
expanded here, next to the configuration they come from, for the local supervisor (what
to start) and for the engine's two sides (where the data is, what the agent starts).
"""

from __future__ import annotations

import re
from pathlib import Path

from monitord.base.config import Config, ServiceSection

_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
# The local supervisor's dir under work_dir (records/, logs/{area}.log): monitord.surface.wiring.
SUPERVISOR_DIR = "supervisor"


def local_log_path(work_dir: Path, area: str) -> Path:
    """The PBX's log of an area's daemon (the side's log hub writes it)."""
    return work_dir / SUPERVISOR_DIR / "logs" / f"{area}.log"


def expand(template: str, *, area: str, data_dir: str, generation: int, side: str,
           remote_bin_dir: str = "") -> str:
    """Expand {area}, {data_dir}, {generation}, {side} and {remote_bin_dir} in a template;
    any other {name} is left as written (a daemon argument may contain braces)."""
    known = {"area": area, "data_dir": data_dir, "generation": str(generation), "side": side,
             "remote_bin_dir": remote_bin_dir}
    return _PLACEHOLDER.sub(lambda m: known.get(m.group(1), m.group(0)), template)


def local_data_dir_text(section: ServiceSection, *, area: str, generation: int) -> str:
    """The area's data dir on the PBX, as the daemon's command gets it."""
    return expand(section.local_data_dir, area=area, data_dir="", generation=generation,
                  side="local")


def local_data_dir(section: ServiceSection, *, area: str, generation: int) -> Path:
    """The area's data dir on the PBX."""
    return Path(local_data_dir_text(section, area=area, generation=generation))


def warm_copy_dir(work_dir: Path, *, service: str, area: str) -> Path:
    """Where the PBX keeps a remote area's newest warm copy (monitord/engine/warm_copier.py):
    never a data dir any daemon runs on."""
    return work_dir / "warm" / service / area


def arriving_warm_copy_dir(warm_dir: Path) -> Path:
    """Where the next warm copy of `warm_dir`'s area is received until it is recorded: in
    `.arriving/` beside it, a name no area id can have (none starts with a dot; a suffix
    could be another area's id)."""
    return warm_dir.parent / ".arriving" / warm_dir.name



def local_command(section: ServiceSection, *, area: str, generation: int) -> tuple[str, ...]:
    """The argv that runs the area on the PBX."""
    data_dir = local_data_dir_text(section, area=area, generation=generation)
    return tuple(
        expand(part, area=area, data_dir=data_dir, generation=generation, side="local")
        for part in section.command
    )


def remote_data_root(config: Config, *, service: str) -> str:
    """The deepest directory on the VPS above the data dir of every area of `service` (the
    template's leading components without {area} or {generation}, expanded): where check
    --remote measures the free space a move of that service will use."""
    assert config.remote is not None
    template = config.services[service].remote_data_dir
    parts = template.split("/")
    fixed = []
    for part in parts[:-1]:
        if "{area}" in part or "{generation}" in part:
            break
        fixed.append(part)
    root = "/".join(fixed) or "/"
    return expand(root, area="", data_dir="", generation=0, side="remote",
                  remote_bin_dir=config.remote.remote_bin_dir)


def remote_paths(
    config: Config, *, service: str, area: str, generation: int
) -> tuple[str, tuple[str, ...]]:
    """(data dir, argv) of an area on the VPS, templates expanded."""
    assert config.remote is not None
    section = config.services[service]
    bin_dir = config.remote.remote_bin_dir
    data_dir = expand(
        section.remote_data_dir, area=area, data_dir="", generation=generation, side="remote",
        remote_bin_dir=bin_dir,
    )
    template = section.remote_command or section.command
    command = tuple(
        expand(part, area=area, data_dir=data_dir, generation=generation, side="remote",
               remote_bin_dir=bin_dir)
        for part in template
    )
    return data_dir, command
