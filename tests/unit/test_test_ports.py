"""free_port() (monitord/testing/ports.py): ports for servers started later, safe to use from
parallel test workers."""

from __future__ import annotations

import socket

import pytest

from monitord.testing import ports


def test_each_worker_has_its_own_block_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocks = []
    for worker in ("", "gw0", "gw1", "gw2", "gw3"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        blocks.append(set(ports.block_range()))
    for i, block in enumerate(blocks):
        assert max(block) < ports.ephemeral_low()
        assert all(block.isdisjoint(other) for other in blocks[i + 1:])
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert ports.free_port() in blocks[2]


def test_a_port_comes_back_only_after_the_whole_block() -> None:
    block = ports.block_range()
    handed = [ports.free_port() for _ in range(50)]
    assert len(set(handed)) == 50 and set(handed) <= set(block)


def test_a_bound_port_is_passed_over() -> None:
    first = ports.free_port()
    block = ports.block_range()
    following = block[(block.index(first) + 1) % len(block)]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", following))
        squatter.listen()
        # The counter is shared with every other process on the block, so the next port
        # handed out is at most "following", and never it while it is bound.
        assert ports.free_port() != following
