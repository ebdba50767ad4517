"""One hub as a replica of a team on a shared PostgreSQL store: its identity and heartbeat, the
other replicas it sees, where each job's channel is (``directory``: a turn whose session's
channel another replica holds reaches it through that replica, ``RemoteChannel``), and the
notifications (``LISTEN``) that keep this replica's job board, runners, models and sessions in
step with what the others change.

Every decision two replicas could race for is one conditional statement in the store (a claim,
a job's end, a withdrawal, a session's job, a dead replica's cleanup); this replica's memory is
a cache of the store, read again on every notification that concerns it and wholly after the
listening connection comes back (notifications may have been missed meanwhile).

A replica whose heartbeat is ``EXPIRY`` s old is dead to the others: one of them ends what it
left (its channels' rows, its turns in flight in the limits, its suspended requests) and
withdraws the jobs it made that no session points at. A replica found unreachable sooner (a
forwarded turn could not connect) counts as down until its next heartbeat: its channels are
awaited elsewhere (their runners redial through the load balancer) and no session moves."""

from __future__ import annotations

import logging
import pathlib
import secrets
import socket
import ssl
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
import trio

from gateway import __version__
from gateway.config import parse_team_secrets
from gateway.hub.board import JobBoard
from gateway.hub.catalog import Catalog
from gateway.hub.channel import CLOSE_REPLACED, Channels, ServerChannel, Sink
from gateway.hub.replicas.boardsync import BoardSync, apply, presence_of, seen_remote
from gateway.hub.replicas.limits import ReplicaLimits
from gateway.hub.replicas.relay import HolderRelay
from gateway.hub.replicas.remote import Peer, RemoteChannel
from gateway.hub.replicas.store.base import (
    CHANNEL,
    JOB,
    MODELS,
    PRESENCE,
    REPLICA,
    SESSION,
    ChannelRow,
    Note,
    ReplicaRow,
    ReplicaStore,
)
from gateway.hub.sessions import Sessions
from gateway.hub.settings import HubSettings
from gateway.hub.snapshot import ReplicaStatus
from gateway.hub.store import Store, StoreError
from gateway.hub.store.credentials import ensure_private_dir
from gateway.privatefs import write_private
from gateway.wire.protocol import HelloFrame, encode_frame

log = logging.getLogger("gateway.hub.replicas")

HEARTBEAT = 1.0  # s between heartbeats (each also reads the other replicas')
EXPIRY = 5.0  # s without a heartbeat: the replica is dead
PRESENCE_EVERY = 1.0  # s between writes (and reads) of the runners' presence
FORGET = 3600.0  # s: runners silent longer are not read back
ID_FILE = "replica-id"
_hello = msgspec.json.Decoder(HelloFrame).decode


def team_secrets(settings: HubSettings) -> tuple[str, ...]:
    """The team secrets this replica signs with (the first) and accepts (each): the setting's,
    else its file's (ValueError, one line, when that file cannot be read or holds none), else
    a secret of this process alone, said once: no other replica can reach this one's channels
    then (nothing in the store gives a secret)."""
    if settings.team_secret:
        return tuple(settings.team_secret)
    if settings.team_secret_file is not None:
        path = settings.team_secret_file
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(
                f"cannot read --team-secret-file {path}: {exc.strerror or exc}"
            ) from None
        try:
            return parse_team_secrets(text)
        except ValueError as exc:
            raise ValueError(f"--team-secret-file {path}: {exc}") from None
    log.warning(
        "no team secret (--team-secret-file, ALP_GATEWAY_HUB_TEAM_SECRET): the other replicas "
        "on this store cannot reach this one's channels, nor it theirs; give every replica the "
        "same secret"
    )
    return (secrets.token_hex(32),)


def replica_id(given: str | None, data_dir: pathlib.Path | None) -> str:
    """This replica's id: the setting's, else the one kept in the data directory (made at the
    first start), else (no data directory) a new one."""
    if given:
        return given
    if data_dir is None:
        return "hub-" + uuid.uuid4().hex[:8]
    path = data_dir / ID_FILE
    try:
        kept = path.read_text().strip()
    except FileNotFoundError:
        kept = ""
    if kept:
        return kept
    made = f"{socket.gethostname().split('.')[0][:40] or 'hub'}-{uuid.uuid4().hex[:6]}"
    ensure_private_dir(data_dir)
    write_private(path, (made + "\n").encode())  # 0600, as every file of the data directory
    return made


