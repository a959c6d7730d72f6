"""COPY phase I/O: one area's data dir moved between the PBX and the VPS, verified.

The facade the migration engine calls (monitord.engine.phase_actions): `pre_upload` /
`upload` (PBX -> VPS) and `pre_download` / `download` (VPS -> PBX), a pre-copy's `Staged`
handed from the first to the second. Inside, by what each module holds:

- `transfer`   the protocol of both directions over SFTP (pre-copy and final copy);
- `vps_tree`   the VPS's data and staging dirs: the agent's routes (`AreaCopy`), or a
               shell and the `tree-digest` verb on an agent without them, chosen once
               per copy from what the agent says it serves;
- `local_tree` the PBX's data and staging dirs: fd-safe writes, fsyncs, the swap;
- `listing`    the VPS's listing of a tree, parsed and validated as untrusted input.
"""

from monitord.remote.copy.transfer import (
    CopyReport,
    Progress,
    Staged,
    download,
    pre_download,
    pre_upload,
    remove_remote_leftovers,
    upload,
)
from monitord.remote.copy.vps_tree import AreaCopy, CopyAgent

__all__ = [
    "AreaCopy",
    "CopyAgent",
    "CopyReport",
    "Progress",
    "Staged",
    "download",
    "pre_download",
    "pre_upload",
    "remove_remote_leftovers",
    "upload",
]
