"""What a move's preflight knows of memory: the VPS's (monitord/vps/host_memory.py, what the
agent's GET /v1/host answers) and the area's daemon's on the PBX
(proc_identity.resident_bytes) — both read from this machine's own /proc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from monitord.base import proc_identity
from monitord.vps import host_memory


def test_the_machines_memory_as_proc_meminfo_says_it() -> None:
    found = host_memory.read()
    total, available = found["mem_total_bytes"], found["mem_available_bytes"]
    assert total is not None and available is not None
    assert 0 < available <= total
    assert total % 1024 == 0


def test_a_kernel_that_does_not_say_memavailable(tmp_path: Path) -> None:
    """Before Linux 3.14 there is no MemAvailable: it is unknown, not 0 (0 would refuse
    every move); a line that is not `NAME: N kB` is not read."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        1000 kB\nMemFree:  500 kB\nMemAvailable: ² kB\n")
    assert host_memory.read(meminfo) == {"mem_total_bytes": 1024000,
                                         "mem_available_bytes": None}


def test_a_proc_that_cannot_be_read_says_nothing(tmp_path: Path) -> None:
    assert host_memory.read(tmp_path / "absent") == {"mem_total_bytes": None,
                                                     "mem_available_bytes": None}


def test_a_process_resident_memory_grows_with_what_it_touches() -> None:
    """64 MiB written by the process is counted; a process that is gone is None."""
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; x = b'\\x01' * (64 << 20); print(flush=True);"
         " sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    ) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"\n"
            identity = proc_identity.read(child.pid)
            assert identity is not None
            resident = proc_identity.resident_bytes(identity)
            assert resident is not None and resident >= 64 << 20
            mine = proc_identity.read(os.getpid())
            assert mine is not None and (proc_identity.resident_bytes(mine) or 0) > 0
        finally:
            child.kill()
    assert proc_identity.resident_bytes(identity) is None
