"""Operator verbs that talk to a running daemon over its HTTP API: status, areas, logs, place,
retry, rollback, give-up, bundle.

Called by `monitord.surface.cli`. They are plain synchronous HTTP clients (stdlib urllib, short
timeouts) so that they work the same from a shell, a PHP `exec()` or a support script. Every
request carries the API token (`<work_dir>/api-token`, monitord.surface.api_token) when this
user can read it (root, members of `http.token_group`): changes and the bundle need it, reads
do not; a change refused for the lack of it says why the token could not be read.
Exit codes: 0 ok, 1 the operation failed or the daemon is unreachable (one line on stderr:
`monitord: DAEMON_UNREACHABLE: ...`), 2 bad usage/config.

`status --check` is a monitoring plugin instead (Nagios/Icinga convention): one line on stdout
and 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN (daemon unreachable, bad config, unusable answer);
the classification is `orchestrator.health_check`. `place` and `retry` print one human line,
or the API's JSON document with `--json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from monitord.base import area_paths, log_tail
from monitord.base import config as config_mod
from monitord.base.hostport import split_hostport
from monitord.surface import api_token
from orchestrator.errors import ErrorCode, TransientError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
REQUEST_TIMEOUT_S = 10.0
# Service states in which a placement change is still being worked on (ServiceState).
BUSY_STATES = frozenset(
    {
        "preflight",
        "suppressing_source",
        "copying",
        "starting_destination",
        "awaiting_healthcheck",
        "committing",
        "rolling_back",
        "cleaning_orphans",
    }
)


class DaemonUnreachable(TransientError):
    """The daemon's HTTP API did not answer (DAEMON_UNREACHABLE); `detail` is the one line."""

    def __init__(self, detail: str) -> None:
        super().__init__(ErrorCode.DAEMON_UNREACHABLE, detail)

    def __str__(self) -> str:
        return self.detail


