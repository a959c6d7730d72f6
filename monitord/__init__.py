"""monitord: the single owner of the PBX-to-VPS tunnel and of every area's placement.

The runtime (I/O) half of the project; decisions live in the pure `orchestrator` package.
"""

__version__ = "0.2.0"
