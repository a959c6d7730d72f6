"""docs/vps-setup.md shows the sshd lines and the key options the fault tier's real sshd runs
with: one file (config/sshd_config.monitord, a `Match User` block for monitord's login),
included verbatim, read by tests/faults."""

from __future__ import annotations

import re
from pathlib import Path

from tests.faults import netns_vps
from tests.support import sshd

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "vps-setup.md"
SSHD_LINES = ROOT / "config" / "sshd_config.monitord"


def fenced_blocks(text: str, info: str) -> list[str]:
    """The bodies of the ```INFO blocks of a Markdown text."""
    return re.findall(rf"^```{re.escape(info)}\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def keywords(text: str) -> list[str]:
    return [line.split()[0].lower() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


class TestTheDocumentedSshdConfig:
    """The doc's sshd block is the file the fault tier uses, for its login only."""

    def test_the_doc_includes_the_file_verbatim(self) -> None:
        blocks = fenced_blocks(DOC.read_text(), "sshd_config")
        assert blocks == [SSHD_LINES.read_text()]

    def test_the_fault_tier_reads_that_file(self) -> None:
        assert netns_vps.DOCUMENTED_SSHD_CONFIG.resolve() == SSHD_LINES

    def test_the_fault_tier_config_ends_with_it_for_its_login_after_forwarding_off_for_all(
        self, tmp_path: Path
    ) -> None:
        text = netns_vps.documented_sshd_config(sshd.config_text(
            port=22, listen="10.231.0.2", host_key=tmp_path / "host_key",
            authorized=tmp_path / "authorized_keys", pid_file=tmp_path / "sshd.pid",
        ), user="root")
        documented = SSHD_LINES.read_text()
        global_part, match_part = text.split("Match User root\n")
        assert match_part == documented.split(f"Match User {netns_vps.DOCUMENTED_USER}\n")[1]
        assert global_part.endswith(documented.split("Match User")[0])
        found = keywords(global_part)
        assert len(found) == len(set(found)), found
        assert {"port", "hostkey", "authorizedkeysfile", "subsystem"} <= set(found)
        assert "AllowTcpForwarding no" in global_part.splitlines()
        assert "AllowStreamLocalForwarding no" in global_part.splitlines()
        assert "match" not in found

    def test_the_documented_block_is_one_match_for_the_login_user(self) -> None:
        found = keywords(SSHD_LINES.read_text())
        assert found[0] == "match" and found.count("match") == 1
        assert f"Match User {netns_vps.DOCUMENTED_USER}\n" in SSHD_LINES.read_text()
        assert {"allowtcpforwarding", "allowstreamlocalforwarding"} <= set(found)

    def test_the_doc_authorizes_the_key_as_the_fault_tier_does(self) -> None:
        line = next(line for line in DOC.read_text().splitlines()
                    if line.startswith("echo '") and " ssh-ed25519 " in line)
        assert line.startswith(f"echo '{netns_vps.AUTHORIZED_KEY_OPTIONS},")
