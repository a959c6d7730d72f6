"""monitord's tunnel keeper against autossh, side by side, on the same real OpenSSH sshd
(loopback, needs root, `/usr/sbin/sshd` and `autossh`; docs/benchmarks.md).

Every subject reaches the sshd through its own fault-injecting TCP proxy
(tests/support/tcp_proxy.py) and keeps one reverse forward to the same echo server; the
sshd runs with OpenSSH's default `ClientAliveInterval 0`. monitord is a real `TunnelKeeper`
(lease, port-holder diagnosis and fencing through `monitord tunnel-lease` on the VPS);
autossh is run the way people run it (`AUTOSSH_COMMAND` below).

- `autossh_vs_monitord_session_kill` (one figure per monitord reconnect pacing): the VPS
  kills the subject's sshd session; the clock stops when a round trip through the reverse
  forward works again. The subjects take turns, run after run. `ratio` = monitord / autossh.
- `autossh_vs_monitord_stale_session_monitord` (per pacing): the link is black-holed, so
  sshd keeps the old session and its listening port; monitord's recovery time and
  connection attempts. `ratio` = recovery / autossh's own dead-link detection in this run
  (same keepalive settings): what recovering costs on top of noticing.
- `autossh_vs_monitord_stale_session_autossh` (per AUTOSSH_POLL): the same fault for
  autossh; its connection attempts and "remote port forwarding failed" exits within the
  window, and whether a round trip ever worked again. `ratio` = its attempts / monitord's.
Not a test: never pass/fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.bench_tunnel_recovery import (
    _echo,
    _round_trip_once,
    _until_round_trip,
    vps_pyz_command,
)

if TYPE_CHECKING:
    from monitord.remote.tunnel.keeper import TunnelKeeper
    from tests.support.sshd import Sshd
    from tests.support.tcp_proxy import TcpProxy

RUNS = 5  # kills per subject; autossh restarts at once only up to 5 times in a row
STALE_RUNS = 3
STORM_WINDOW_S = 30.0
# ServerAliveInterval is whole seconds; monitord's keepalive is set to the same values.
KEEPALIVE_S = 1
KEEPALIVE_COUNT = 2
AUTOSSH_POLLS = (30, 600)  # a common "come back quickly" value, and autossh's default
KILL_POLL = 30
FORWARD_FAILED = "remote port forwarding failed"
# Reconnect pacing of the keeper: the benchmark's fast one (as bench_tunnel_recovery.py)
# and the shipped defaults of reconnect_backoff_base_s / _cap_s. The per-minute cap is
# raised in both so that the repeated runs here never wait for it (one outage never does).
PACINGS: dict[str, dict[str, float]] = {
    "bench": {"reconnect_backoff_base_s": 0.05, "reconnect_backoff_cap_s": 0.5},
    "shipped": {"reconnect_backoff_base_s": 1.0, "reconnect_backoff_cap_s": 30.0},
}
# The command as documented (docs/benchmarks.md); {…} are filled in per instance.
AUTOSSH_ENV = {"AUTOSSH_GATETIME": "0", "AUTOSSH_POLL": "{poll}"}
AUTOSSH_COMMAND = (
    "autossh", "-M", "0", "-N", "-F", "/dev/null",
    "-o", f"ServerAliveInterval={KEEPALIVE_S}", "-o", f"ServerAliveCountMax={KEEPALIVE_COUNT}",
    "-o", "ExitOnForwardFailure=yes",
    "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-i", "{key}",
    "-o", "UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
    "-o", "ConnectTimeout=5", "-p", "{port}",
    "-R", "127.0.0.1:{listen}:127.0.0.1:{target}", "root@127.0.0.1",
)
# The key exchange asyncssh (monitord) negotiates with OpenSSH 9.2, for a like-for-like
# figure: OpenSSH's own client prefers the slower sntrup761x25519-sha512 hybrid.
SAME_KEX = ("-o", "KexAlgorithms=curve25519-sha256")


@dataclass
class _Autossh:
    """One running autossh and where its output goes."""

    label: str
    proxy: TcpProxy
    listen_port: int
    process: asyncio.subprocess.Process
    output_path: Path  # ssh's and autossh's stderr

    def forward_failures(self) -> int:
        return self.output_path.read_text(errors="replace").count(FORWARD_FAILED)


@dataclass
class _Keeper:
    """One monitord tunnel keeper, its proxy, and when its state changed (perf_counter)."""

    pacing: str
    proxy: TcpProxy
    listen_port: int
    keeper: TunnelKeeper
    changes: list[tuple[float, str]] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)  # one per session kill

    def phases_since(self, started: float, round_trip_at: float) -> dict[str, float]:
        """Where a recovery went: noticing the drop, waiting before the attempt (backoff),
        and the attempt itself (connect, VPS helper start, lease, forward) until the round
        trip worked."""
        later = [(at, state) for at, state in self.changes if at >= started]
        lost = next(at for at, state in later if state != "connected")
        attempt = next(at for at, state in later if state == "connecting" and at >= lost)
        return {"detect_s": lost - started, "before_attempt_s": attempt - lost,
                "attempt_s": round_trip_at - attempt}


@contextlib.asynccontextmanager
async def _running_autossh(
    tmp: Path, sshd: Sshd, proxy: TcpProxy, *, label: str, target_port: int, poll: int,
    extra: tuple[str, ...] = (),
) -> AsyncIterator[_Autossh]:
    from monitord.testing.ports import free_port

    listen = free_port()
    fill = {"key": str(sshd.client_key.private_path),
            "known_hosts": str(sshd.known_hosts_for_port(proxy.port)),
            "port": str(proxy.port), "listen": str(listen), "target": str(target_port)}
    argv = [part.format(**fill) for part in AUTOSSH_COMMAND]
    argv[1:1] = extra  # ssh options go anywhere before the destination
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOSSH_")}
    env |= {k: v.format(poll=poll) for k, v in AUTOSSH_ENV.items()}
    env["AUTOSSH_LOGFILE"] = str(tmp / f"autossh-{label}.log")  # not syslog
    output_path = tmp / f"autossh-{label}.err"
    with output_path.open("wb") as output:
        process = await asyncio.create_subprocess_exec(
            *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=output,
        )
    try:
        yield _Autossh(label=label, proxy=proxy, listen_port=listen, process=process,
                       output_path=output_path)
    finally:
        if process.returncode is None:
            process.terminate()  # autossh passes SIGTERM on to its ssh and exits
        try:
            await asyncio.wait_for(process.wait(), 5)
        except TimeoutError:
            process.kill()
            await process.wait()


@contextlib.asynccontextmanager
async def _running_keeper(
    tmp: Path, sshd: Sshd, proxy: TcpProxy, *, pacing: str, target_port: int
) -> AsyncIterator[_Keeper]:
    from monitord.base.config import ForwardSpec, RemoteSection
    from monitord.remote.tunnel.keeper import TunnelKeeper
    from monitord.testing.ports import free_port

    remote_dir = tmp / f"remote-{pacing}"  # one tunnel lease per keeper
    remote_dir.mkdir()
    listen = free_port()
    config = RemoteSection.model_validate({
        "host": "127.0.0.1", "port": proxy.port, "user": "root",
        "key_file": sshd.client_key.private_path,
        "known_hosts": sshd.known_hosts_for_port(proxy.port),
        "remote_bin_dir": str(remote_dir),
        # the tunnel-lease helper as a VPS runs it: the pyz, system python3, -I
        "remote_monitord": vps_pyz_command(remote_dir),
        "keepalive_interval_s": KEEPALIVE_S, "keepalive_count_max": KEEPALIVE_COUNT,
        **PACINGS[pacing], "reconnect_max_per_minute": 60, "tunnel_lease_ttl_s": 5.0,
        "reverse_forwards": (ForwardSpec(name="nats", listen=f"127.0.0.1:{listen}",
                                         target=f"127.0.0.1:{target_port}"),),
        "local_forwards": (),
    })
    keeper = TunnelKeeper(config, owner_id=f"bench-{pacing}", owner_label=f"bench-{pacing}")
    subject = _Keeper(pacing=pacing, proxy=proxy, listen_port=listen, keeper=keeper)
    keeper.add_listener(
        lambda status: subject.changes.append((time.perf_counter(), status.state.value))
    )
    task = asyncio.create_task(keeper.run(), name=f"tunnel keeper (bench {pacing})")
    try:
        yield subject
    finally:
        await keeper.close()
        await asyncio.wait_for(task, 15)


def _kill_autossh_session(sshd: Sshd, subject: _Autossh) -> None:
    """Kill the sshd session(s) serving this autossh's ssh, as the VPS would."""
    pids = {sshd.session_pid_for_client_port(port) for port in subject.proxy.upstream_ports()}
    pids.discard(None)
    if not pids:
        raise RuntimeError(f"no sshd session found for autossh {subject.label}")
    for pid in pids:
        assert pid is not None
        sshd.kill_session(pid)


