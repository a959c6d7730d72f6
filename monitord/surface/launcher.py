"""`monitord launch -c FILE`: the one idempotent way to start the daemon.

If the instance lock of work_dir is held, monitord already runs: exit 0 without a word. Else
start `monitord run -c FILE` detached (its own session, stdin from /dev/null, output appended
to `{work_dir}/monitord.log` through a log sink that caps and rotates it like an area's log:
`area_log_max_bytes`, `area_log_keep`; monitord.base.log_sink) and wait until it answers
/readyz. Two launchers racing are fine: the lock lets one `run` win, the loser exits 3, and
its launcher then sees the lock held and succeeds too. Boot scripts, watchdogs and upgrades
all call this, never `run` directly.

Exit codes: 0 running (started now or already), 1 the daemon did not come up (the tail of its
log is printed), 2 bad config.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from monitord.base import log_sink
from monitord.surface.cli import EXIT_DUPLICATE, EXIT_FAILURE, EXIT_OK

LOG_NAME = "monitord.log"
DEFAULT_READY_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.05
PROBE_TIMEOUT_S = 1.0
SINK_DRAIN_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from monitord.surface.daemon import add_arguments as add_run_arguments

    add_run_arguments(parser)
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_READY_TIMEOUT_S,
        help="seconds to wait for the daemon to become ready (default %(default)s)",
    )


def _ready(listen: str) -> bool:
    from monitord.base.hostport import split_hostport

    host, port = split_hostport(listen)
    url = f"http://{host}:{port}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def main(args: argparse.Namespace) -> int:
    from monitord.base import singleton
    from monitord.surface.daemon import load_config_or_exit

    loaded = load_config_or_exit(args.config)
    if isinstance(loaded, int):
        return loaded
    work_dir = loaded.monitord.work_dir
    if singleton.is_held(work_dir):
        return EXIT_OK
    config_path = loaded.source or args.config
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / LOG_NAME
    child, sink = log_sink.spawn_logged(
        [sys.executable, "-m", "monitord", "run", "-c", str(config_path),
         "--log-level", args.log_level],
        sink_argv=[sys.executable, "-m", "monitord", "log-sink", *log_sink.arguments(
            path=log_path, max_bytes=loaded.monitord.area_log_max_bytes,
            keep=loaded.monitord.area_log_keep)],
    )
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        code = child.poll()
        if code is not None:
            if code == EXIT_DUPLICATE and singleton.is_held(work_dir):
                return EXIT_OK  # another launcher won the race; monitord runs
            try:
                sink.wait(timeout=SINK_DRAIN_S)  # its last words written before the tail
            except subprocess.TimeoutExpired:
                pass
            print(
                f"monitord: the daemon exited with code {code}; see {log_path}:\n{_tail(log_path)}",
                file=sys.stderr,
            )
            return EXIT_FAILURE
        if _ready(loaded.http.listen):
            return EXIT_OK
        time.sleep(POLL_INTERVAL_S)
    print(
        f"monitord: the daemon (pid {child.pid}) is not ready after {args.timeout:.0f} s; "
        f"it keeps starting in the background, see {log_path}",
        file=sys.stderr,
    )
    return EXIT_FAILURE


# The verb this module serves (monitord.surface.cli): verb -> (add arguments, run).
VERBS = {"launch": (add_arguments, main)}
