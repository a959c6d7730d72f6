"""The API token for tests that build the HTTP app in-process around test doubles.

    ctx = http_api.ApiContext(..., api_token=api_auth.TOKEN)
    client = TestClient(TestServer(http_api.build_app(ctx)), headers=api_auth.HEADERS)

`HEADERS` is what an authorised operator's client sends (`Authorization: Bearer ...`); a test
of the refusals themselves sends none, or `WRONG_HEADERS`. Tests against a real daemon read
the token its start wrote instead (daemon_process.ApiClient, Stack.request).
"""

from __future__ import annotations

from pathlib import Path

from monitord.surface.api_token import ApiToken

VALUE = "t" * 20 + "-test-api-token-" + "k" * 7  # 43 characters, the shape of a real one
TOKEN = ApiToken(VALUE.encode("ascii"), Path("/var/lib/monitord/api-token"), "monitord")
HEADERS = {"Authorization": f"Bearer {VALUE}"}
WRONG_HEADERS = {"Authorization": f"Bearer {VALUE[:-1]}x"}
