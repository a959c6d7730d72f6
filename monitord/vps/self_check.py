"""`monitord.pyz self-check --dir DIR`: can this VPS run the agent? Standard library only.

Run by preflight over SSH (and by `monitord check --remote`) with the same interpreter that
will run the agent, so it answers for the real thing. Each check prints one JSON line
`{"check", "ok", "detail", "fix"}` on stdout; exit 0 when all pass, 1 otherwise:

- python:     the interpreter is CPython >= 3.9;
- modules:    every module in the artifact imports (a missing standard-library module, or a
              pyz built wrongly, shows here and not at the first move);
- flock:      flock(2) works in DIR (the agent's singleton lock and the tunnel lease need it);
- proc:       /proc shows process start times and command lines (process identity);
- ss:         `ss` runs (the tunnel lease finds the holder of a forwarded port with it);
- bin_dir:    DIR is a directory we can create, fsync and remove files in;
- socket:     the agent's socket path fits a Unix socket address (107 bytes) and the
              kernel lets us bind one there;
- fence:      how the agent fences its areas — by cgroup, or by process group only and
              why — as it said at its last start (`DIR/fencing.json`: only the agent can
              tell, in its own cgroup and sandbox; monitord/base/cgroup_fence.py). Never a
              failure: the process group fences where no cgroup does.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import json
import os
import pkgutil
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

MIN_PYTHON = (3, 9)
MAX_SOCKET_PATH = 107  # sizeof(sun_path) - 1 on Linux
EXIT_OK = 0
EXIT_FAILED = 1

# (ok, detail, fix)
Outcome = tuple[bool, str, str]


def check_python(_: Path) -> Outcome:
    version = ".".join(str(v) for v in sys.version_info[:3])
    impl = sys.implementation.name
    if impl == "cpython" and sys.version_info[:2] >= MIN_PYTHON:
        return True, f"{impl} {version} at {sys.executable}", ""
    return (False, f"{impl} {version} at {sys.executable}",
            "install python3 >= 3.9 (Debian 11+/Ubuntu 20.04+ ship one) or set "
            "remote.remote_python to one")


def _artifact_modules() -> Iterator[str]:
    for package in ("monitord", "orchestrator"):
        module = importlib.import_module(package)
        yield package
        for info in pkgutil.walk_packages(module.__path__, prefix=package + "."):
            yield info.name


def check_modules(_: Path) -> Outcome:
    failed = []
    count = 0
    for name in _artifact_modules():
        count += 1
        try:
            importlib.import_module(name)
        except Exception as e:  # any import failure is the finding itself
            failed.append(f"{name} ({type(e).__name__}: {e})")
    if failed:
        return (False, "cannot import " + "; ".join(failed[:5]),
                "push the monitord.pyz built by this monitord (it carries only the VPS "
                "side and needs nothing but the standard library)")
    return True, f"{count} modules import", ""


def check_flock(base: Path) -> Outcome:
    try:
        with tempfile.TemporaryFile(dir=base) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError as e:
        return (False, f"flock in {base}: {e.strerror or e}",
                "put remote_bin_dir on a local file system that supports flock(2) (not NFS "
                "without locking)")
    return True, f"flock works in {base}", ""


def check_proc(_: Path) -> Outcome:
    try:
        stat = Path(f"/proc/{os.getpid()}/stat").read_text()
        cmdline = Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
    except OSError as e:
        return (False, f"/proc is not readable: {e.strerror or e}",
                "mount /proc (the agent identifies processes by PID, start time and argv)")
    if ")" not in stat or not cmdline:
        return False, "/proc/<pid>/stat or cmdline is empty", "mount /proc without hidepid"
    return True, "/proc shows start times and command lines", ""


def check_ss(_: Path) -> Outcome:
    path = shutil.which("ss")
    if path is None:
        return False, "`ss` is not on PATH", "install iproute2 (apt-get install iproute2)"
    try:
        result = subprocess.run([path, "-H", "-tln"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"`ss -H -tln` failed: {e}", "install iproute2 (apt-get install iproute2)"
    if result.returncode != 0:
        tail = result.stderr.decode(errors="replace").strip()[-200:]
        return False, f"`ss -H -tln` exited {result.returncode}: {tail}", "install iproute2"
    return True, f"{path} runs", ""


def check_bin_dir(base: Path) -> Outcome:
    if not base.is_dir():
        return (False, f"{base} is not a directory",
                f"mkdir -m 0700 {base} as the login user (provisioning also creates it)")
    try:
        fd, name = tempfile.mkstemp(dir=base, prefix=".self-check.")
        try:
            os.write(fd, b"x")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as e:
        return (False, f"cannot write in {base}: {e.strerror or e}",
                f"chown the login user {base} and chmod 0700 it; check free space")
    return True, f"{base} is writable", ""


def check_socket(base: Path) -> Outcome:
    from monitord.vps import server

    path = server.socket_path(base)
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        return (False, f"{path} is {len(os.fsencode(str(path)))} bytes, more than a Unix "
                f"socket address holds ({MAX_SOCKET_PATH})",
                "choose a shorter remote.remote_bin_dir (for example /opt/offload)")
    # ".sXXXXXXXX/s" is shorter than "api/agent.sock": a path that fits passes the probe
    with tempfile.TemporaryDirectory(dir=base, prefix=".s") as scratch:
        probe = Path(scratch) / "s"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.bind(str(probe))
        except OSError as e:
            return (False, f"cannot bind a Unix socket in {base}: {e.strerror or e}",
                    "put remote_bin_dir on a local file system")
    return True, f"the agent will listen on {path}", ""


def check_fence(base: Path) -> Outcome:
    from monitord.base import cgroup_fence

    note = base / cgroup_fence.NOTE_NAME
    try:
        fences = cgroup_fence.read_note(base)
    except OSError as e:
        return True, f"not known: cannot read {note}: {e.strerror or e}", ""
    except ValueError:
        return True, f"not known: {note} is not the agent's", ""
    if fences is None:
        return (True, "not known yet: the agent says at its start whether areas on the VPS are"
                      " fenced by cgroup or by process group only", "")
    return True, fences.describe("areas on the VPS"), ""


CHECKS: tuple[tuple[str, Callable[[Path], Outcome]], ...] = (
    ("python", check_python),
    ("modules", check_modules),
    ("bin_dir", check_bin_dir),
    ("flock", check_flock),
    ("proc", check_proc),
    ("ss", check_ss),
    ("socket", check_socket),
    ("fence", check_fence),
)
_NEEDS_DIR = {"flock", "socket"}


def run_checks(base: Path) -> list[dict[str, object]]:
    lines: list[dict[str, object]] = []
    dir_ok = True
    for name, check in CHECKS:
        if name in _NEEDS_DIR and not dir_ok:
            ok, detail, fix = False, "skipped: the bin dir is not usable", ""
        else:
            try:
                ok, detail, fix = check(base)
            except Exception as e:  # a check that crashes is a failed check, not a crash
                ok, detail, fix = False, f"{type(e).__name__}: {e}", ""
        if name == "bin_dir":
            dir_ok = ok
        lines.append({"check": name, "ok": ok, "detail": detail, "fix": fix})
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, required=True, help="remote bin dir (agent home)")


def main(args: argparse.Namespace) -> int:
    lines = run_checks(args.dir.absolute())
    for line in lines:
        print(json.dumps(line), flush=True)
    return EXIT_OK if all(line["ok"] for line in lines) else EXIT_FAILED


VERBS = {"self-check": (add_arguments, main)}
