"""The forwards of one tunnel connection: request them, diagnose a denial, prove them.

Called by monitord/remote/tunnel/keeper.py once per connection, after the tunnel lease is held:
- `open()` requests every reverse forward (VPS listen -> PBX target) and every local forward
  (PBX listen -> VPS target). A denied reverse forward (`ssh_errors.is_forward_denied`) is
  never retried blindly: port_holder.py finds the holder on the VPS and
  orchestrator/forward_diagnosis.py decides — fence our own stale session and retry at once,
  wait for a session going silent, or raise TUNNEL_LEASE_CONFLICT / PORT_OCCUPIED.
- `prove()` shows each forward works end to end. For a reverse forward the VPS helper
  (`monitord tunnel-lease serve`) binds a socket and reports its source port, then connects
  to the forwarded port and sends a random nonce; our listener recognises that source port
  and answers the nonce. A stale listener of another session still accepts TCP, but it can
  never answer, so only a round trip through THIS connection proves the forward. Normal
  connections are piped to the target untouched (server-first protocols such as NATS work).
  A local forward (none by default; the agent needs none) is proven by opening a channel to
  its VPS target; a target that is not listening yet leaves the forward `target_down`
  without failing the tunnel.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any

import asyncssh
from asyncssh.forward import SSHForwarder

from monitord.base.config import ForwardSpec
from monitord.base.hostport import split_hostport
from monitord.remote import ssh_errors
from monitord.remote.tunnel import port_holder
from monitord.remote.tunnel.lease_client import LeaseSession
from orchestrator import forward_diagnosis
from orchestrator.errors import ErrorCode, TransientError, error_for
from orchestrator.forward_diagnosis import Verdict
from orchestrator.tunnel_lease import PROBE_PREFIX, PROBE_REPLY, LeaseRecord

# A probe line is the prefix and a 32-digit nonce; anything longer without a newline is
# not a probe and is never buffered further.
_MAX_PROBE_LINE = 256

MAX_DIAGNOSES = 5  # per forward and connection: then FORWARD_DENIED and a reconnect


@dataclass(frozen=True)
class ForwardStatus:
    """One forward as the status API shows it."""

    name: str
    direction: str  # "reverse" (VPS listen -> PBX target) or "local" (PBX listen -> VPS)
    listen: str
    target: str
    state: str  # pending | proven | target_down
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "direction": self.direction, "listen": self.listen,
                "target": self.target, "state": self.state, "detail": self.detail}


@dataclass(frozen=True)
class Fenced:
    """A stale sshd session we terminated on the VPS to free a forward's port."""

    port: int
    pid: int
    detail: str


@dataclass(eq=False)
class _PendingProbe:
    nonce: bytes
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class _ProbeSession(asyncssh.SSHTCPSession[bytes]):
    """Answers one forward probe: nonce in, PROBE_REPLY + nonce out."""

    def __init__(self, probe: _PendingProbe) -> None:
        self._probe = probe
        self._buffer = b""
        self._chan: asyncssh.SSHTCPChannel[bytes] | None = None

    def connection_made(self, chan: asyncssh.SSHTCPChannel[bytes]) -> None:
        self._chan = chan

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        self._buffer += data
        if b"\n" not in self._buffer and len(self._buffer) > _MAX_PROBE_LINE:
            if self._chan is not None:  # not a probe: whoever it is gets nothing buffered
                self._chan.close()
            self._buffer = b""
            return
        if b"\n" not in self._buffer or self._chan is None:
            return
        line = self._buffer.split(b"\n", 1)[0]
        if line == PROBE_PREFIX + self._probe.nonce:
            self._probe.arrived.set()
            self._chan.write(PROBE_REPLY + self._probe.nonce + b"\n")
        else:
            self._chan.close()


