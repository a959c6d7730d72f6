"""Round trips to the VPS that a piece of work waited for one after another.

Over a WAN an area's downtime is mostly round trips, so each move counts those made while the
area is down (`area_downtime`'s `round_trips`). The count is of *waves*: a request sent while
another of the same work is still unanswered rides the same wave (a pipelined batch, a
gather of several files) and adds nothing; one sent after the last answer came starts a new
wave. A request whose own making takes several exchanges in turn (a new channel, then the
request on it) says how many.

The work to count is chosen by context (`counted_by`): every request awaited inside, in the
same task or one started inside, counts for it, and requests of other work (lease renewals,
another area's move) do not. The points that talk to the VPS mark their exchanges with
`exchange`: the agent client (monitord/remote/agent_client.py) and the SFTP sessions of the
copies (monitord/remote/copy/sftp_session.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator


class RoundTrips:
    """The waves of one piece of work (see the module doc)."""

    def __init__(self) -> None:
        self.count = 0
        self._in_flight = 0

    def begin(self, trips: int = 1) -> None:
        if self._in_flight == 0:
            self.count += trips
        self._in_flight += 1

    def end(self) -> None:
        self._in_flight -= 1


_current: contextvars.ContextVar[RoundTrips | None] = contextvars.ContextVar(
    "monitord_round_trips", default=None
)


@contextlib.contextmanager
def counted_by(trips: RoundTrips | None) -> Iterator[None]:
    """Count the exchanges made inside for `trips` (None: for nothing)."""
    token = _current.set(trips)
    try:
        yield
    finally:
        _current.reset(token)


@contextlib.contextmanager
def exchange(trips: int = 1) -> Iterator[None]:
    """Around one request awaited from the VPS (`trips`: the exchanges its making takes)."""
    counter = _current.get()
    if counter is None:
        yield
        return
    counter.begin(trips)
    try:
        yield
    finally:
        counter.end()