class ApiError(Exception):
    """The daemon answered with an error document."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c",
        "--config",
        type=Path,
        default=None,
        help="monitord.toml (default: $MONITORD_CONFIG, then /etc/monitord/monitord.toml)",
    )


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--json", action="store_true", help="print the raw status document")
    mode.add_argument(
        "--check", action="store_true",
        help="monitoring check: one line, exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN",
    )


def add_place_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("service", help="service name, e.g. tg")
    parser.add_argument("location", choices=("local", "remote"))
    parser.add_argument("--area", help="move only this area (UUID) instead of the whole service")
    parser.add_argument(
        "--wait", action="store_true",
        help="show progress until it converges (with --area: until that area has)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="--wait limit in seconds")
    parser.add_argument("--json", action="store_true", help="print the API's answer as JSON")


def add_retry_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("service")
    parser.add_argument("--json", action="store_true", help="print the API's answer as JSON")


def add_rollback_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("service")
    parser.add_argument(
        "--discard-remote-data", action="store_true", required=True,
        help="let rollbacks that wait for data the destination wrote give it up and restart"
             " the source on its own (older) data; recorded as an event",
    )
    parser.add_argument("--area", help="only this area (UUID)")


def add_give_up_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("service")
    parser.add_argument("--area", help="only this area (UUID)")
    parser.add_argument("--json", action="store_true", help="print the API's answer as JSON")


def add_fetch_abandoned_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("area", help="the area (UUID) whose given-up VPS copy to fetch")
    parser.add_argument("--generation", type=int,
                        help="which given-up copy (default: the area's newest)")
    parser.add_argument("--no-wait", dest="wait", action="store_false",
                        help="return once the fetch has started")
    parser.add_argument("--timeout", type=float, default=3600.0, help="wait limit in seconds")
    parser.add_argument("--json", action="store_true", help="print the API's answer as JSON")


def add_areas_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("service", nargs="?", help="only this service's areas")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def add_logs_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("area", help="the area (UUID)")
    parser.add_argument("-n", "--lines", type=int, default=log_tail.DEFAULT_LINES,
                        help=f"how many of the last lines (1..{log_tail.MAX_LINES},"
                             " default %(default)s)")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="keep printing what is appended (Ctrl-C ends it)")
    parser.add_argument("--side", choices=("local", "remote"),
                        help="that side's log (default: where the area is placed)")


def add_bundle_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("-o", "--output", type=Path, required=True, help="where to write .tar.gz")
    parser.add_argument(
        "--offline", action="store_true",
        help="without the daemon: state.db read-only, the config, the spool files, log tails",
    )


class Client:
    """A tiny JSON client for the daemon's API at `http.listen`; `token` (the API token) goes
    into every request's `Authorization: Bearer` header, `token_problem` says why there is none.
    """

    def __init__(
        self, base_url: str, *, timeout: float = REQUEST_TIMEOUT_S, token: str | None = None,
        token_problem: str = "",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.token = token
        self.token_problem = token_problem

    def __repr__(self) -> str:  # never the token
        return f"Client({self.base_url!r}, token={'set' if self.token else 'none'})"

    @classmethod
    def from_config(cls, cfg: config_mod.Config, *, timeout: float = REQUEST_TIMEOUT_S) -> Client:
        host, port = split_hostport(cfg.http.listen)
        host = f"[{host}]" if ":" in host else host
        token, problem = api_token.read(cfg.monitord.work_dir)
        return cls(f"http://{host}:{port}", token=token, token_problem=problem, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None or method not in ("GET", "HEAD"):
            # The API refuses a change without it, even one without a body (retry).
            req.add_header("Content-Type", "application/json")
        if self.token is not None:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            payload = e.read()
            try:
                err = json.loads(payload)["error"]
                code, detail = str(err["code"]), str(err.get("detail", ""))
            except (ValueError, KeyError, TypeError, AttributeError):
                # Not monitord's error document: something else answers on that port.
                code = ErrorCode.DAEMON_UNREACHABLE
                detail = (f"HTTP {e.code} from {self.base_url}{path} is not an answer of"
                          f" monitord's API: {payload[:200].decode(errors='replace')}")
            if code == ErrorCode.API_UNAUTHORIZED and self.token is None and self.token_problem:
                detail = (f"{detail}; {self.token_problem} (run this as root or as a member of"
                          " http.token_group)")
            raise ApiError(e.code, code, detail) from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise DaemonUnreachable(
                f"monitord is not answering at {self.base_url}: {reason}"
            ) from e

    def json(self, method: str, path: str, body: Any = None) -> Any:
        _, payload = self.request(method, path, body)
        try:
            return json.loads(payload) if payload else None
        except ValueError as e:  # something else answers on that port
            raise DaemonUnreachable(
                f"{self.base_url}{path} does not answer like monitord (not JSON: {e})"
            ) from e


def _load(args: argparse.Namespace) -> config_mod.Config:
    return config_mod.load(args.config or config_mod.default_path())


def _guarded(func: Any) -> Any:
    """Turn the expected failures into one line on stderr and a stable exit code."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            result: int = func(args)
            return result
        except config_mod.ConfigError as e:
            print(f"monitord: {e}", file=sys.stderr)
            return EXIT_USAGE
        except DaemonUnreachable as e:
            print(f"monitord: {e.code}: {e}", file=sys.stderr)
            return EXIT_FAILED
        except ApiError as e:
            print(f"monitord: {e.code}: {e.detail}", file=sys.stderr)
            return EXIT_USAGE if e.status in (400, 404) else EXIT_FAILED

    return wrapper


def main_status(args: argparse.Namespace) -> int:
    if args.check:
        return _check(args)
    shown: int = _show_status(args)
    return shown


def _check(args: argparse.Namespace) -> int:
    """`status --check`: every outcome, failures included, is one line and a plugin code."""
    from orchestrator import health_check

    try:
        verdict = health_check.classify(
            Client.from_config(_load(args)).json("GET", "/v1/status"), now=time.time()
        )
    except DaemonUnreachable as e:
        verdict = health_check.unreachable(str(e))
    except config_mod.ConfigError as e:
        verdict = health_check.unusable(f"{ErrorCode.CONFIG_INVALID}: {e}")
    except ApiError as e:
        verdict = health_check.unusable(f"{e.code}: {e.detail}")
    print(verdict.line())
    return verdict.exit_code


