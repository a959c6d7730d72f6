"""Verbs end quietly: no traceback, no asyncio warning, no leaked task or session at exit.

The demo is the check for the shutdown path as a whole. It ends by stopping `monitord run`
while remote areas keep connections open through the tunnel's reverse forward, which is
exactly when a disconnect that does not first close its channels makes the VPS side answer
into a dead socket (asyncio's `socket.send() raised exception.`, a dozen at the end of
`make demo`). How many show depends on timing, so `TestTunnelShutdown` makes it certain: six
remote areas, six open channels, and the in-process VPS's own log is read.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

from tests.integration.operator.conftest import StackFactory

NOISE = (
    "socket.send() raised exception",
    "Traceback",
    "Task was destroyed",
    "Unclosed",
    "Exception ignored",
)


def noise_in(*outputs: str) -> list[str]:
    return [line for text in outputs for line in text.splitlines()
            if any(marker in line for marker in NOISE)]


class TestDemoEndsQuietly:
    """`monitord demo` passes and its output holds no warning, traceback or leak report."""

    def test_the_demo_output_has_no_shutdown_noise(self, tmp_path: Path) -> None:
        result = subprocess.run(
            [sys.executable, "-m", "monitord", "demo", "--dir", str(tmp_path / "demo")],
            capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "VERDICT: PASS" in result.stdout
        assert noise_in(result.stdout, result.stderr) == []

    def test_ctrl_c_during_the_demo_is_one_line_and_exit_130(self, tmp_path: Path) -> None:
        demo = subprocess.Popen(
            [sys.executable, "-m", "monitord", "demo", "--dir", str(tmp_path / "demo")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            # A shell gives a foreground command the default SIGINT disposition; so do we.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert demo.stdout is not None
        seen = []
        for line in demo.stdout:
            seen.append(line)
            if "step 1:" in line:
                demo.send_signal(signal.SIGINT)
                break
        out, err = demo.communicate(timeout=120)
        assert demo.returncode == 130, "".join(seen) + out + err
        assert err.splitlines()[-1] == "monitord: interrupted"
        assert noise_in("".join(seen), out, err) == []


class TestTunnelShutdown:
    """Stopping monitord closes every tunnel channel before the disconnect: the VPS side never
    writes into a closed connection."""

    async def test_stopping_with_remote_areas_open_leaves_the_vps_side_quiet(
        self, stack_factory: StackFactory, caplog: pytest.LogCaptureFixture
    ) -> None:
        stack = await stack_factory(services={"tg": 6})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=120)
        assert stack.vps is not None
        vps = stack.vps
        caplog.set_level(logging.WARNING, logger="asyncio")
        assert await stack.stop_monitord() == 0
        await stack.wait_until(lambda: vps.connection_count == 0, timeout_s=10,
                               what="the VPS side saw the tunnel go")
        written_after_close = [
            r.getMessage() for r in caplog.records if "socket.send()" in r.getMessage()
        ]
        assert written_after_close == []


    # The in-process VPS's asyncssh server can leave the socket of a connection it accepted
    # unclosed when its channel open crossed the disconnect (a leak of the test's SSH server,
    # collected at teardown), so that one warning is not this test's subject.
    @pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
    async def test_clients_reconnecting_through_the_forward_leave_no_channel_to_the_disconnect(
        self, stack_factory: StackFactory
    ) -> None:
        """Daemons on the VPS whose forwarded connection closes connect again at once; each
        new connection is a new channel, opened after the ones being closed. The forward is
        cancelled first (the VPS confirms it), so every channel is closed and acknowledged
        before the disconnect, none left for its burst. One client holds its connection
        open throughout: its channel is certainly there when the stop comes, and must be
        among those closed."""
        # (a generous keepalive: four busy client threads in this process slow the
        # in-process VPS's answers, and a tunnel that drops before the stop proves nothing)
        stack = await stack_factory(services={"tg": 2},
                                    remote_overrides={"keepalive_count_max": 20})
        await stack.wait_settled(expect={"tg": "local"}, timeout_s=60)
        await stack.place("tg", "remote")
        await stack.wait_settled(expect={"tg": "remote"}, timeout_s=120)
        [nats] = tomllib.loads(stack.config_path.read_text())["remote"]["reverse_forwards"]
        host, port = nats["listen"].rsplit(":", 1)
        stop = threading.Event()
        connected = [0]
        held: dict[str, float] = {}

        def reconnecting() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError), \
                        socket.create_connection((host, int(port)), timeout=1) as conn:
                    connected[0] += 1
                    conn.settimeout(0.05)
                    with contextlib.suppress(OSError):
                        conn.recv(1)

        def holding() -> None:
            with socket.create_connection((host, int(port)), timeout=1) as conn:
                held["at"] = time.monotonic()
                conn.settimeout(60)
                with contextlib.suppress(OSError):
                    while conn.recv(4096):
                        pass
                held["ended"] = time.monotonic()

        threads = [threading.Thread(target=reconnecting, daemon=True) for _ in range(4)]
        threads.append(threading.Thread(target=holding, daemon=True))
        for thread in threads:
            thread.start()
        try:
            await stack.wait_until(lambda: connected[0] > 50 and "at" in held, timeout_s=30,
                                   what="clients connecting through the reverse forward")
            stopping_at = time.monotonic()
            assert "ended" not in held, stack.events("tunnel_error")
            assert await stack.stop_monitord() == 0
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=5)
        # the held connection lasted until the stop: its channel was open when it came
        assert held.get("ended", 0) >= stopping_at, (held, stack.events("tunnel_error"))
        [closing] = stack.events("tunnel_channels_closed")
        assert closing["left"] == 0, closing
        assert closing["closed"] >= 1


class TestVerbsWithoutADaemon:
    """`monitord status` with no daemon: one readable line with the code, exit 1."""

    def test_status_without_a_daemon_is_one_line(self, tmp_path: Path) -> None:
        from monitord.testing.ports import free_port

        config = tmp_path / "monitord.toml"
        config.write_text(
            f'[monitord]\nwork_dir = "{tmp_path}/work"\nspool_dir = "{tmp_path}/spool"\n'
            f'[http]\nlisten = "127.0.0.1:{free_port()}"\n'
        )
        result = subprocess.run(
            [sys.executable, "-m", "monitord", "status", "-c", str(config)],
            capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 1
        assert result.stdout == ""
        [line] = result.stderr.splitlines()
        assert line.startswith("monitord: DAEMON_UNREACHABLE: monitord is not answering at ")
