"""Fixtures of the fault tier: a namespace VPS with real OpenSSH, a real nats-server on the
PBX side, and whole installations (`Stack`) pointed at them.

`netns_vps` is a fresh network namespace with sshd (see netns_vps.py) — this machine's, or,
parametrised indirectly with a Debian suite (`RELEASE_MATRIX`), that release's sshd and python3
chrooted into its cached root (debian_root.py); marked `@pytest.mark.link("wan")` (or "far"),
it sits behind that WAN link (tests/support/wan_link.py: delay, line rate, loss, a bounded
queue) instead of the bare veth; `jump_host` a second
one in front of it, through which alone the PBX reaches that sshd; `nats` a PBX-side
nats-server; `fault_stack(**options)` starts a `Stack` whose VPS is that namespace and whose
`nats` reverse forward leads to that nats-server (remote fake daemons report heartbeats
through a second forward and, over the veth, straight to the split-brain detector, which
therefore sees them even while SSH is black-holed). At teardown the stacks are closed, every
process in the namespace is killed and the namespace deleted, and the detector must have
seen no overlap — checked here, after the body, so no test can forget it.

`deb` is `make deb`'s package, built once per run, for the tests that install it into a
Debian root (test_deb_package.py, test_unit_under_systemd.py,
test_install_to_the_first_move.py).

Every test here needs root, iproute2, nft, sshd and nats-server; without them it is skipped
(and under CI=true a skip is a failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from monitord.testing.stack import Stack
from tests.faults import debian_root, monitord_process
from tests.faults.monitord_process import MonitordRun
from tests.faults.nats_server import NatsServer, can_run_nats, running_nats_server
from tests.faults.netns_vps import (
    JumpHost,
    NetnsVps,
    can_build_netns,
    external_vps,
    running_jump_host,
    running_netns_vps,
)
from tests.support import stacks
from tests.support.wan_link import PROFILES, LinkProfile

FaultStackFactory = Callable[..., Awaitable[Stack]]
SpawnMonitord = Callable[..., Awaitable[MonitordRun]]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults" in str(item.fspath):
            item.add_marker(pytest.mark.root)
            if not can_build_netns():
                item.add_marker(pytest.mark.skip(reason="needs root, ip, nft and sshd"))
            elif not can_run_nats():
                item.add_marker(pytest.mark.skip(reason="needs nats-server"))
            elif _on_a_debian_root(item) and not debian_root.can_build_roots():
                item.add_marker(pytest.mark.skip(reason="needs mmdebstrap or built roots"))


REPO = Path(__file__).resolve().parents[2]
DEB_BUILD_TIMEOUT_S = 300.0


@pytest.fixture(scope="session")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make deb`'s package (scripts/deb.py build), built once per test run. The modules that
    use it share the xdist group "deb-package", so one worker builds it (--dist loadgroup)."""
    out = tmp_path_factory.mktemp("deb")
    built = subprocess.run([sys.executable, str(REPO / "scripts" / "deb.py"), "build",
                            "--out", str(out)], capture_output=True, text=True,
                           timeout=DEB_BUILD_TIMEOUT_S, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    return Path(built.stdout.strip().splitlines()[-1])


def _on_a_debian_root(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and "netns_vps" in callspec.params


# The VPS releases every release-dependent promise is proven on (docs/vps-setup.md's table):
# `@pytest.mark.parametrize("netns_vps", RELEASE_MATRIX, indirect=True)`.
RELEASE_MATRIX = list(debian_root.RELEASES)


# The same with a dedicated non-root login, as docs/vps-setup.md sets a VPS up ("SUITE:USER").
RELEASE_MATRIX_AS_LOGIN_USER = [f"{suite}:offload" for suite in RELEASE_MATRIX]


@pytest.fixture
async def netns_vps(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[NetnsVps]:
    param: str | None = getattr(request, "param", None)
    marker = request.node.get_closest_marker("link")
    link = LinkProfile.named(marker.args[0]) if marker else PROFILES["lan"]
    if param is None:
        async with running_netns_vps(tmp_path / "vps", link=link) as vps:
            yield vps
        return
    suite, _, login = param.partition(":")
    root = await asyncio.to_thread(debian_root.debian_root, suite)
    async with running_netns_vps(tmp_path / "vps", debian_root=root, shared=tmp_path,
                                 login=login or "root", link=link) as vps:
        yield vps


@pytest.fixture
async def jump_host(tmp_path: Path, netns_vps: NetnsVps) -> AsyncIterator[JumpHost]:
    """A jump host in front of `netns_vps`: the PBX reaches the VPS's sshd only through it."""
    async with running_jump_host(tmp_path / "jump", netns_vps) as jump:
        yield jump


@pytest.fixture
async def nats(tmp_path: Path) -> AsyncIterator[NatsServer]:
    async with running_nats_server(tmp_path / "nats") as server:
        yield server


@pytest.fixture
async def spawn_monitord() -> AsyncIterator[SpawnMonitord]:
    """Extra `monitord run`s on a stack; each is stopped (SIGTERM, then SIGKILL) and reaped."""
    runs: list[MonitordRun] = []

    async def spawn(stack: Stack, **kw: Any) -> MonitordRun:
        run = await monitord_process.spawn(stack, **kw)
        runs.append(run)
        return run

    yield spawn
    for run in runs:  # an adopted run still going is stopped as the stack would stop it
        if run.running():
            with contextlib.suppress(ProcessLookupError):
                run.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await run.exit_code(timeout_s=20)
        if run.running():
            with contextlib.suppress(ProcessLookupError):
                run.process.kill()
        await run.exit_code(timeout_s=10)


@pytest.fixture
async def fault_stack(
    tmp_path: Path, netns_vps: NetnsVps, nats: NatsServer, spawn_monitord: SpawnMonitord
) -> AsyncIterator[FaultStackFactory]:
    # Requesting spawn_monitord makes it set up first and torn down last: a run a test
    # adopted is stopped gently by its stack, before the spawner's SIGTERM/SIGKILL sweep.
    async with stacks.stack_factory(
        tmp_path, external_vps=external_vps(netns_vps), nats_target=nats.address
    ) as make:
        yield make