@_guarded
def _show_status(args: argparse.Namespace) -> int:
    status = Client.from_config(_load(args)).json("GET", "/v1/status")
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        from monitord.surface import status_view

        status_view.print_status(status)
    return EXIT_OK


@_guarded
def main_retry(args: argparse.Namespace) -> int:
    result = Client.from_config(_load(args)).json("POST", f"/v1/services/{args.service}/retry")
    print(json.dumps(result) if args.json else retry_line(result))
    return EXIT_OK


def _transactions(ids: list[str]) -> str:
    return f"{len(ids)} transaction{'s' if len(ids) != 1 else ''}"


def retry_line(result: dict[str, Any]) -> str:
    """`tg: 2 transactions resumed: ID, ID` (or that nothing was parked)."""
    ids = list(result.get("transaction_ids") or [])
    if not ids:
        return f"{result.get('service')}: nothing was parked, nothing to retry"
    return f"{result.get('service')}: {_transactions(ids)} resumed: {', '.join(ids)}"


def placement_line(accepted: dict[str, Any]) -> str:
    """`tg -> remote: 2 transactions started (2 areas): ID, ID` for a 202 placement answer."""
    service, area = accepted.get("service"), accepted.get("area")
    what = f"{service} area {area}" if area else str(service)
    ids = list(accepted.get("transaction_ids") or [])
    head = f"{what} -> {accepted.get('location')}"
    if not ids:
        return f"{head}: nothing to move, {'it is' if area else 'every area is'} already there"
    areas = f"{len(ids)} area{'s' if len(ids) != 1 else ''}"
    return f"{head}: {_transactions(ids)} started ({areas}): {', '.join(ids)}"


@_guarded
def main_rollback(args: argparse.Namespace) -> int:
    body = {"area": args.area} if args.area else {}
    result = Client.from_config(_load(args)).json(
        "POST", f"/v1/services/{args.service}/discard-remote-data", body
    )
    print(json.dumps(result))
    return EXIT_OK


@_guarded
def main_give_up(args: argparse.Namespace) -> int:
    """The VPS is given up: the areas start on the PBX's own copy; what they wrote on the VPS
    since they moved there is lost (recorded as `remote_data_abandoned` events)."""
    body = {"area": args.area} if args.area else {}
    result = Client.from_config(_load(args)).json(
        "POST", f"/v1/services/{args.service}/give-up", body
    )
    print(json.dumps(result) if args.json else give_up_line(result))
    return EXIT_OK


def give_up_line(result: dict[str, Any]) -> str:
    """`tg: the VPS is given up; 2 transactions take the areas home: ID, ID`, then a line
    per area: what it starts on and how much of its life that loses."""
    what = f"{result.get('service')} area {result['area']}" if result.get("area") \
        else str(result.get("service"))
    ids = list(result.get("transaction_ids") or [])
    lines = [f"{what}: the VPS is given up; {_transactions(ids)} take the areas home"
             f" (what they wrote on the VPS since the copy each starts on is lost):"
             f" {', '.join(ids)}"]
    kept = result.get("kept")
    for area, row in sorted(kept.items() if isinstance(kept, dict) else ()):
        age = row.get("kept_copy_age_s") if isinstance(row, dict) else None
        lost = "an unknown time" if not isinstance(age, int | float) else f"{age:.0f} s"
        on = ("its warm copy" if isinstance(row, dict) and row.get("kept_copy") == "warm"
              else "the PBX's own copy")
        lines.append(f"  {area}: starts on {on}, {lost} of its data lost")
    return "\n".join(lines)


