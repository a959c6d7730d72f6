"""The remote agent that runs on the VPS (`monitord agent`).

It serves the manager API the local owner calls through the tunnel, keeps the area lease
table, runs each remote daemon under a lease guard that fences it when its lease lapses,
and caches its entries in `spool/custom_config.json` without ever trusting that cache to
start anything. See docs/agent.md.
"""