class ForwardSet:
    """Every configured forward over one connection."""

    def __init__(
        self,
        conn: asyncssh.SSHClientConnection,
        *,
        reverse: tuple[ForwardSpec, ...],
        local: tuple[ForwardSpec, ...],
        helper: LeaseSession,
        our_sshd_pid: int | None,
        lease_context: LeaseRecord | None,
        vps_now: float,
        keepalive_interval_s: float,
        stale_after_s: float,
        conflict_retry_s: float,
        timeout_s: float,
        log: Any,
    ) -> None:
        self._conn = conn
        self._reverse = reverse
        self._local = local
        self._helper = helper
        self._our_sshd_pid = our_sshd_pid
        self._lease_context = lease_context
        self._vps_now = vps_now
        self._keepalive_s = keepalive_interval_s
        self._stale_after_s = stale_after_s
        self._conflict_retry_s = conflict_retry_s
        self._timeout_s = timeout_s
        self._log = log
        self._listeners: list[asyncssh.SSHListener] = []
        self._probes: dict[int, _PendingProbe] = {}
        self._status: dict[str, ForwardStatus] = {
            spec.name: ForwardStatus(spec.name, "reverse", spec.listen, spec.target, "pending")
            for spec in reverse
        } | {
            spec.name: ForwardStatus(spec.name, "local", spec.listen, spec.target, "pending")
            for spec in local
        }
        self.fenced: list[Fenced] = []

    def statuses(self) -> tuple[ForwardStatus, ...]:
        return tuple(self._status.values())

    def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()

    async def cancel(self) -> None:
        """Close every listener and wait for the VPS to confirm each cancel-tcpip-forward:
        SSH keeps order, so once it has, no channel for them is still on its way here."""
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener.close()
        await asyncio.gather(*(listener.wait_closed() for listener in listeners),
                             return_exceptions=True)

    # -- requesting ----------------------------------------------------------------------
    async def open(self) -> None:
        for spec in self._reverse:
            await self._open_reverse(spec)
        for spec in self._local:
            await self._open_local(spec)

    async def _open_reverse(self, spec: ForwardSpec) -> None:
        host, port = split_hostport(spec.listen)
        target_host, target_port = split_hostport(spec.target)

        def session_factory(_orig_host: str, orig_port: int) -> Any:
            probe = self._probes.get(orig_port)
            if probe is not None:
                return _ProbeSession(probe)
            return self._to_target(target_host, target_port)

        for _ in range(MAX_DIAGNOSES):
            try:
                async with asyncio.timeout(self._timeout_s):
                    listener = await self._conn.create_server(session_factory, host, port)
            except ssh_errors.SSH_ERRORS as e:
                if not ssh_errors.is_forward_denied(e):
                    raise ssh_errors.translate(
                        e, code=ErrorCode.SSH_UNREACHABLE,
                        during=f"forward {spec.name}: tcpip-forward",
                    ) from e
                await self._diagnose_denial(spec, port)
                continue
            self._listeners.append(listener)
            return
        raise TransientError(
            ErrorCode.FORWARD_DENIED,
            f"reverse forward {spec.name} ({spec.listen}) still denied after"
            f" {MAX_DIAGNOSES} diagnoses",
        )

    async def _to_target(self, host: str, port: int) -> SSHForwarder:
        """The session piping one forwarded connection to its PBX target.

        asyncssh drops, without closing it, a session whose SSH connection closed while the
        target's connect was under way: the target would keep a connection nobody reads.
        So one that comes too late is closed here; asyncssh then refuses the channel."""
        session = await self._conn.forward_connection(host, port)
        if self._conn.is_closed():
            session.close()
        return session

    async def _diagnose_denial(self, spec: ForwardSpec, port: int) -> None:
        observation = await port_holder.observe(self._conn, port, timeout_s=self._timeout_s)
        diagnosis = forward_diagnosis.diagnose(
            observation.holder,
            our_owner_id=self._helper.owner_id,
            our_sshd_pid=self._our_sshd_pid,
            lease=self._lease_context,
            now=self._vps_now,
            keepalive_interval_s=self._keepalive_s,
            stale_after_s=self._stale_after_s,
            conflict_retry_s=self._conflict_retry_s,
        )
        self._log.info(
            "forward_denied_diagnosed", forward=spec.name, port=port,
            verdict=diagnosis.verdict.value, detail=diagnosis.detail,
            holder_pid=observation.holder.pid, error_code=diagnosis.code,
        )
        if diagnosis.verdict is Verdict.RETRY_NOW:
            return
        if diagnosis.verdict is Verdict.WAIT_STALE:
            # Protocol wait: the holder must stay silent past keepalive x count before it
            # may be fenced; bounded by that threshold.
            await asyncio.sleep(min(diagnosis.retry_after_s, self._stale_after_s))
            return
        if diagnosis.verdict is Verdict.FENCE:
            pid = diagnosis.fence_pid
            if pid is None or observation.start_ticks is None:
                raise TransientError(ErrorCode.FORWARD_DENIED, diagnosis.detail)
            gone = await self._helper.fence(pid=pid, start_ticks=observation.start_ticks)
            self._log.warning("stale_session_fenced", forward=spec.name, port=port, pid=pid,
                              gone=gone, detail=diagnosis.detail)
            if not gone:
                raise TransientError(ErrorCode.FORWARD_DENIED,
                                     f"could not fence sshd pid {pid}: {diagnosis.detail}")
            self.fenced.append(Fenced(port=port, pid=pid, detail=diagnosis.detail))
            return
        raise error_for(diagnosis.code or ErrorCode.FORWARD_DENIED, diagnosis.detail,
                        delay=diagnosis.retry_after_s)

    async def _open_local(self, spec: ForwardSpec) -> None:
        host, port = split_hostport(spec.listen)
        target_host, target_port = split_hostport(spec.target)
        try:
            listener = await self._conn.forward_local_port(host, port, target_host, target_port)
        except OSError as e:  # binding spec.listen on this machine
            raise ssh_errors.translate_local_listen(
                e, during=f"local forward {spec.name} ({spec.listen})",
                delay=self._conflict_retry_s,
            ) from e
        self._listeners.append(listener)

    # -- proving -------------------------------------------------------------------------
    async def prove(self) -> tuple[ForwardStatus, ...]:
        """Prove every forward; raises FORWARD_UNPROVEN if a reverse forward fails."""
        await asyncio.gather(*(self._prove_reverse(spec) for spec in self._reverse))
        for spec in self._local:
            await self._prove_local(spec)
        return self.statuses()

    async def _prove_reverse(self, spec: ForwardSpec) -> None:
        host, port = split_hostport(spec.listen)
        probe = _PendingProbe(nonce=secrets.token_hex(16).encode())
        source_port = await self._helper.probe_bind(host=host)
        self._probes[source_port] = probe
        try:
            answer = await self._helper.probe_connect(
                source_port=source_port, host=host, port=port, nonce=probe.nonce.decode(),
                timeout_s=self._timeout_s,
            )
            if answer.ok:
                async with asyncio.timeout(self._timeout_s):
                    await probe.arrived.wait()
        except TimeoutError as e:
            raise self._unproven(spec, "the nonce never reached this connection") from e
        finally:
            self._probes.pop(source_port, None)
        if not answer.ok:
            raise self._unproven(spec, answer.detail or "probe failed")
        self._status[spec.name] = ForwardStatus(
            spec.name, "reverse", spec.listen, spec.target, "proven",
            f"round trip {answer.rtt_ms:.1f} ms",
        )

    def _unproven(self, spec: ForwardSpec, why: str) -> TransientError:
        return TransientError(
            ErrorCode.FORWARD_UNPROVEN, f"reverse forward {spec.name} ({spec.listen}): {why}"
        )

    async def _prove_local(self, spec: ForwardSpec) -> None:
        target_host, target_port = split_hostport(spec.target)
        try:
            async with asyncio.timeout(self._timeout_s):
                _, writer = await self._conn.open_connection(target_host, target_port)
            writer.close()
        except ssh_errors.SSH_ERRORS as e:
            refusal = ssh_errors.channel_refusal(e)
            if refusal is None:
                raise ssh_errors.translate(
                    e, code=ErrorCode.SSH_UNREACHABLE,
                    during=f"local forward {spec.name}: channel open",
                ) from e
            self._status[spec.name] = ForwardStatus(
                spec.name, "local", spec.listen, spec.target, "target_down",
                f"nothing accepts {spec.target} on the VPS: {refusal}",
            )
            return
        self._status[spec.name] = ForwardStatus(
            spec.name, "local", spec.listen, spec.target, "proven", "target accepts"
        )
