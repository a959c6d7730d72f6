"""The SSH tunnel to the VPS (SPEC §6.2–6.3).

- keeper.py        the "tunnel keeper" root task: one asyncssh connection, backoff, status
- lease_command.py the VPS-side verb `monitord tunnel-lease` (lease file under a flock)
- lease_client.py  runs that verb over SSH exec and parses its JSON
- forwards.py      reverse/local forwards, denied-forward diagnosis, end-to-end proofs
- port_holder.py   who holds a port on the VPS (`ss`), and fencing a stale sshd session
- backoff.py       exponential backoff with full jitter and a per-minute attempt cap

Decisions live in orchestrator/tunnel_lease.py and orchestrator/forward_diagnosis.py.
"""
