"""Test doubles real enough to ship, used by the tests and by `monitord demo`, never by
production code: the in-process SSH "VPS" (vps_server), a fake messenger daemon
(`python -m monitord.testing.fake_daemon`) and the split-brain detector it reports to
(split_brain).
"""
