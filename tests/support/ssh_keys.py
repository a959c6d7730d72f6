"""SSH keys generated at test run time (no key ever lives in the repository).

Used by tests/support/sshd.py and by every test that needs a client key, a host key or a
known_hosts file. `private_key_fragments()` gives the text a leak scan looks for.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

import asyncssh


@dataclass(frozen=True)
class KeyPair:
    """A private key file on disk and its OpenSSH public line."""

    private_path: Path
    public_line: str  # "ssh-ed25519 AAAA... comment"

    def private_key_fragments(self) -> list[str]:
        """Substrings that would betray the private key if they appeared in logs or output."""
        return private_key_fragments(self.private_path)


def generate(path: Path, *, comment: str = "monitord-test") -> KeyPair:
    """Write a fresh ed25519 private key (OpenSSH format, mode 0600) to `path`."""
    key = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
    path.parent.mkdir(parents=True, exist_ok=True)
    key.write_private_key(str(path))
    path.chmod(0o600)
    public_line = key.export_public_key("openssh").decode().strip()
    path.with_name(path.name + ".pub").write_text(public_line + "\n")
    return KeyPair(private_path=path, public_line=public_line)


def known_hosts_line(*, host: str, port: int, host_public_line: str) -> str:
    """One known_hosts entry for host:port ([host]:port when the port is not 22)."""
    name = host if port == 22 else f"[{host}]:{port}"
    algo, blob = host_public_line.split()[:2]
    return f"{name} {algo} {blob}\n"


def private_key_fragments(path: Path) -> list[str]:
    """The body lines of the PEM/OpenSSH private key and the raw secret bytes as base64/hex.

    A leak scan checks captured text for any of these; the public part is excluded because
    the public key may legitimately appear (known_hosts, fingerprints)."""
    text = path.read_text()
    body = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.startswith("-----")
    ]
    fragments = [line for line in body if len(line) >= 16]
    key = asyncssh.read_private_key(str(path))
    secret = key.export_private_key("openssh")
    fragments.append(base64.b64encode(secret).decode()[:40])
    fragments.append(text.strip())
    return fragments