async def _time_kill(sshd: Sshd, subject: _Keeper | _Autossh) -> float:
    """Kill the subject's session; seconds until a round trip works again (settled after)."""
    if isinstance(subject, _Keeper):
        lease = subject.keeper.status().lease
        assert lease is not None and lease.session is not None
        started = time.perf_counter()
        sshd.kill_session(lease.session.sshd_pid)
        await subject.keeper.wait_for(lambda s: not s.connected, timeout_s=10)
        await _until_round_trip(subject.listen_port, timeout_s=30)
        round_trip_at = time.perf_counter()
        await subject.keeper.wait_connected(timeout_s=30)
        subject.phases.append(subject.phases_since(started, round_trip_at))
        return round_trip_at - started
    started = time.perf_counter()
    _kill_autossh_session(sshd, subject)
    await _until_round_trip(subject.listen_port, timeout_s=30)
    return time.perf_counter() - started


async def _stale_monitord(subject: _Keeper) -> dict[str, float]:
    keeper = subject.keeper
    before = keeper.status()
    started = time.perf_counter()
    subject.proxy.blackhole()  # new connections pass: only the old session goes stale
    await keeper.wait_for(lambda s: not s.connected, timeout_s=30)
    detected = time.perf_counter() - started
    await _until_round_trip(subject.listen_port, timeout_s=60)
    recovered = time.perf_counter() - started
    after = await keeper.wait_connected(timeout_s=30)
    return {"recovered_s": recovered, "detected_s": detected,
            "attempts": after.attempts - before.attempts,
            "fenced": after.fenced_sessions - before.fenced_sessions}