def advertised(base_url: str) -> str:
    """The URL another replica reaches this one at, from the one it serves on: an address
    that means every address becomes this machine's host name."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    if host in ("0.0.0.0", "::", ""):
        port = f":{parts.port}" if parts.port else ""
        return urlunsplit((parts.scheme, socket.gethostname() + port, "", "", ""))
    return base_url.rstrip("/")


class Replication:
    """The team machinery of one replica (see the module's docstring); ``run`` does its work."""

    def __init__(
        self,
        store: ReplicaStore,
        settings: HubSettings,
        *,
        hub_store: Store,
        board: JobBoard,
        channels: Channels,
        sessions: Sessions,
        catalog: Catalog,
        learned: dict[tuple[str, str], str | None],
    ) -> None:
        self.store = store
        self.replica = store.replica
        self.settings = settings
        self.hub_store = hub_store
        self.board = board
        self.channels = channels
        self.sessions = sessions
        self.catalog = catalog
        self.secrets = team_secrets(settings)
        self.secret = self.secrets[0]  # the one this replica signs with
        self.url: str | None = settings.advertise
        self._url_known = trio.Event()
        if self.url is not None:
            self._url_known.set()
        self._ssl = ssl.create_default_context() if settings.tls_cert is not None else None
        self.peers: dict[str, Peer] = {}
        self.replicas: list[ReplicaRow] = []  # as last read
        self.directory: dict[str, ChannelRow] = {}  # job id -> where its channel is
        self.remotes: dict[str, RemoteChannel] = {}
        self._opening: set[str] = set()  # jobs whose channel this replica is writing down
        self._looking: set[str] = set()  # jobs whose channel is being read again
        self._retiring: set[str] = set()
        self.relay = HolderRelay(self.secrets, channels, settings, self._spawn)
        self.sync = BoardSync(board, store)
        self.limits = ReplicaLimits(store, settings, learned, self._evicted, EXPIRY)
        self._dirty: dict[str, dict[Any, None]] = {}  # notification kind -> subjects pending
        self._noted = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._running = False  # the nursery takes new tasks
        # told of this replica's channels gone and requests suspended (the rest of the hub's
        # parts call it through ``coordination.Replicated``)
        channels.on_gone.append(self._gone)
        channels.on_suspend.append(self._suspended)

    @property
    def nursery(self) -> trio.Nursery:
        assert self._nursery is not None, "the team runs (Replication.run) before it serves"
        return self._nursery

    def _spawn(self, fn: Any, *args: Any) -> None:
        self.nursery.start_soon(fn, *args)

    def advertise(self, base_url: str) -> None:
        """The hub serves at ``base_url``: unless ``advertise`` says otherwise, the others
        reach it there; its heartbeats begin."""
        if self.url is None:
            self.url = advertised(base_url)
        self._url_known.set()

    # -- the replica's life --------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The team's work until cancelled: what a previous life of this replica left is
        ended, the store read into memory, then notifications, heartbeats, the runners'
        presence and the turns' releases; at the end, this replica retires (its channels'
        rows and its turns in flight ended, at once for the others)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._running = True
                if await self.store.retire(self.replica, None):
                    log.info("replica %s: what its previous run left was ended", self.replica)
                await self._withdraw_orphans(self.replica)
                await self._load()
                nursery.start_soon(self._listen)
                nursery.start_soon(self._apply_notes)
                nursery.start_soon(self._beat)
                nursery.start_soon(self._presence)
                nursery.start_soon(self.limits.run)
                task_status.started()
        finally:
            self._running = False
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                try:
                    await self.store.retire(self.replica, None)
                except StoreError as exc:
                    log.warning("replica %s could not retire: %s", self.replica, exc)
            for peer in self.peers.values():
                peer.close()

    async def _load(self) -> None:
        """The store read wholly into memory: live jobs, channels, runners, replicas."""
        found = await self.store.load_jobs()
        live = {team_job.job.id for team_job in found}
        for team_job in found:
            apply(self.board, team_job.job.id, team_job)
        for job_id in [j for j in self.board.jobs if j not in live]:
            apply(self.board, job_id, await self.store.load_job(job_id))
        rows = {row.job_id: row for row in await self.store.channels()}
        for job_id in set(self.directory) | set(rows):
            self._place(job_id, rows.get(job_id))
        for ch in self.channels.all():  # this replica's own, should their rows have gone
            if ch.job_id not in rows:
                await self.store.channel_opened(ch.job_id, ch.runner_id)
                self.directory[ch.job_id] = ChannelRow(ch.job_id, self.replica, ch.runner_id)
        await self._read_presence()
        self._peers(await self.store.replicas())
        self.board.changes.notify()

    async def _listen(self) -> None:
        await self.store.listen(self._note, self._load)

    async def _beat(self) -> None:
        await self._url_known.wait()
        announced = False
        while True:
            try:
                assert self.url is not None
                await self.store.heartbeat(self.url, __version__)
                if not announced:  # the others read it at once, not at their next beat
                    await self.store.announce()
                    announced = True
                self._peers(await self.store.replicas())
            except StoreError as exc:
                log.debug("replica %s: no heartbeat: %s", self.replica, exc)
            await trio.sleep(HEARTBEAT)

    def _peers(self, rows: list[ReplicaRow]) -> None:
        """The other replicas as the store has them: each one's URL, whether it lives; a dead
        one not yet retired is retired (by whichever replica gets there first)."""
        self.replicas = rows
        now = trio.current_time()
        before = {r: p.up for r, p in self.peers.items()}
        for row in rows:
            if row.id == self.replica:
                continue
            peer = self.peers.get(row.id)
            if peer is None or peer.url != row.url:
                if peer is not None:
                    peer.close()
                peer = self.peers[row.id] = Peer(row.id, row.url, self.secret, self._ssl)
            peer.alive = not row.stopped and row.heartbeat_age < EXPIRY
            if peer.alive:
                peer.heartbeat_seen = max(peer.heartbeat_seen, now - row.heartbeat_age)
            elif not row.stopped and row.id not in self._retiring:
                self._retiring.add(row.id)
                self.nursery.start_soon(self._retire, row.id, row.heartbeat_age)
        if {r: p.up for r, p in self.peers.items()} != before:
            self.board.changes.notify()

    async def _retire(self, replica: str, silent: float) -> None:
        try:
            if await self.store.retire(replica, EXPIRY):
                log.warning(
                    "replica %s silent for %.1f s: its channels and turns in flight ended",
                    replica,
                    silent,
                )
                await self._withdraw_orphans(replica)
        except StoreError as exc:
            log.info("replica %s could not be retired yet: %s", replica, exc)
        finally:
            self._retiring.discard(replica)

    async def _withdraw_orphans(self, replica: str) -> None:
        """The jobs ``replica`` made for turns now gone (no session points at them): ended."""
        for job_id in await self.store.orphan_jobs(replica):
            if job_id not in self.board.jobs:
                await self.sync.refresh(job_id)
            log.info("job %s of replica %s: no session needs it: withdrawn", job_id, replica)
            await self.channels.cancel_job(job_id, "its chat session was lost with its replica")

    # -- notifications --------------------------------------------------------------------

    def _note(self, note: Note) -> None:
        """A notification (the listener's): noted, applied by ``_apply_notes``."""
        if note.replica == self.replica:
            return  # this replica's own change: in memory already
        self._dirty.setdefault(note.kind, {})[note.subject] = None
        self._noted.set()

    async def _apply_notes(self) -> None:
        while True:
            await self._noted.wait()
            self._noted = trio.Event()
            dirty, self._dirty = self._dirty, {}
            try:
                await self._apply(dirty)
            except StoreError as exc:  # the listener reconnects and reads everything again
                log.debug("replica %s: a notification not applied: %s", self.replica, exc)

    async def _apply(self, dirty: dict[str, dict[Any, None]]) -> None:
        if REPLICA in dirty:
            self._peers(await self.store.replicas())
        for job_id, *_rest in dirty.get(JOB, {}):
            apply(self.board, job_id, await self.store.load_job(job_id))
        for job_id, *_rest in dirty.get(CHANNEL, {}):
            self._place(job_id, await self.store.channel(job_id))
        if PRESENCE in dirty:
            await self._read_presence()
        for runner_id, *_rest in dirty.get(MODELS, {}):
            await self._read_models(runner_id)
        for subject in dirty.get(SESSION, {}):
            if len(subject) == 2:
                self.sessions.drop(subject[0], subject[1])
            else:
                self.sessions.drop()

    # -- runners and their models ---------------------------------------------------------

    async def _presence(self) -> None:
        """The runners this replica heard from written (at once when one's capabilities
        changed, the others told), everyone's read back, every ``PRESENCE_EVERY`` s."""
        while True:
            with trio.move_on_after(PRESENCE_EVERY):
                await self.sync.wake.wait()
            self.sync.wake = trio.Event()
            touched, self.sync.touched = self.sync.touched, set()
            changed, self.sync.changed = self.sync.changed, False
            seen = [p for r in touched if (p := presence_of(self.board, r)) is not None]
            try:
                if seen:
                    await self.store.write_presence(seen, changed)
                await self._read_presence()
            except StoreError as exc:
                self.sync.touched |= touched
                log.debug("replica %s: the runners' presence not written: %s", self.replica, exc)

    async def _read_presence(self) -> None:
        for presence in await self.store.read_presence(FORGET):
            seen_remote(self.board, presence)

    async def _read_models(self, runner_id: str) -> None:
        state = self.board.runners.get(runner_id)
        if state is None:
            return
        for models in await self.hub_store.load_models(state.owner, state.project):
            if models.runner_id == runner_id:
                self.catalog.learn(runner_id, models.models)

    # -- where channels are ------------------------------------------------------------------

    def remote_channel(self, job_id: str) -> ServerChannel | None:
        """The job's channel when another replica holds it and is up (``Channels.remote``)."""
        row = self.directory.get(job_id)
        if row is None or row.replica == self.replica:
            return None
        peer = self.peers.get(row.replica)
        if peer is None or not peer.up:
            return None
        found = self.remotes.get(job_id)
        if found is not None and found.peer is peer and found.runner_id == row.runner_id:
            if not found.closed.is_set():
                return found
            self._look_again(job_id)  # the holder said no, or could not be reached
            return None
        found = self.remotes[job_id] = RemoteChannel(
            job_id, row.runner_id, peer, self.channels, self.nursery, self._lost
        )
        return found

    def awaiting(self, job_id: str) -> bool:
        """Whether the job's channel went with a replica that is down: its runner redials
        another replica, so the session waits for it (``Dispatcher.awaiting``)."""
        row = self.directory.get(job_id)
        if row is None or row.replica == self.replica:
            return False
        peer = self.peers.get(row.replica)
        return peer is None or not peer.up

    def _look_again(self, job_id: str) -> None:
        if job_id in self._looking:
            return
        self._looking.add(job_id)

        async def look() -> None:
            try:
                self._place(job_id, await self.store.channel(job_id))
            except StoreError:
                pass
            finally:
                self._looking.discard(job_id)

        self.nursery.start_soon(look)

    def _place(self, job_id: str, row: ChannelRow | None) -> None:
        """Where the job's channel is now (as just read from the store)."""
        before = self.directory.get(job_id)
        if row is None:
            self.directory.pop(job_id, None)
        else:
            self.directory[job_id] = row
        old = self.remotes.get(job_id)
        if old is not None and (row is None or row.replica != old.peer.replica):
            del self.remotes[job_id]
            old.request_close()
        here = self.channels.local(job_id)
        if (
            row is not None
            and row.replica != self.replica
            and here is not None
            and job_id not in self._opening
        ):
            log.info("job %s: its runner redialled replica %s", job_id, row.replica)
            here.request_close(CLOSE_REPLACED, f"replaced by a connection to {row.replica}")
        if row is not None and row.replica != self.replica:
            self.board.seen(row.runner_id)  # its channel just opened: it lives
            for rid, sink in list(self.channels.suspended.get(job_id, {}).items()):
                self.nursery.start_soon(self._attach, job_id, rid, sink)
        if row != before:
            self.board.changes.notify()

    # -- this replica's channels ---------------------------------------------------------------

    async def accepted(self, ch: ServerChannel) -> None:
        """A channel accepted here (before its hello goes): written down for the others, and
        the requests other replicas hold for the job's resume named in its hello (parked here
        until they attach)."""
        self._opening.add(ch.job_id)
        try:
            await self.store.channel_opened(ch.job_id, ch.runner_id)
            self.directory[ch.job_id] = ChannelRow(ch.job_id, self.replica, ch.runner_id)
            old = self.remotes.pop(ch.job_id, None)
            if old is not None:
                old.request_close()
            within = self.settings.resume_within + EXPIRY
            theirs = [
                s
                for s in await self.store.suspended(ch.job_id, within)
                if s.replica != self.replica
            ]
            if theirs:
                hello = _hello(ch.hello)
                counts = dict(hello.resume or {})
                for waiting in theirs:
                    if not ch.routes(waiting.request_id):
                        self.relay.park(ch, waiting.request_id)
                        counts[waiting.request_id] = waiting.frames
                ch.hello = encode_frame(HelloFrame(ch.job_id, hello.extensions, counts or None))
                log.info(
                    "job %s: its redialled channel resumes %d request(s) of other replicas",
                    ch.job_id,
                    len(theirs),
                )
        except StoreError as exc:
            log.warning("job %s: its channel here could not be written down: %s", ch.job_id, exc)
        finally:
            self._opening.discard(ch.job_id)

    def _gone(self, ch: ServerChannel) -> None:
        """A channel of this replica closed (``Channels.on_gone``): its row goes (unless
        another replica's took its place)."""
        if isinstance(ch, RemoteChannel):
            return
        row = self.directory.get(ch.job_id)
        if row is not None and row.replica == self.replica:
            del self.directory[ch.job_id]
        if self._nursery is not None and self._running:
            self._nursery.start_soon(self._write_gone, ch.job_id)
        # else the replica stops: its retirement removes every row of its channels

    async def _write_gone(self, job_id: str) -> None:
        try:
            await self.store.channel_closed(job_id)
        except StoreError as exc:
            log.debug("job %s: its channel's end not written: %s", job_id, exc)

    # -- requests suspended for a resume -------------------------------------------------------

    def _lost(self, job_id: str, rid: str, sink: Sink) -> None:
        """A forwarded request's answer broke off mid-way (``RemoteChannel``): it waits for
        its job's channel, like one of a channel of this replica (``Channels.suspend``)."""
        self.channels.suspend(job_id, rid, sink)

    def _suspended(self, job_id: str, rid: str, sink: Sink) -> None:
        """A request waits for its job's channel (``Channels.on_suspend``): written down for
        the replica the runner may redial; taken back from there if it is open already."""
        frames = sink.resume_count()
        if frames is None:
            return

        async def write() -> None:
            try:
                await self.store.suspend(job_id, rid, frames)
            except StoreError as exc:
                log.debug("job %s: request %s not written down: %s", job_id, rid, exc)
            row = self.directory.get(job_id)
            if row is not None and row.replica != self.replica:
                await self._attach(job_id, rid, sink)

        self.nursery.start_soon(write)

    async def _attach(self, job_id: str, rid: str, sink: Sink) -> None:
        """Take a suspended request back from the replica that holds its job's channel now."""
        if self.channels.suspended.get(job_id, {}).get(rid) is not sink:
            return  # resumed, or given up, meanwhile
        ch = self.remote_channel(job_id)
        if not isinstance(ch, RemoteChannel):
            return
        if await ch.attach(rid, sink, lambda: self._resumed(job_id, rid, sink)):
            log.info("job %s: request %s resumed through replica %s", job_id, rid, ch.peer.replica)

    def _resumed(self, job_id: str, rid: str, sink: Sink) -> None:
        self.channels.unsuspend(job_id, rid)
        sink.resumed()

    # -- sessions -------------------------------------------------------------------------------

    async def _evicted(self, key_name: str, session_id: str, job_id: str | None) -> None:
        """A session the key's cap ended to make room: forgotten here, its job ended."""
        self.sessions.drop(key_name, session_id)
        if job_id is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                await self.channels.cancel_job(job_id, "session ended: its API key opened too many")

    # -- the team's picture -------------------------------------------------------------------

    def identity(self) -> ReplicaStatus:
        """This replica as ``/metrics`` names it."""
        return ReplicaStatus(self.replica, self.url, __version__)

    def picture(self) -> list[dict[str, Any]]:
        """Every replica as last read: id, URL, version, up, heartbeat age, this one, the
        channels it holds and their runners."""
        out = []
        for row in self.replicas:
            held = [c for c in self.directory.values() if c.replica == row.id]
            peer = self.peers.get(row.id)
            up = row.id == self.replica or (peer is not None and peer.up)
            out.append(
                {
                    "id": row.id,
                    "url": row.url,
                    "version": row.version,
                    "up": up and not row.stopped,
                    "stopped": row.stopped,
                    "heartbeatSeconds": round(row.heartbeat_age, 1),
                    "startedSeconds": round(row.started_age, 1),
                    "self": row.id == self.replica,
                    "channels": len(held),
                    "runners": sorted({c.runner_id for c in held}),
                }
            )
        return out

    def connected_runners(self) -> set[str]:
        """Runners with a channel open on any replica."""
        return {row.runner_id for row in self.directory.values()}