@_guarded
def main_fetch_abandoned(args: argparse.Namespace) -> int:
    """A given-up copy set aside on the VPS, downloaded (verified) into the PBX's work dir
    for forensics; never started, never removed by monitord."""
    client = Client.from_config(_load(args))
    body = {} if args.generation is None else {"generation": args.generation}
    started = client.json("POST", f"/v1/abandoned/{args.area}/fetch", body)
    print(json.dumps(started) if args.json else
          f"{args.area} generation {started['generation']}: fetching {started['from']}"
          f" from the VPS to {started['to']}")
    if not args.wait:
        return EXIT_OK
    deadline = time.monotonic() + args.timeout
    shown = -1
    while True:
        fetch = fetch_state(client.json("GET", "/v1/status"), area=args.area,
                            generation=int(started["generation"]))
        if fetch.get("bytes", 0) != shown:
            shown = fetch.get("bytes", 0)
            print(f"{args.area}: {shown} bytes fetched", file=sys.stderr, flush=True)
        if fetch.get("state") == "done":
            print(f"{args.area}: done, {fetch.get('files')} files in {fetch.get('to')}",
                  file=sys.stderr)
            return EXIT_OK
        if fetch.get("state") != "running":
            print(f"{args.area}: failed: {_error_words(fetch.get('error') or {})}",
                  file=sys.stderr)
            return EXIT_FAILED
        if time.monotonic() > deadline:
            print(f"{args.area}: still fetching after {args.timeout:.0f} s", file=sys.stderr)
            return EXIT_FAILED
        time.sleep(0.5)


def fetch_state(status: dict[str, Any], *, area: str, generation: int) -> dict[str, Any]:
    """The fetch of one given-up copy as the status shows it ({} once it is not listed)."""
    for row in status.get("abandoned_data", []):
        if row.get("area") == area and row.get("generation") == generation:
            return dict(row.get("fetch") or {})
    return {}


@_guarded
def main_place(args: argparse.Namespace) -> int:
    client = Client.from_config(_load(args))
    path = (
        f"/v1/areas/{args.area}/placement"
        if args.area
        else f"/v1/services/{args.service}/placement"
    )
    accepted = client.json("PUT", path, {"location": args.location})
    print(json.dumps(accepted) if args.json else placement_line(accepted))
    if not args.wait:
        return EXIT_OK
    # The answer names the area's own service (the SERVICE argument may be any for --area).
    service = str(accepted.get("service") or args.service)
    if args.area:
        return _wait_area(
            client, service=service, area=args.area, location=args.location,
            timeout=args.timeout,
        )
    return _wait_converged(client, service=service, location=args.location, timeout=args.timeout)


def placement_outcome(status: dict[str, Any], *, service: str, location: str) -> str | None:
    """'done', 'failed' or None (still working) for one service in a status document."""
    svc = status.get("services", {}).get(service)
    if svc is None:
        return "failed"
    if svc.get("state") == "parked":
        return "failed"
    areas = svc.get("areas", [])
    settled = all(a.get("location") == a.get("desired", location) for a in areas)
    if svc.get("state") == "idle" and settled:
        return "done"
    return None


def _wait_converged(client: Client, *, service: str, location: str, timeout: float) -> int:
    from monitord.surface import status_view

    deadline = time.monotonic() + timeout
    with status_view.Progress(service=service, target=location) as progress:
        while True:
            status = client.json("GET", "/v1/status")
            progress.update(status)
            outcome = placement_outcome(status, service=service, location=location)
            if outcome == "done":
                progress.finish("converged")
                return EXIT_OK
            if outcome == "failed":
                err = status.get("services", {}).get(service, {}).get("last_error") or {}
                progress.finish(f"failed: {_error_words(err)}")
                return EXIT_FAILED
            if time.monotonic() > deadline:
                progress.finish(f"still not converged after {timeout:.0f} s")
                return EXIT_FAILED
            time.sleep(0.5)


def _error_words(err: dict[str, Any]) -> str:
    """`CODE detail` of an error the status shows; a failure without a recorded code says so
    instead of making one up (every code printed is a catalogue code)."""
    code = err.get("code")
    if not code:
        return f"no error recorded {err.get('detail') or ''}".rstrip()
    return f"{code} {err.get('detail') or ''}".rstrip()


