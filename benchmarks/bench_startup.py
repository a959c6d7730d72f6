"""Start-up figure: wall time from spawning `monitord run -c FILE` to its first `/readyz` 200,
against `python -c pass` (the bare interpreter, same python) timed in the same run.

The installation is a small real one: three areas committed local (the supervisor starts
their daemons, `/bin/sleep`, as part of start-up) and a `[remote]` section whose VPS refuses
every connection (a closed loopback port), so the tunnel keeper runs and backs off as it
would with the VPS away. Every run starts on a fresh work_dir (no state.db, no API token, no
agent artifact yet: a first start, the slowest). `/readyz` is polled every `POLL_S` over a
plain socket (an HTTP client library in this process would compete for the same cores).

Bytecode: an installed monitord starts from compiled modules (the Debian package runs
compileall; a checkout writes `__pycache__` as it goes), but a shell that sets
PYTHONDONTWRITEBYTECODE compiles every module of ours at every start, which would swamp the
figure. So both the daemon and the reference run with their own bytecode cache
(PYTHONPYCACHEPREFIX in the run's temporary directory), filled by one untimed start of each.

Runs alternate: `python -c pass`, then one daemon start, `RUNS` times; the figure reports the
median and p90 of each and their ratio. Not a test: nothing here is pass/fail.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUNS = 11
POLL_S = 0.005
READY_TIMEOUT_S = 60.0
AREAS = 3


def _config(root: Path, *, areas: int) -> tuple[Path, int]:
    from monitord.testing.ports import free_port
    from monitord.testing.stack import to_toml

    root.mkdir(parents=True)
    spool = root / "spool"
    spool.mkdir()
    key_file = root / "id_ed25519"
    key_file.write_text("")  # never read: the VPS port refuses before any key exchange
    key_file.chmod(0o600)
    known_hosts = root / "known_hosts"
    known_hosts.write_text("")
    port = free_port()
    document: dict[str, dict[str, Any]] = {
        "monitord": {"work_dir": root / "work", "spool_dir": spool, "owner_label": "bench",
                     "log_format": "json"},
        "http": {"listen": f"127.0.0.1:{port}", "drain_timeout_s": 1.0},
        "remote": {
            "host": "127.0.0.1", "port": free_port(), "user": "offload", "key_file": key_file,
            "known_hosts": known_hosts, "remote_bin_dir": str(root / "vps"),
            "connect_timeout_s": 2.0,
            "reverse_forwards": [{"name": "nats", "listen": f"127.0.0.1:{free_port()}",
                                  "target": f"127.0.0.1:{free_port()}"}],
        },
        "services.tg": {
            "command": ["/bin/sleep", "3600"],
            "local_data_dir": f"{root}/pbx/tg/{{area}}",
            "remote_data_dir": "{remote_bin_dir}/data/tg/{area}",
        },
    }
    entries = [{"uuid": f"00000000-0000-4000-8000-{i:012d}", "service": "tg",
                "location": "local", "generation": 1} for i in range(areas)]
    (spool / "custom_config.json").write_text(json.dumps({"custom_daemons": entries}))
    path = root / "monitord.toml"
    path.write_text(to_toml(document))
    return path, port


def _ready(port: int) -> bool:
    """One GET /readyz over a plain socket: True on 200."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(f"GET /readyz HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            return sock.recv(16).split(b" ")[1:2] == [b"200"]
    except (OSError, IndexError):
        return False


def _environment(tmp: Path) -> dict[str, str]:
    """Ours with a bytecode cache of the run's own (see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    return env


def _start_to_ready(root: Path, *, areas: int, env: dict[str, str]) -> float:
    from monitord.testing.stack import kill_processes_under

    config_path, port = _config(root, areas=areas)
    with (root / "stderr").open("wb") as stderr:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "monitord", "run", "-c", str(config_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, env=env,
        )
        try:
            while not _ready(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"monitord run exited with {proc.returncode}: "
                                       f"{(root / 'stderr').read_text()[-500:]}")
                if time.perf_counter() - started > READY_TIMEOUT_S:
                    raise TimeoutError(f"no /readyz 200 within {READY_TIMEOUT_S} s")
                time.sleep(POLL_S)  # the poll interval, part of the figure's resolution
            return time.perf_counter() - started
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            # The supervisor leaves local daemons running for the next instance to adopt.
            kill_processes_under(root)


def _bare_python(env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True, env=env)
    return time.perf_counter() - started


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def measure(tmp: Path, *, runs: int = RUNS, areas: int = AREAS) -> list[dict[str, Any]]:
    """`runs` starts of `monitord run` to /readyz 200, alternating with `python -c pass`."""
    env = _environment(tmp)
    _bare_python(env)  # untimed: fill the bytecode cache
    _start_to_ready(tmp / "warm-up", areas=areas, env=env)
    starts: list[float] = []
    bare: list[float] = []
    for i in range(runs):
        bare.append(_bare_python(env))
        starts.append(_start_to_ready(tmp / f"run-{i}", areas=areas, env=env))
    median = statistics.median(starts)
    reference = statistics.median(bare)
    return [{
        "benchmark": "startup_readyz",
        "runs": runs,
        "areas": areas,
        "setup": f"{areas} local areas, [remote] with the VPS refusing connections,"
                 " a fresh work_dir each run",
        "median_ms": round(median * 1000, 1),
        "p90_ms": round(_p90(starts) * 1000, 1),
        "reference": "python -c pass, same interpreter, alternating with the starts",
        "bytecode": "cached (one untimed start first), as installed",
        "reference_median_ms": round(reference * 1000, 1),
        "reference_p90_ms": round(_p90(bare) * 1000, 1),
        "ratio": round(median / reference, 2),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }]


def run() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        return measure(Path(tmp))