async def _stale_autossh(subject: _Autossh, *, window_s: float) -> dict[str, Any]:
    """Black-hole the link and watch for window_s: attempts, failures, any recovery."""
    accepted_before = subject.proxy.accepted
    failures_before = subject.forward_failures()
    started = time.perf_counter()
    subject.proxy.blackhole()
    first_retry_s: float | None = None
    recovered_s: float | None = None
    while (elapsed := time.perf_counter() - started) < window_s:
        if first_retry_s is None and subject.proxy.accepted > accepted_before:
            first_retry_s = elapsed
        # A round trip through the stale listener times out (0.5 s): nothing answers.
        if first_retry_s is not None and recovered_s is None and await _round_trip_once(
            subject.listen_port
        ):
            recovered_s = time.perf_counter() - started
        await asyncio.sleep(0.005)  # poll interval of the observation window
    return {"attempts": subject.proxy.accepted - accepted_before,
            "forward_failures": subject.forward_failures() - failures_before,
            "first_retry_s": first_retry_s, "recovered_s": recovered_s,
            "still_running": subject.process.returncode is None}


async def _references(
    tmp: Path, sshd: Sshd, proxy: TcpProxy, *, echo_port: int, runs: int
) -> dict[str, float]:
    """Medians of what a reconnect is made of, on fresh asyncssh connections: connect + auth,
    connect + forward + first round trip (bench_tunnel_recovery's floor), an exec of
    /bin/true (the VPS user's shell start-up) and the VPS helper `monitord tunnel-lease
    serve` until ready (the same plus the VPS-side monitord start)."""
    import asyncssh

    from monitord.remote import remote_exec
    from monitord.remote.tunnel import ssh_connect
    from monitord.remote.tunnel.lease_client import LeaseClient
    from monitord.testing.ports import free_port

    known_hosts = sshd.known_hosts_for_port(proxy.port)
    remote_dir = tmp / "remote-references"
    remote_dir.mkdir()
    helper = LeaseClient(prefix=(sys.executable, "-m", "monitord"), remote_dir=str(remote_dir),
                         owner_id="references", owner_label="references", ttl_s=5.0)
    samples: dict[str, list[float]] = {"connect_s": [], "floor_s": [], "shell_start_s": [],
                                       "helper_ready_s": []}
    for _ in range(runs):
        port = free_port()
        started = time.perf_counter()
        conn = await asyncssh.connect(
            "127.0.0.1", proxy.port, username="root",
            client_keys=[str(sshd.client_key.private_path)], known_hosts=str(known_hosts),
            agent_path=None, config=[], encryption_algs=ssh_connect.cipher_preference(),
        )
        samples["connect_s"].append(time.perf_counter() - started)
        try:
            await conn.forward_remote_port("127.0.0.1", port, "127.0.0.1", echo_port)
            await _until_round_trip(port, timeout_s=5)
            samples["floor_s"].append(time.perf_counter() - started)
            started = time.perf_counter()
            await remote_exec.run(conn, ["/bin/true"], timeout_s=10)
            samples["shell_start_s"].append(time.perf_counter() - started)
            started = time.perf_counter()
            session = await helper.open_session(conn)
            samples["helper_ready_s"].append(time.perf_counter() - started)
            session.close()
        finally:
            conn.close()
            await conn.wait_closed()
    return {name: statistics.median(values) for name, values in samples.items()}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


