"""The diagnostic bundle: one .tar.gz a support engineer can read without access.

Called by the HTTP handler `GET /v1/diagnostics/bundle`. The caller collects the sections
(remote_state.json, inventories, tunnel lease, transactions, cleanup queue, recent events,
configuration); this module redacts secrets and packs them. Redaction is by key name *and*
by content: a member that still looks like key material is replaced, so a private key can
not leave through the bundle even if a caller hands one in by mistake.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
_SECRET_KEY = re.compile(r"(secret|password|passphrase|token|private|bearer)", re.IGNORECASE)
_KEY_MATERIAL = re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----|PuTTY-User-Key-File")


def redact(value: Any) -> Any:
    """A copy of a JSON-like value with secret-looking keys' values replaced."""
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if _SECRET_KEY.search(str(k)) else redact(v)) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


def contains_key_material(data: bytes) -> bool:
    return _KEY_MATERIAL.search(data) is not None


def _member_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return json.dumps(redact(value), indent=2, sort_keys=True, default=str).encode()


def build(sections: Mapping[str, Any], *, now: float | None = None) -> bytes:
    """Pack `name -> value` (bytes, str or JSON-able) into a .tar.gz under `monitord-bundle/`."""
    mtime = time.time() if now is None else now
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, value in sections.items():
            data = _member_bytes(value)
            if contains_key_material(data):
                data = f"{REDACTED}: this section looked like private key material\n".encode()
            info = tarfile.TarInfo(f"monitord-bundle/{name}")
            info.size, info.mtime, info.mode = len(data), int(mtime), 0o600
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
