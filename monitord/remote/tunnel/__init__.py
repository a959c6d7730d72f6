"""The SSH tunnel to the VPS (docs/design.md, "Tunnel and forwards").

- keeper.py        the "tunnel keeper" root task: one asyncssh connection, backoff, status
- standby.py       a second, idle connection logged in to take over when that one dies
- ssh_connect.py   opens that connection, through jump hosts (proxy_jump, ssh_config) if any
- lease_client.py  runs the VPS-side verb `monitord tunnel-lease` (monitord/vps/tunnel_lease.py)
                   over SSH exec and parses its JSON
- forwards.py      reverse/local forwards, denied-forward diagnosis, end-to-end proofs
- port_holder.py   who holds a port on the VPS (`ss`), and fencing a stale sshd session
- goodbye.py       closing a connection: every channel acknowledged before the disconnect
- backoff.py       exponential backoff with full jitter and a per-minute attempt cap

Decisions live in orchestrator/tunnel_lease.py and orchestrator/forward_diagnosis.py; SSH
exceptions are translated in monitord/remote/ssh_errors.py.
"""