async def measure(
    tmp: Path, *, runs: int = RUNS, stale_runs: int = STALE_RUNS,
    window_s: float = STORM_WINDOW_S, pacings: tuple[str, ...] = tuple(PACINGS),
    polls: tuple[int, ...] = AUTOSSH_POLLS,
) -> list[dict[str, Any]]:
    from tests.support.sshd import running_sshd
    from tests.support.tcp_proxy import running_proxy

    if runs > 5:
        raise ValueError("autossh backs off after 5 quick restarts: at most 5 runs")
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    echo_port = int(echo.sockets[0].getsockname()[1])
    try:
        async with contextlib.AsyncExitStack() as stack:
            sshd = await stack.enter_async_context(running_sshd(tmp / "sshd"))

            async def proxy() -> TcpProxy:
                return await stack.enter_async_context(running_proxy("127.0.0.1", sshd.port))

            # The stale-session autossh instances start first: by the time of their fault
            # they have been up a while, like a tunnel in the field.
            stale_autossh = [
                await stack.enter_async_context(_running_autossh(
                    tmp, sshd, await proxy(), label=f"stale-poll{poll}",
                    target_port=echo_port, poll=poll))
                for poll in polls
            ]
            references = await _references(tmp, sshd, await proxy(), echo_port=echo_port,
                                           runs=runs)
            keepers = [
                await stack.enter_async_context(_running_keeper(
                    tmp, sshd, await proxy(), pacing=pacing, target_port=echo_port))
                for pacing in pacings
            ]
            kill_autossh = [
                await stack.enter_async_context(_running_autossh(
                    tmp, sshd, await proxy(), label=label, target_port=echo_port,
                    poll=KILL_POLL, extra=extra))
                for label, extra in (("default-kex", ()), ("same-kex", SAME_KEX))
            ]
            for k in keepers:
                await k.keeper.wait_connected(timeout_s=30)
            for a in [*kill_autossh, *stale_autossh]:
                await _until_round_trip(a.listen_port, timeout_s=30)

            subjects: list[_Keeper | _Autossh] = [*keepers, *kill_autossh]
            kills: dict[int, list[float]] = {id(s): [] for s in subjects}
            for run in range(runs):
                for subject in subjects[run % len(subjects):] + subjects[:run % len(subjects)]:
                    kills[id(subject)].append(await _time_kill(sshd, subject))
                    await asyncio.sleep(0.2)  # let the machine settle between subjects
            stale_monitord = {k.pacing: [await _stale_monitord(k) for _ in range(stale_runs)]
                              for k in keepers}
            storms = await asyncio.gather(
                *(_stale_autossh(a, window_s=window_s) for a in stale_autossh)
            )
    finally:
        echo.close()
        await echo.wait_closed()
    return _figures(
        references=references, kills=kills, keepers=keepers, kill_autossh=kill_autossh,
        stale_monitord=stale_monitord, storms=list(storms),
        polls=polls, window_s=window_s,
    )


