"""COPY phase I/O: one area's data dir moved between the PBX and the VPS, verified
(monitord.remote.copy.transfer)."""

from monitord.remote.copy.transfer import (
    DIGESTS_SUFFIX,
    STAGING_SUFFIX,
    CopyAgent,
    CopyReport,
    Staged,
    download,
    pre_download,
    pre_upload,
    remove_remote_leftovers,
    upload,
)

__all__ = [
    "DIGESTS_SUFFIX",
    "STAGING_SUFFIX",
    "CopyAgent",
    "CopyReport",
    "Staged",
    "download",
    "pre_download",
    "pre_upload",
    "remove_remote_leftovers",
    "upload",
]