def area_progress(
    status: dict[str, Any], *, service: str, area: str, location: str
) -> tuple[str | None, str]:
    """(outcome, line) for one area: outcome 'done', 'failed' or None (still working), the
    line what `place --area --wait` prints about it now."""
    label = f"{service}/{area[:8]} -> {location}"
    svc = status.get("services", {}).get(service) or {}
    view = next((a for a in svc.get("areas", []) if a.get("uuid") == area), None)
    if view is None:
        return "failed", f"{label}: failed: UNKNOWN_AREA the area is no longer listed"
    txn: dict[str, Any] = next(
        (t for t in status.get("transactions", []) if t.get("area") == area), {}
    )
    phase, where = view.get("phase"), view.get("location")
    if phase is None:
        if where == location:
            return "done", f"{label}: converged"
        err = svc.get("last_error") or {}
        return "failed", (f"{label}: failed: rolled back to {where}"
                          + (f" ({err.get('code')}: {err.get('detail', '')})" if err else ""))
    if phase == "PARKED":
        shown = svc.get("last_error") or {}
        err = {"code": txn.get("last_error_code") or shown.get("code"),
               "detail": txn.get("last_error_detail") or shown.get("detail", "")}
        return "failed", f"{label}: failed: {_error_words(err)}"
    attempt = f", attempt {txn['attempt']}" if txn.get("attempt") else ""
    return None, f"{label}: phase {phase}{attempt}, on {where}"


def _wait_area(
    client: Client, *, service: str, area: str, location: str, timeout: float
) -> int:
    from monitord.surface import status_view

    deadline = time.monotonic() + timeout
    shown = status_view.LiveLine()
    while True:
        status = client.json("GET", "/v1/status")
        outcome, line = area_progress(status, service=service, area=area, location=location)
        if outcome is not None:
            shown.end(line)
            return EXIT_OK if outcome == "done" else EXIT_FAILED
        copy = next((t.get("copy") for t in status.get("transactions", [])
                     if t.get("area") == area), None)
        shown.show(line + (f", {status_view.copy_words(copy)}" if isinstance(copy, dict)
                           else ""), steady=line)
        if time.monotonic() > deadline:
            shown.end(f"{service}/{area[:8]} -> {location}: still not converged after"
                      f" {timeout:.0f} s")
            return EXIT_FAILED
        time.sleep(0.5)


@_guarded
def main_areas(args: argparse.Namespace) -> int:
    """Every area (of SERVICE): service, uuid, title, side, health, pid, uptime, restarts,
    last exit, the downtime of its last move — the status document's per-area view."""
    from monitord.surface import status_view

    status = Client.from_config(_load(args)).json("GET", "/v1/status")
    if args.service is not None and args.service not in status.get("services", {}):
        raise ApiError(404, ErrorCode.UNKNOWN_SERVICE,
                       f"service {args.service!r} is not configured")
    rows = status_view.area_rows(status, service=args.service)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        from rich.console import Console

        Console().print(status_view.areas_listing(rows))
    return EXIT_OK


FOLLOW_INTERVAL_S = 1.0


@_guarded
def main_logs(args: argparse.Namespace) -> int:
    """An area's log: its last lines, then (-f) what is appended. Through the daemon's API
    (a remote area's log comes from the agent over the tunnel); with no daemon answering, a
    local area's log file is read here."""
    from orchestrator import names

    reason = names.why_invalid(args.area)
    if reason is not None:
        print(f"monitord: {ErrorCode.BAD_REQUEST}: area: {reason}", file=sys.stderr)
        return EXIT_USAGE
    if not 0 < args.lines <= log_tail.MAX_LINES:
        print(f"monitord: {ErrorCode.BAD_REQUEST}: -n must be in 1..{log_tail.MAX_LINES}",
              file=sys.stderr)
        return EXIT_USAGE
    cfg = _load(args)
    reader = _LogReader(Client.from_config(cfg), area=args.area, side=args.side,
                        local_path=area_paths.local_log_path(cfg.monitord.work_dir, args.area),
                        custom_config=cfg.monitord.spool_dir / "custom_config.json")
    found = reader.tail(args.lines)
    _write(found["data"])
    if not args.follow:
        return EXIT_OK
    try:
        while True:
            if not found["data"]:  # caught up: wait; else read on at once (1 MiB at a time)
                time.sleep(FOLLOW_INTERVAL_S)
            found = reader.more(found)
            _write(found["data"])
    except KeyboardInterrupt:
        return EXIT_OK


