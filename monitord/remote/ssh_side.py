"""The modules that speak SSH — asyncssh (with cryptography) and ours built on it — and
their loading off the event loop.

They are most of what a bare import of monitord costs, and `monitord run` does not need
them to become ready: readiness (docs/lifecycle.md) is the store, recovery, the supervisor
and the root tasks started, never a connected tunnel. So the modules the daemon imports
before `/readyz` turns 200 — the engine, the wiring, the tunnel keeper's front (its status,
listeners and hooks), the agent client — import these only for type checking or inside the
functions that run on a live connection. The tunnel keeper's first step is `await load()`,
which imports them in a worker thread, so the loop keeps answering the API meanwhile; every
connection comes after it, and the function-level imports then find the modules loaded.
Without `[remote]` nothing loads them. A test holds the daemon's side of this
(tests/integration/test_startup_imports.py).
"""

from __future__ import annotations

import asyncio
import importlib

# asyncssh first: it is the bulk; ours in the order they build on each other.
MODULES = (
    "asyncssh",
    "monitord.remote.ssh_errors",
    "monitord.remote.remote_exec",
    "monitord.remote.tunnel.ssh_connect",
    "monitord.remote.tunnel.forwards",
    "monitord.remote.tunnel.port_holder",
    "monitord.remote.provisioning",
    "monitord.remote.preflight",
    "monitord.remote.copy",
)


async def load() -> None:
    """Import MODULES in a worker thread (a no-op once they are loaded)."""
    await asyncio.to_thread(_import_all)


def _import_all() -> None:
    for name in MODULES:
        importlib.import_module(name)
