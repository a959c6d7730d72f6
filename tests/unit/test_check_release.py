"""`monitord check --remote` names the VPS's OpenSSH and Python and says when either lies
outside the tested releases (monitord/surface/check_command.py, pure parts)."""

from __future__ import annotations

import pytest

from monitord.surface.check_command import describe_ssh_server, release_warnings

DEBIAN_13 = "SSH-2.0-OpenSSH_10.0p2 Debian-7+deb13u4"


class TestReleaseWarnings:
    """Every tested release passes silently; anything older, newer or not OpenSSH is named."""

    @pytest.mark.parametrize(("server", "python"), [
        ("SSH-2.0-OpenSSH_8.4p1 Debian-5+deb11u3", (3, 9, 2)),
        ("SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u10", (3, 11, 2)),
        (DEBIAN_13, (3, 13, 5)),
        ("SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13.5", (3, 12, 3)),
        ("SSH-2.0-OpenSSH_10.2", (3, 13, 9)),
    ])
    def test_a_tested_or_in_between_release_has_no_warning(
        self, server: str, python: tuple[int, ...]
    ) -> None:
        assert release_warnings(server, python) == []

    def test_an_older_openssh_is_outside_what_is_supported(self) -> None:
        (warning,) = release_warnings("SSH-2.0-OpenSSH_7.4", (3, 11, 2))
        assert warning.startswith("OpenSSH 7.4 on the VPS is older than any supported release")
        assert "OpenSSH 8.4 to 10.0" in warning and "docs/vps-setup.md" in warning

    def test_a_server_that_is_not_openssh_is_named_with_what_it_costs(self) -> None:
        (warning,) = release_warnings("SSH-2.0-dropbear_2022.83", (3, 11, 2))
        assert "'dropbear_2022.83', not OpenSSH" in warning and "never fenced" in warning

    def test_an_older_python_and_a_newer_openssh_are_both_named(self) -> None:
        warnings = release_warnings("SSH-2.0-OpenSSH_11.0", (3, 8, 10))
        assert [w.split(" on the VPS")[0] for w in warnings] == ["OpenSSH 11.0", "Python 3.8.10"]
        assert "newer than any tested" in warnings[0]
        assert "older than supported" in warnings[1] and "agent cannot run" in warnings[1]

    def test_an_unprobed_python_adds_nothing(self) -> None:
        assert release_warnings(DEBIAN_13, None) == []


def test_the_server_is_described_by_its_identification_string() -> None:
    assert describe_ssh_server(DEBIAN_13) == "OpenSSH_10.0p2 Debian-7+deb13u4"
    assert describe_ssh_server("") == "an SSH server that sent no version"
