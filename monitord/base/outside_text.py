"""Text from outside monitord made safe to keep, log and show: the one sanitising edge.

A VPS may be broken or compromised, and what it sends as text (an agent's error detail or
result, a field of a tunnel-lease answer, a remote command's stderr, an SSH server's
reason) can hold what no downstream part expects:

- a lone surrogate (`"\\udc80"` is valid JSON and decodes to one): a `str` that cannot be
  encoded as UTF-8, so state.db's write of the record that carries it raises, and the move
  whose failure it describes is never recorded, rolled back or parked;
- a control character (ESC, CSI, BEL, a carriage return): a terminal that shows it obeys
  it — clears the screen, retitles the window, rewrites the line it is on.

`clean()` makes such text safe where it enters monitord, so nothing past that point sees it
as sent: each such code point becomes U+FFFD, one for one (a reader sees something was
there), newline and tab are kept, and the result is at most `limit` code points, the bound
the caller already kept. Called by the adapters that read what the VPS sends:
monitord.remote.agent_client (an error's detail, a result), monitord.remote.tunnel.lease_client
(every string of an answer), monitord.remote.remote_exec (the stderr tail),
monitord.remote.ssh_errors (a server's reason), monitord.remote.preflight and
monitord.remote.provisioning (their reports), monitord.remote.tunnel.port_holder (`ss`'s
process names) and monitord.surface.check_command (the Python probe).

`encodable()` is the narrower rule for a writer of text it did not make, as a defence in
depth behind `clean()`: only lone surrogates become U+FFFD, so that the record is written
whole rather than not at all (monitord.store.state_db, monitord.store.spool_files for
remote_state.json).
"""

from __future__ import annotations

import re

REPLACEMENT = "\ufffd"

# C0 controls but tab and newline, DEL, the C1 controls (U+009B is CSI to many terminals),
# and the surrogates, which UTF-8 cannot encode (a JSON escape can still name one alone).
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean(text: str, *, limit: int, tail: bool = False) -> str:
    """`text` safe to store, log and show: its first `limit` code points (its last with
    `tail`), each control character but newline and tab and each lone surrogate U+FFFD."""
    if limit <= 0:
        return ""
    kept = text[-limit:] if tail else text[:limit]
    return _UNSAFE.sub(REPLACEMENT, kept)


def encodable(text: str) -> str:
    """`text` with each lone surrogate U+FFFD: what UTF-8 cannot encode, and nothing else."""
    return _SURROGATE.sub(REPLACEMENT, text)
