"""Idle RSS figure: resident memory of a real `monitord run` with 1 k areas in
custom_config.json, against the same installation with 0 areas, measured in the same run.

Which 1 k areas: all committed REMOTE, with a `[remote]` section whose VPS refuses every
connection (a closed loopback port). 1 k areas committed local would make the supervisor start
1 k daemon processes: the figure would then measure their start-up storm and the machine, not
monitord. Remote-committed areas with the VPS down is a real idle state (the VPS is away);
monitord still loads, indexes and serves every area (placement state, the status document
of 1 k areas, desired placement, metrics) while the tunnel keeper backs off; nothing runs
locally. The price of one supervised local area is the daemon's own process, not monitord's.

Procedure per size: write monitord.toml + custom_config.json, start `monitord run`, wait for
/readyz 200, read GET /v1/status until it counts every area remote (this also makes
monitord build the 1 k-area status document once), then sample VmRSS of the monitord process
(and of any child it started) `SAMPLES` times, `SAMPLE_EVERY_S` apart, and report the last
sample and the peak. Not a test: nothing here is pass/fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

AREAS = 1_000
SAMPLES = 8
SAMPLE_EVERY_S = 0.25
STATUS_READS = 5


def _config(root: Path, *, areas: int) -> Path:
    import asyncssh

    from monitord.testing.ports import free_port
    from monitord.testing.stack import to_toml

    root.mkdir(parents=True)
    key = asyncssh.generate_private_key("ssh-ed25519")
    key_file = root / "id_ed25519"
    key.write_private_key(str(key_file))
    key_file.chmod(0o600)
    known_hosts = root / "known_hosts"
    known_hosts.write_text("")
    spool = root / "spool"
    spool.mkdir()
    closed = free_port()
    document: dict[str, dict[str, Any]] = {
        "monitord": {"work_dir": root / "work", "spool_dir": spool, "owner_label": "bench",
                     "log_format": "json"},
        "http": {"listen": f"127.0.0.1:{free_port()}", "drain_timeout_s": 1.0},
        "remote": {
            "host": "127.0.0.1", "port": closed, "user": "offload", "key_file": key_file,
            "known_hosts": known_hosts, "remote_bin_dir": str(root / "vps"),
            "connect_timeout_s": 2.0, "reconnect_backoff_base_s": 0.5,
            "reconnect_backoff_cap_s": 5.0,
            "reverse_forwards": [{"name": "nats", "listen": f"127.0.0.1:{free_port()}",
                                  "target": f"127.0.0.1:{free_port()}"}],
        },
        "services.tg": {
            "command": ["/bin/sleep", "3600"],
            "local_data_dir": f"{root}/pbx/tg/{{area}}",
            "remote_data_dir": "{remote_bin_dir}/data/tg/{area}",
        },
    }
    entries = [{"uuid": str(uuid.uuid4()), "service": "tg", "location": "remote",
                "generation": 1, "phone": f"+7900{i:07d}"} for i in range(areas)]
    (spool / "custom_config.json").write_text(json.dumps({"custom_daemons": entries}))
    path = root / "monitord.toml"
    path.write_text(to_toml(document))
    return path


def _rss_kib(pid: int) -> int:
    """VmRSS of `pid` plus that of its descendants, in KiB."""
    total = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                children = (task / "children").read_text().split()
                pending.extend(int(child) for child in children)
    return total


async def _status(port: int, path: str) -> tuple[int, Any]:
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session, \
                session.get(f"http://127.0.0.1:{port}{path}") as resp:
            text = await resp.text()
            return resp.status, json.loads(text) if text.startswith("{") else text
    except (aiohttp.ClientError, OSError, TimeoutError):
        return 0, None


async def _until(predicate: Any, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s} s")
        await asyncio.sleep(0.05)  # poll interval of a deadline loop


async def _idle_rss(root: Path, *, areas: int) -> dict[str, int]:
    from monitord.base.config import load
    from monitord.base.hostport import split_hostport
    from monitord.testing.stack import kill_processes_under

    config_path = _config(root, areas=areas)
    _, port = split_hostport(load(config_path).http.listen)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "monitord", "run", "-c", str(config_path),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async def ready() -> bool:
            if proc.returncode is not None:
                raise RuntimeError(f"monitord run exited with {proc.returncode}")
            return (await _status(port, "/readyz"))[0] == 200

        async def counted() -> bool:
            code, body = await _status(port, "/v1/status")
            return code == 200 and body["counts"]["remote"] == areas

        await _until(ready, timeout_s=60, what="readiness")
        await _until(counted, timeout_s=30, what=f"status counting {areas} remote areas")
        for _ in range(STATUS_READS):
            await _status(port, "/v1/status")
        samples = []
        for _ in range(SAMPLES):
            samples.append(_rss_kib(proc.pid))
            await asyncio.sleep(SAMPLE_EVERY_S)  # sampling period, not a wait for a condition
        return {"rss_kib": samples[-1], "peak_rss_kib": max(samples)}
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await asyncio.to_thread(kill_processes_under, root)


async def measure(tmp: Path, *, areas: int = AREAS) -> list[dict[str, Any]]:
    """Idle RSS with `areas` remote-committed areas against 0 areas, same configuration."""
    reference = await _idle_rss(tmp / "empty", areas=0)
    loaded = await _idle_rss(tmp / "loaded", areas=areas)
    return [{
        "benchmark": "idle_rss",
        "areas": areas,
        "areas_committed": "remote (VPS refusing connections; nothing runs locally)",
        "rss_mib": round(loaded["rss_kib"] / 1024, 1),
        "peak_rss_mib": round(loaded["peak_rss_kib"] / 1024, 1),
        "reference": "same monitord run with 0 areas",
        "reference_rss_mib": round(reference["rss_kib"] / 1024, 1),
        "ratio": round(loaded["rss_kib"] / reference["rss_kib"], 3),
        "kib_per_area": round((loaded["rss_kib"] - reference["rss_kib"]) / areas, 2),
        "pid_note": f"monitord run and its children, sampled {SAMPLES}x every {SAMPLE_EVERY_S}s",
    }]


def run() -> list[dict[str, Any]]:
    if not os.path.isdir("/proc/self"):
        from benchmarks.__main__ import BenchmarkUnavailable

        raise BenchmarkUnavailable("needs /proc to read VmRSS")
    with tempfile.TemporaryDirectory(prefix="bench-rss-") as tmp:
        return asyncio.run(measure(Path(tmp)))
