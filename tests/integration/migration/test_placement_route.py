"""The route of a placement request (docs/architecture.md, "The route of a placement request"):
custom_config.json is checked once per request — by the operator facade, never by the HTTP
handler while an engine runs — every answer is the one the bare application (no engine
behind the API) gives, and the source's local stop is requested once."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from monitord.base import config
from monitord.base.metrics import Metrics
from monitord.base.periodic import LoopBook
from monitord.engine.migration_engine import MigrationEngine
from monitord.engine.operator_facade import OperatorFacade
from monitord.engine.operator_verbs import OperatorVerbs
from monitord.engine.phase_actions import PhaseActions
from monitord.engine.placement_state import PlacementState
from monitord.local.supervisor import AreaRun, LocalSupervisor
from monitord.store import spool_files
from monitord.store.state_db import Store
from monitord.surface import http_api
from monitord.surface.admission import Admission
from orchestrator import phases
from orchestrator.migration_step import StepRules
from orchestrator.models import Phase, Side, Transaction
from tests.support import api_auth

AREA = "5b1d0c7a-2f3e-4a5b-8c9d-0e1f2a3b4c5d"
OTHER = "9e8d7c6b-5a4f-4e3d-8c2b-1a0f9e8d7c6b"
CONFIG = config.Config(
    services={"tg": config.ServiceSection(command=("tgd",), local_data_dir="/d/{area}",
                                          remote_data_dir="/r")},
    # a VPS is configured: a move to it is one the intake takes (none is made here)
    remote=config.RemoteSection(host="vps.invalid", user="offload",
                                key_file=Path("/nonexistent/key"),
                                known_hosts=Path("/nonexistent/known_hosts")),
)
JSON = {"Content-Type": "application/json"}
GOOD = json.dumps({"custom_daemons": [{"uuid": AREA, "service": "tg"}]})
Client = TestClient[web.Request, web.Application]


@asynccontextmanager
async def engine_api(root: Path) -> AsyncIterator[tuple[Client, Path]]:
    """The HTTP app in front of the engine's facade, as the daemon wires it (the engine's
    loop is not run: only the intake is asked)."""
    root.mkdir()
    custom = root / "custom_config.json"
    custom.write_text(GOOD)
    async with await Store.open(root / "work") as store:
        state = PlacementState(store=store, custom_config_path=custom)
        await state.load()
        engine = MigrationEngine(
            state=state, actions=None, store=store,  # type: ignore[arg-type]
            metrics=Metrics(),  parallelism={"tg": 1},
            bounds=StepRules(park_after_failures=3, retry_backoff_base_s=0.01,
                             retry_backoff_cap_s=0.02),
        )
        admission = Admission()
        admission.open_intake()
        facade = OperatorFacade(
            config=CONFIG, owner_id="pbx-test", engine=engine,
            verbs=OperatorVerbs(engine=engine, actions=None),  # type: ignore[arg-type]
            reconciler=None, cleanup_worker=None, supervisor=None,  # type: ignore[arg-type]
            link=None, admission=admission,
            custom_config_path=custom, remote_state_path=root / "remote_state.json",
            loops=LoopBook(),
        )
        ctx = http_api.ApiContext(config=CONFIG, admission=admission, placement=facade,
                                  custom_config_path=custom, operator=facade,
                                  api_token=api_auth.TOKEN)
        async with TestClient(TestServer(http_api.build_app(ctx)),
                              headers=api_auth.HEADERS) as client:
            yield client, custom


@asynccontextmanager
async def bare_api(root: Path) -> AsyncIterator[tuple[Client, Path]]:
    """The HTTP app with no engine behind it (the store takes the wish)."""
    root.mkdir()
    custom = root / "custom_config.json"
    custom.write_text(GOOD)
    async with await Store.open(root / "work") as store:
        admission = Admission()
        admission.open_intake()
        ctx = http_api.ApiContext(config=CONFIG, admission=admission,
                                  placement=http_api.StorePlacementIntake(store),
                                  custom_config_path=custom, api_token=api_auth.TOKEN)
        async with TestClient(TestServer(http_api.build_app(ctx)),
                              headers=api_auth.HEADERS) as client:
            yield client, custom


@contextmanager
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """How often custom_config.json is parsed, and checked through the placement state."""
    seen = {"parsed": 0, "checked": 0}
    parse = spool_files.read_custom_config
    recheck = PlacementState.recheck

    def parsing(path: Path) -> spool_files.CustomConfig:
        seen["parsed"] += 1
        return parse(path)

    async def checking(self: PlacementState) -> bool:
        seen["checked"] += 1
        return await recheck(self)

    monkeypatch.setattr(spool_files, "read_custom_config", parsing)
    monkeypatch.setattr(PlacementState, "recheck", checking)
    yield seen


def rewrite(path: Path, text: str) -> None:
    """A change the stamp (inode, size, mtime) sees: written to a new file, renamed over."""
    fresh = path.with_suffix(".new")
    fresh.write_text(text)
    fresh.replace(path)


class TestOneCheckPerRequest:
    """While an engine runs, a request parses a changed custom_config.json once and checks it
    once, whichever route it takes."""

    @pytest.mark.parametrize("path", [f"/v1/areas/{AREA}/placement",
                                      "/v1/services/tg/placement"])
    async def test_a_placement_parses_and_checks_the_file_once(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
    ) -> None:
        async with engine_api(tmp_path / "api") as (client, custom):
            rewrite(custom, GOOD.replace('"tg"}', '"tg", "phone": "+1"}'))  # a change to read
            with counted(monkeypatch) as seen:
                answer = await client.put(path, json={"location": "remote"}, headers=JSON)
                assert answer.status == 202, await answer.text()
            assert seen == {"parsed": 1, "checked": 1}

    async def test_an_unchanged_file_is_not_parsed_again(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        async with engine_api(tmp_path / "api") as (client, _):
            with counted(monkeypatch) as seen:
                answer = await client.put(f"/v1/areas/{AREA}/placement",
                                          json={"location": "remote"}, headers=JSON)
                assert answer.status == 202
            assert seen == {"parsed": 0, "checked": 1}


# Requests and the file each is sent against; every answer must be what the bare app answers.
CASES: list[tuple[str, str, Any, str]] = [
    ("area", f"/v1/areas/{AREA}/placement", {"location": "remote"}, GOOD),
    ("area, not listed", f"/v1/areas/{OTHER}/placement", {"location": "remote"}, GOOD),
    ("area, bad body", f"/v1/areas/{AREA}/placement", {"location": "mars"}, GOOD),
    ("area, corrupt file", f"/v1/areas/{AREA}/placement", {"location": "local"}, "{not json"),
    ("service", "/v1/services/tg/placement", {"location": "remote"}, GOOD),
    ("service, unknown", "/v1/services/wa/placement", {"location": "remote"}, GOOD),
]


def _shape(status: int, body: dict[str, Any], root: Path) -> tuple[int, dict[str, Any]]:
    """The answer with what differs between two installations made neutral: the file's path
    in a detail and the transaction ids (the bare app opens none)."""
    text = json.dumps(body).replace(str(root), "ROOT")
    shaped = json.loads(text)
    shaped.pop("transaction_ids", None)
    return status, shaped


class TestTheAnswersAreTheBareApplications:
    @pytest.mark.parametrize(("name", "path", "body", "file"), CASES, ids=[c[0] for c in CASES])
    async def test_same_status_and_body_through_the_facade(
        self, tmp_path: Path, name: str, path: str, body: Any, file: str
    ) -> None:
        answers = []
        make: Callable[[Path], Any]
        for make, root in ((engine_api, tmp_path / "engine"), (bare_api, tmp_path / "bare")):
            async with make(root) as (client, custom):
                rewrite(custom, file)
                answer = await client.put(path, json=body, headers=JSON)
                answers.append(_shape(answer.status, await answer.json(), root))
        assert answers[0] == answers[1]
        if name == "area":
            assert answers[0] == (202, {"service": "tg", "area": AREA, "location": "remote"})
        if name == "area, corrupt file":
            assert answers[0][0] == 409 and answers[0][1]["error"]["code"] == "CONFIG_CORRUPT"

    async def test_a_corrupt_file_refuses_a_service_placement_with_409(
        self, tmp_path: Path
    ) -> None:
        async with engine_api(tmp_path / "api") as (client, custom):
            rewrite(custom, "{not json")
            answer = await client.put("/v1/services/tg/placement", json={"location": "remote"},
                                      headers=JSON)
            error = (await answer.json())["error"]
        assert answer.status == 409 and error["code"] == "CONFIG_CORRUPT"
        assert error["detail"].startswith(f"custom_config.json is unreadable: {custom}: ")


class CountingSupervisor(LocalSupervisor):
    """The real supervisor, counting the requests that would stop one area."""

    def __init__(self, area: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.watched = area
        self.stop_requests = 0

    def set_desired(self, areas: Any) -> None:
        if self.watched in self._desired and self.watched not in areas:
            self.stop_requests += 1
        super().set_desired(areas)

    async def stop_area(self, area: str, *, grace_s: float | None = None) -> bool:
        if area == self.watched:
            self.stop_requests += 1
        return await super().stop_area(area, grace_s=grace_s)


class TestTheLocalStop:
    async def test_suppressing_the_local_source_requests_its_stop_once(
        self, tmp_path: Path
    ) -> None:
        custom = tmp_path / "custom_config.json"
        custom.write_text(GOOD)
        supervisor = CountingSupervisor(AREA, state_dir=tmp_path / "supervisor", tick_s=0.05)
        async with await Store.open(tmp_path / "work") as store:
            state = PlacementState(store=store, custom_config_path=custom)
            await state.load()
            actions = PhaseActions(config=CONFIG, state=state, supervisor=supervisor,
                                   link=None, renewer=None, store=store, owner_id="pbx")
            run = AreaRun(service="tg", area=AREA, generation=0, command=("sleep", "30"),
                          data_dir=str(tmp_path / "data"))
            started = await supervisor.start_area(run)
            assert started.pid is not None
            txn = Transaction(
                transaction_id="t1", service="tg", area=AREA, source=Side.LOCAL,
                destination=Side.REMOTE, phase=Phase.SUPPRESS_SOURCE, generation=1,
                source_generation=0, started_at=0.0, updated_at=0.0,
            )
            try:
                await state.save(txn)  # the persisted phase: the area may no longer run here
                [suppress] = [a for a in phases.next_actions(txn, phases.StepContext(at=0.0))
                              if isinstance(a, phases.SuppressSource)]
                await actions.perform(txn, suppress)
            finally:
                await supervisor.stop_all(grace_s=1.0)
                await supervisor.close()
        assert supervisor.stop_requests == 1
        with pytest.raises(ProcessLookupError):
            os.kill(started.pid, 0)  # stopped, and proven gone