def _figures(
    *, references: dict[str, float], kills: dict[int, list[float]], keepers: list[_Keeper],
    kill_autossh: list[_Autossh], stale_monitord: dict[str, list[dict[str, float]]],
    storms: list[dict[str, Any]], polls: tuple[int, ...],
    window_s: float,
) -> list[dict[str, Any]]:
    autossh_s = statistics.median(kills[id(kill_autossh[0])])
    same_kex_s = statistics.median(kills[id(kill_autossh[1])])
    detections = [s["first_retry_s"] for s in storms if s["first_retry_s"] is not None]
    detect_s = statistics.median(detections) if detections else float("nan")
    figures: list[dict[str, Any]] = []
    for k in keepers:
        value_s = statistics.median(kills[id(k)])
        figures.append({
            "benchmark": "autossh_vs_monitord_session_kill", "pacing": k.pacing,
            **PACINGS[k.pacing], "runs": len(kills[id(k)]),
            "value_ms": _ms(value_s), "values_ms": [_ms(v) for v in kills[id(k)]],
            "reference": "autossh", "reference_ms": _ms(autossh_s),
            "reference_values_ms": [_ms(v) for v in kills[id(kill_autossh[0])]],
            "ratio": round(value_s / autossh_s, 2),
            "autossh_same_kex_ms": _ms(same_kex_s),
            "ratio_to_autossh_same_kex": round(value_s / same_kex_s, 2),
            "monitord_phases_ms": {
                name.removesuffix("_s"): _ms(statistics.median(p[name] for p in k.phases))
                for name in ("detect_s", "before_attempt_s", "attempt_s")
            },
            **{f"{name.removesuffix('_s')}_ms": _ms(value)
               for name, value in references.items()},
        })
    monitord_attempts: list[float] = []
    for k in keepers:
        runs = stale_monitord[k.pacing]
        value_s = statistics.median(r["recovered_s"] for r in runs)
        monitord_attempts += [r["attempts"] for r in runs]
        figures.append({
            "benchmark": "autossh_vs_monitord_stale_session_monitord", "pacing": k.pacing,
            **PACINGS[k.pacing], "runs": len(runs),
            "keepalive_interval_s": KEEPALIVE_S, "keepalive_count_max": KEEPALIVE_COUNT,
            "value_ms": _ms(value_s), "values_ms": [_ms(r["recovered_s"]) for r in runs],
            "detected_ms": [_ms(r["detected_s"]) for r in runs],
            "attempts": [int(r["attempts"]) for r in runs],
            "fenced_sessions": [int(r["fenced"]) for r in runs],
            "reference": "autossh_dead_link_detection", "reference_ms": _ms(detect_s),
            "ratio": round(value_s / detect_s, 2),
        })
    reference_attempts = statistics.median(monitord_attempts)
    for poll, storm in zip(polls, storms, strict=True):
        figures.append({
            "benchmark": "autossh_vs_monitord_stale_session_autossh", "autossh_poll": poll,
            "window_s": window_s, "attempts": storm["attempts"],
            "forward_failures": storm["forward_failures"],
            "first_retry_ms": _ms(storm["first_retry_s"]) if storm["first_retry_s"] else None,
            "recovered": storm["recovered_s"] is not None,
            "recovered_ms": _ms(storm["recovered_s"]) if storm["recovered_s"] else None,
            "reference": "monitord_attempts_until_recovered",
            "reference_attempts": reference_attempts,
            "ratio": round(storm["attempts"] / reference_attempts, 2),
            "gave_up": not storm["still_running"],
        })
    return figures


def run() -> list[dict[str, Any]]:
    from benchmarks.__main__ import BenchmarkUnavailable

    if os.geteuid() != 0 or not os.path.exists("/usr/sbin/sshd"):
        raise BenchmarkUnavailable("needs root and /usr/sbin/sshd")
    if shutil.which("autossh") is None:
        raise BenchmarkUnavailable(
            "autossh is not installed, so the autossh comparison figures are skipped"
            " (install it: apt-get install -y autossh)"
        )
    with tempfile.TemporaryDirectory(prefix="bench-autossh-") as tmp:
        return asyncio.run(measure(Path(tmp)))
