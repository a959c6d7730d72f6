"""The CLI prints only catalogue codes: an error answer that is not monitord's error document
(something else answers on the port) is DAEMON_UNREACHABLE, and a failure the status records
without a code is said so, never given a made-up one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from monitord.surface import client_commands
from monitord.surface.client_commands import ApiError, Client
from orchestrator import errors


class _Proxy(BaseHTTPRequestHandler):
    """A web server that is not monitord: 502 with an HTML page, or JSON of another shape."""

    def do_GET(self) -> None:
        body = b'{"message": "no"}' if self.path == "/json" else b"<html>Bad Gateway</html>"
        self.send_response(502)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def proxy() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


class TestAnAnswerThatIsNotMonitords:
    @pytest.mark.parametrize("path", ["/html", "/json"])
    def test_is_daemon_unreachable(self, proxy: str, path: str) -> None:
        with pytest.raises(ApiError) as raised:
            Client(proxy).request("GET", path)
        assert raised.value.code == "DAEMON_UNREACHABLE" and raised.value.status == 502
        assert "HTTP 502" in raised.value.detail
        errors.lookup(raised.value.code)


class TestAFailureWithoutACode:
    def test_a_parked_area_without_a_recorded_error_prints_no_code(self) -> None:
        area = "5b1d0c7a-2f3e-4a5b-8c9d-0e1f2a3b4c5d"
        status = {
            "services": {"tg": {"areas": [{"uuid": area, "phase": "PARKED",
                                           "location": "local"}]}},
            "transactions": [{"area": area}],
        }
        outcome, line = client_commands.area_progress(
            status, service="tg", area=area, location="remote"
        )
        assert outcome == "failed"
        assert line == "tg/5b1d0c7a -> remote: failed: no error recorded"

    def test_a_recorded_error_is_printed_with_its_code(self) -> None:
        area = "5b1d0c7a-2f3e-4a5b-8c9d-0e1f2a3b4c5d"
        status = {
            "services": {"tg": {"areas": [{"uuid": area, "phase": "PARKED",
                                           "location": "local"}]}},
            "transactions": [{"area": area, "last_error_code": "PREFLIGHT_ARCH",
                              "last_error_detail": "aarch64"}],
        }
        _, line = client_commands.area_progress(status, service="tg", area=area,
                                                location="remote")
        assert line == "tg/5b1d0c7a -> remote: failed: PREFLIGHT_ARCH aarch64"
