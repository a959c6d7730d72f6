"""What this process's copies cost, per direction: the input of the pre-copy rule.

`CopyTimings` keeps one `orchestrator.pre_copy.CopyCosts` per direction (by the side the
data leaves: a PBX's upload and download often run at very different rates) and feeds it
from every copy the phase actions run (monitord.engine.phase_actions): a pre-copy gives a
throughput sample and a fixed-cost sample (its wall time less its sending), a copy after
the stop a throughput sample. `decide()` asks the pure rule with the configured
`remote.pre_copy` and `remote.pre_copy_min_bytes`.

In memory only, and bounded (the last `pre_copy.WINDOW` samples of each): the timings
describe the link as it is now, so after a restart the configured threshold decides
again until the first copies have been timed (docs/design.md, "Pre-copy").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from monitord.base.config import RemoteSection
from orchestrator import pre_copy
from orchestrator.models import Side

if TYPE_CHECKING:  # the SSH side loads after readiness (monitord/remote/ssh_side.py)
    from monitord.remote.copy import CopyReport, Staged


class CopyTimings:
    def __init__(self) -> None:
        self._costs: dict[Side, pre_copy.CopyCosts] = {}

    def costs(self, source: Side) -> pre_copy.CopyCosts:
        """What copies from `source` to the other side were seen to cost."""
        return self._costs.get(source, pre_copy.CopyCosts())

    def pre_copied(self, source: Side, staged: Staged, *, wall_s: float) -> None:
        """A pre-copy from `source` took `wall_s` in all."""
        self._costs[source] = (
            self.costs(source)
            .with_copy(sent_bytes=staged.sent_bytes, send_s=staged.send_s)
            .with_pre_copy(wall_s=wall_s, send_s=staged.send_s)
        )

    def copied(self, source: Side, report: CopyReport) -> None:
        """A copy after the stop from `source`."""
        self._costs[source] = self.costs(source).with_copy(sent_bytes=report.sent_bytes,
                                                           send_s=report.send_s)

    def decide(self, source: Side, *, size: int | None,
               remote: RemoteSection) -> pre_copy.Decision:
        """Whether a move from `source` pre-copies an area of `size` bytes (None: unknown)."""
        return pre_copy.decide(size=size, rule=pre_copy.Rule(remote.pre_copy),
                               min_bytes=remote.pre_copy_min_bytes, costs=self.costs(source))