def _write(data: str) -> None:
    if data:
        sys.stdout.write(data)
        sys.stdout.flush()


class _LogReader:
    """`monitord logs`: the API first; the local file when the daemon does not answer."""

    def __init__(self, client: Client, *, area: str, side: str | None, local_path: Path,
                 custom_config: Path) -> None:
        self.client, self.area, self.side, self.local_path = client, area, side, local_path
        self.custom_config = custom_config
        self.direct = False  # reading the local file here (the daemon did not answer)

    def _placed_remote(self) -> bool:
        """Whether custom_config.json places the area on the VPS (read-only; unknown: no)."""
        from monitord.store import spool_files

        try:
            entry = spool_files.read_custom_config(self.custom_config).entry(self.area)
        except spool_files.ConfigCorrupt:
            return False
        return entry is not None and entry.location == "remote"

    def _query(self, **params: Any) -> dict[str, Any]:
        from urllib.parse import urlencode

        if self.side is not None:
            params["side"] = self.side
        query = urlencode({k: v for k, v in params.items() if v is not None})
        found: dict[str, Any] = self.client.json("GET", f"/v1/areas/{self.area}/logs?{query}")
        return found

    def tail(self, lines: int) -> dict[str, Any]:
        try:
            return self._query(lines=lines)
        except DaemonUnreachable as e:
            if self.side == "remote" or (self.side is None and self._placed_remote()):
                raise DaemonUnreachable(f"{e}; the area's log on the VPS is reached through it"
                                        ) from e
            found = log_tail.tail(str(self.local_path), lines=lines)
            if found["missing"]:
                raise
            print(f"monitord: {e.code}: {e}; reading {self.local_path} here", file=sys.stderr)
            self.direct = True
            return found

    def more(self, last: dict[str, Any]) -> dict[str, Any]:
        if self.direct:
            return log_tail.read_from(str(self.local_path), file=last["file"],
                                      offset=last["offset"])
        return self._query(offset=last["offset"], file=last["file"])


@_guarded
def main_bundle(args: argparse.Namespace) -> int:
    from monitord.base import atomic_file

    cfg = _load(args)
    if args.offline:
        from monitord.surface import bundle, offline_bundle

        client = Client.from_config(cfg, timeout=2.0)
        try:
            client.request("GET", "/readyz")
            reason = f"asked for with --offline; the daemon answers at {client.base_url}"
        except (DaemonUnreachable, ApiError) as e:
            reason = f"{e.code}: {e}"
        payload = bundle.build(offline_bundle.sections(cfg, reason=reason))
    else:
        try:
            _, payload = Client.from_config(cfg).request("GET", "/v1/diagnostics/bundle")
        except DaemonUnreachable as e:
            raise DaemonUnreachable(f"{e}; `monitord bundle --offline` writes one without it"
                                    ) from e
    output: Path = args.output
    # 0600 from creation: the temp file is never wider, so neither is the bundle.
    atomic_file.atomic_write_bytes(output, payload, mode=0o600)
    print(f"wrote {output} ({len(payload)} bytes)")
    return EXIT_OK


# The verbs this module serves (monitord.surface.cli): verb -> (add arguments, run).
VERBS = {
    "status": (add_status_arguments, main_status),
    "areas": (add_areas_arguments, main_areas),
    "logs": (add_logs_arguments, main_logs),
    "place": (add_place_arguments, main_place),
    "retry": (add_retry_arguments, main_retry),
    "rollback": (add_rollback_arguments, main_rollback),
    "give-up": (add_give_up_arguments, main_give_up),
    "fetch-abandoned": (add_fetch_abandoned_arguments, main_fetch_abandoned),
    "bundle": (add_bundle_arguments, main_bundle),
}
