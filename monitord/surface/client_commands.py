"""Operator verbs that talk to a running daemon over its HTTP API: status, place, retry, bundle.

Called by `monitord.surface.cli`. They are plain synchronous HTTP clients (stdlib urllib, short
timeouts) so that they work the same from a shell, a PHP `exec()` or a support script.
Exit codes: 0 ok, 1 the operation failed or the daemon is unreachable, 2 bad usage/config.
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

from monitord.base import config as config_mod
from monitord.base.hostport import split_hostport
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
    parser.add_argument("--json", action="store_true", help="print the raw status document")


def add_place_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("service", help="service name, e.g. tg")
    parser.add_argument("location", choices=("local", "remote"))
    parser.add_argument("--area", help="move only this area (UUID) instead of the whole service")
    parser.add_argument("--wait", action="store_true", help="show progress until it converges")
    parser.add_argument("--timeout", type=float, default=600.0, help="--wait limit in seconds")


def add_retry_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("service")


def add_rollback_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("service")
    parser.add_argument(
        "--discard-remote-data", action="store_true", required=True,
        help="let rollbacks that wait for data the destination wrote give it up and restart"
             " the source on its own (older) data; recorded as an event",
    )
    parser.add_argument("--area", help="only this area (UUID)")


def add_bundle_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("-o", "--output", type=Path, required=True, help="where to write .tar.gz")


class Client:
    """A tiny JSON client for the daemon's API at `http.listen`."""

    def __init__(self, base_url: str, *, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    @classmethod
    def from_config(cls, cfg: config_mod.Config) -> Client:
        host, port = split_hostport(cfg.http.listen)
        host = f"[{host}]" if ":" in host else host
        return cls(f"http://{host}:{port}")

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None or method not in ("GET", "HEAD"):
            # The API refuses a change without it, even one without a body (retry).
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            payload = e.read()
            try:
                err = json.loads(payload)["error"]
                raise ApiError(e.code, err.get("code", "HTTP_ERROR"), err.get("detail", "")) from e
            except (ValueError, KeyError, TypeError):
                raise ApiError(e.code, "HTTP_ERROR", payload[:200].decode(errors="replace")) from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise DaemonUnreachable(
                f"monitord is not answering at {self.base_url}: {reason}"
            ) from e

    def json(self, method: str, path: str, body: Any = None) -> Any:
        _, payload = self.request(method, path, body)
        return json.loads(payload) if payload else None


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
            print(f"monitord: {e}", file=sys.stderr)
            return EXIT_FAILED
        except ApiError as e:
            print(f"monitord: {e.code}: {e.detail}", file=sys.stderr)
            return EXIT_USAGE if e.status in (400, 404) else EXIT_FAILED

    return wrapper


@_guarded
def main_status(args: argparse.Namespace) -> int:
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
    print(json.dumps(result))
    return EXIT_OK


@_guarded
def main_rollback(args: argparse.Namespace) -> int:
    body = {"area": args.area} if args.area else {}
    result = Client.from_config(_load(args)).json(
        "POST", f"/v1/services/{args.service}/discard-remote-data", body
    )
    print(json.dumps(result))
    return EXIT_OK


@_guarded
def main_place(args: argparse.Namespace) -> int:
    client = Client.from_config(_load(args))
    path = (
        f"/v1/areas/{args.area}/placement"
        if args.area
        else f"/v1/services/{args.service}/placement"
    )
    accepted = client.json("PUT", path, {"location": args.location})
    print(json.dumps(accepted))
    if not args.wait:
        return EXIT_OK
    return _wait_converged(
        client, service=args.service, location=args.location, timeout=args.timeout
    )


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
                progress.finish(f"failed: {err.get('code', 'UNKNOWN')} {err.get('detail', '')}")
                return EXIT_FAILED
            if time.monotonic() > deadline:
                progress.finish(f"still not converged after {timeout:.0f} s")
                return EXIT_FAILED
            time.sleep(0.5)


@_guarded
def main_bundle(args: argparse.Namespace) -> int:
    from monitord.base import atomic_file

    _, payload = Client.from_config(_load(args)).request("GET", "/v1/diagnostics/bundle")
    output: Path = args.output
    # 0600 from creation: the temp file is never wider, so neither is the bundle.
    atomic_file.atomic_write_bytes(output, payload, mode=0o600)
    print(f"wrote {output} ({len(payload)} bytes)")
    return EXIT_OK


# The verbs this module serves (monitord.surface.cli): verb -> (add arguments, run).
VERBS = {
    "status": (add_status_arguments, main_status),
    "place": (add_place_arguments, main_place),
    "retry": (add_retry_arguments, main_retry),
    "rollback": (add_rollback_arguments, main_rollback),
    "bundle": (add_bundle_arguments, main_bundle),
}
