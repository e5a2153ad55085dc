"""The store: tenants, jobs and the event log in one SQL database (SQLAlchemy 2; SQLite in WAL mode by
default, any URL such as ``postgresql+psycopg://...``).

* Every job state change goes through :meth:`Store.transition`, checked against :mod:`tidal.control.states`
  (``IllegalTransition`` changes nothing) and recorded as an event in the same transaction.
* Writes are serialised by one lock; reads run concurrently. Rows returned are detached snapshots.
* Times are Unix seconds passed in; the store reads no clock.
* Every write of a job marks it changed; the reconcile loop takes the marks (:meth:`Store.take_changed`) and
  re-reads only those rows, so its work follows what changed, not how many jobs there are.
* Job numbers are never reused (``meta.job_seq`` only rises). Tenants found by token hash are remembered.
* A SQLite file deleted or replaced under a running plane makes every call raise :class:`StoreUnavailable`
  (503), never write into a fresh file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, cast

import orjson
from sqlalchemy import (
    JSON,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    and_,
    case,
    create_engine,
    delete,
    event,
    func,
    insert,
    inspect,
    or_,
    select,
    text,
    type_coerce,
)
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    column_property,
    mapped_column,
    sessionmaker,
)
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.schema import CallableColumnDefault, ScalarElementColumnDefault

from tidal.control.states import ACTIVE, HELD, TERMINAL, TRANSITIONS, State, check_transition

SCHEMA_VERSION = 7  # 2: jobs.nominated_s; 3: table docs; 4: tenants.max_priority, jobs.ckpt_location,
# meta job_seq and db_id; 5: jobs.waiting; 6: table progress (was jobs.progress), index (state, tenant, kind);
# 7: no jobs.waiting (why a job waits is the reconcile loop's, made at every step: read_view.PlaneView),
# checkpoint locations with at most one "/" at their end (_one_slash)
BATCH_WRITES = 256  # writes of a batch per transaction (Store.batch); sooner when API writes wait
COPY_PROGRESS_MIN = 128  # progress documents stored at once from which PostgreSQL's COPY is faster (~100)
BATCH_HOLD_S = 0.02  # a batch's transaction open this long commits at its next write if others wait to write
SUBMIT_GROUP = 256  # submissions stored in one transaction at most (Store.submit's group commit)
POOL_SIZE = 48  # SQLite connections kept open: the API's worker threads (40) and the reconcile loop


class Base(DeclarativeBase):
    pass


class TenantRow(Base):
    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    quota_gpus: Mapped[int] = mapped_column(Integer, default=0)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_s: Mapped[float] = mapped_column(Float, default=0.0)
    max_priority: Mapped[int | None] = mapped_column(Integer, nullable=True, default=0)  # schema 4; None: 0


class ProgressRow(Base):
    """A job's progress, apart from its row: the one part of a running job written at every heartbeat, so a
    beat rewrites this short row (one page per several jobs) rather than the job's whole row with its spec."""

    __tablename__ = "progress"

    job_id: Mapped[str] = mapped_column(String(80), primary_key=True)
    doc: Mapped[dict] = mapped_column(JSON)


class JobRow(Base):
    """One job. Request fields come from the spec; the rest is its state (see docs/control.md)."""

    __tablename__ = "jobs"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(80), unique=True, index=True, default="")
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), index=True, default=State.PENDING.value)
    kind: Mapped[str] = mapped_column(String(16))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    min_gpus: Mapped[int] = mapped_column(Integer)
    max_gpus: Mapped[int] = mapped_column(Integer)
    multiple_of: Mapped[int] = mapped_column(Integer, default=1)
    max_restarts: Mapped[int] = mapped_column(Integer, default=3)
    submit_s: Mapped[float] = mapped_column(Float)
    # What the scheduler sees (tidal.model.Job).
    placement: Mapped[dict] = mapped_column(JSON, default=dict)
    releasing: Mapped[dict] = mapped_column(JSON, default=dict)
    started_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_preempted_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_grown_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_shrunk_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_ckpt_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    ckpt_stall_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    ckpt_interval_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    nominated_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # schema 2
    # An explicit checkpoint location (or one taken over with resume_from); None: <ckpt_root>/<id>/ckpt.
    ckpt_location: Mapped[str | None] = mapped_column(String(4096), nullable=True, index=True)  # schema 4
    # Attempts, stopping, failures.
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    attempt_launched_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    preemptions: Mapped[int] = mapped_column(Integer, default=0)
    retry_at_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    stop_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    stop_deadline_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    killed: Mapped[bool] = mapped_column(Boolean, default=False)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    handle: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # The attempt's progress, read with the row from its own table (none yet: {}).
    progress: Mapped[dict] = column_property(type_coerce(func.coalesce(
        select(ProgressRow.doc).where(ProgressRow.job_id == id).scalar_subquery(), text("'{}'")), JSON))
    ckpt_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Effective training time: seconds summed over finished attempts.
    held_s: Mapped[float] = mapped_column(Float, default=0.0)
    productive_s: Mapped[float] = mapped_column(Float, default=0.0)
    lost_s: Mapped[float] = mapped_column(Float, default=0.0)
    lost_steps: Mapped[int] = mapped_column(Integer, default=0)
    finished_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    message: Mapped[str] = mapped_column(String(2000), default="")
    # the waiting jobs counted per tenant and kind from the index alone (schema 6; Store.count_waiting)
    __table_args__ = (Index("ix_jobs_state_tenant_kind", "state", "tenant", "kind"),)

    @property
    def gpus(self) -> int:
        return sum(self.placement.values()) if self.placement else 0




class EventRow(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    time_s: Mapped[float] = mapped_column(Float)
    job_id: Mapped[str | None] = mapped_column(String(80), index=True, nullable=True)
    tenant: Mapped[str | None] = mapped_column(String(64), index=True, nullable=True)
    kind: Mapped[str] = mapped_column(String(32))
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    message: Mapped[str] = mapped_column(String(2000), default="")
    data: Mapped[dict | None] = mapped_column(JSON, nullable=True)


class MetaRow(Base):
    __tablename__ = "meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(2000))


class DocRow(Base):
    """A document the control plane keeps between runs (``serving``: the loan ledger, the loan policy's
    state, the serving adapter's). JSON text, written by our own encoder (NaN and infinities kept)."""

    __tablename__ = "docs"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    doc: Mapped[str] = mapped_column(Text)
    updated_s: Mapped[float] = mapped_column(Float, default=0.0)


@dataclass(slots=True)
class HeldJob:
    """A job holding GPUs as the pool views and ``/metrics`` read it (:meth:`Store.held`). Of ``progress``
    they read ``step``, ``steps_per_s``, ``start_step`` and ``tiers`` (:data:`PROGRESS_KEYS`, all a read of
    the store has; the loop's view holds the whole document); accounting is zero unless read. Not changed
    once made (a view's record); not a frozen dataclass for its cost: the loop makes one for every running job
    whose progress moved at every step, and a frozen one's 14 fields took ~3 us to set against ~1."""

    id: str
    tenant: str
    state: str
    kind: str
    placement: dict[str, int]
    releasing: dict[str, int]
    restarts: int = 0
    preemptions: int = 0
    lost_s: float = 0.0
    lost_steps: int = 0
    held_s: float = 0.0
    productive_s: float = 0.0
    attempt_launched_s: float | None = None
    progress: dict[str, Any] = field(default_factory=dict, kw_only=True)

    @property
    def gpus(self) -> int:
        return sum(self.placement.values()) if self.placement else 0


@dataclass(eq=False)
class _Submission:
    """One submission on its way into the store (:meth:`Store.submit`): its values, then its row or error."""

    values: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)  # stored, or handed the lead
    lead: bool = False  # to store the next group (its submitter's thread woken for that)
    stored: bool = False
    row: JobRow | None = None
    loops: JobRow | None = None
    error: BaseException | None = None


class NotFound(KeyError):
    pass


class StoreUnavailable(RuntimeError):
    """The database file was deleted or replaced while this process had it open."""


class StoreConflict(RuntimeError):
    """Writes a batch made on rows its thread held found those jobs changed (moved or gone) when they ran: the
    batch is rolled back (its thread reads the jobs again)."""


def sqlite_url(path: str) -> str:
    return f"sqlite:///{path}"


def to_json(value: Any) -> str:
    """The text of a JSON column: standard JSON, so NaN and the infinities are ``null`` (a training loss that
    went NaN must not leave a document that SQLite's JSON functions reject as malformed, or that PostgreSQL
    refuses to store); orjson (a progress document in a tenth of ``json.dumps``'s time: the loop writes
    thousands a step). What orjson refuses and ``json`` writes (a lone surrogate, escaped) goes through
    ``json``, its non-finite floats made null first."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY).decode()
    except orjson.JSONEncodeError:
        return json.dumps(_finite(value))


def _finite(value: Any) -> Any:
    """``value`` with NaN and the infinities, at any depth of its dicts and lists, made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def sqlite_path(url: str) -> str | None:
    """The file behind a SQLite URL (None: another database, or in memory)."""
    if not url.startswith("sqlite") or ":memory:" in url or "mode=memory" in url:
        return None
    path = url.split(":///", 1)[1] if ":///" in url else ""
    return path.split("?", 1)[0] or None


class Store:
    """Tenants, jobs and events in one database. Thread-safe; see the module docstring."""

    def __init__(self, url: str) -> None:
        self.url = url
        kw: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kw["connect_args"] = {"check_same_thread": False, "timeout": 30}
            if ":memory:" not in url and url.rstrip("/") != "sqlite:":
                # a connection for each thread that may read at once (the API's 40 and the loop), so that a
                # busy API does not open and close connections (each running the PRAGMAs below) all the time
                kw["pool_size"], kw["max_overflow"] = POOL_SIZE, 16
        self.engine = create_engine(url, json_serializer=to_json, **kw)
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.path = sqlite_path(url)
        self._identity: tuple[int, int] | None = None
        Base.metadata.create_all(self.engine)
        if self.path is not None:
            st = os.stat(self.path)
            self._identity = (st.st_dev, st.st_ino)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._lock = threading.RLock()  # the write lock
        self._waiting = threading.Lock()  # (guards _waiters: the threads waiting for the write lock)
        self._waiters = 0
        self._batch = threading.local()  # .s: the session of this thread's batch (see batch()); .events: its
        # events not yet written (one statement for all at its commit); .jobs: its writes of held rows not yet
        # run (SQL -> rows of arguments, each job at most once: see _defer)
        self._by_token: dict[str, TenantRow] = {}
        self._changed: dict[str, JobRow | None] = {}  # job id -> the caller's row written in place, or None
        self._marks = threading.Lock()  # (not the write lock: a submit marks its job while the loop writes)
        # jobs submitted through this store so far per (tenant, kind), and those counted when the loop last
        # took the marks: a reader of the loop's published view adds the jobs submitted since (read_view)
        self.submitted: Counter[tuple[str, str]] = Counter()
        self.taken_submits: dict[tuple[str, str], int] = {}
        self._subs: list[_Submission] = []  # submissions waiting to be stored (group commit: submit)
        self._subs_lock = threading.Lock()
        self._leading = False  # a thread stores them (or has been handed the lead)
        self.tenant_rev = 0  # rises with every tenant written (the reconcile loop keeps them meanwhile)
        with self._write() as s:
            row = s.get(MetaRow, "schema_version")
            if row is None:
                s.add(MetaRow(key="schema_version", value=str(SCHEMA_VERSION)))
            elif int(row.value) > SCHEMA_VERSION:
                self.engine.dispose()
                raise ValueError(f"the database at {url!r} has schema version {row.value}, newer than this "
                                 f"tidal's {SCHEMA_VERSION}: upgrade tidal, or point it at another database")
            elif int(row.value) < SCHEMA_VERSION:
                self._migrate(s, int(row.value))
                row.value = str(SCHEMA_VERSION)
            if s.get(MetaRow, "job_seq") is None:  # new, or made before schema 4: start past every job
                top = s.scalar(select(func.max(JobRow.seq))) or 0
                s.add(MetaRow(key="job_seq", value=str(top)))
            if s.get(MetaRow, "db_id") is None:
                s.add(MetaRow(key="db_id", value=secrets.token_hex(8)))

    def _migrate(self, s: Session, version: int) -> None:
        """Bring a database made by an older tidal up to :data:`SCHEMA_VERSION` (columns added since are
        nullable: existing rows keep their meaning)."""
        have = {c["name"] for c in inspect(s.connection()).get_columns("jobs")}
        if version < 2 and "nominated_s" not in have:
            s.execute(text("ALTER TABLE jobs ADD COLUMN nominated_s FLOAT"))
        if version < 4:
            if "ckpt_location" not in have:
                s.execute(text("ALTER TABLE jobs ADD COLUMN ckpt_location VARCHAR(4096)"))
                s.execute(text("CREATE INDEX IF NOT EXISTS ix_jobs_ckpt_location ON jobs (ckpt_location)"))
            if "max_priority" not in {c["name"] for c in inspect(s.connection()).get_columns("tenants")}:
                s.execute(text("ALTER TABLE tenants ADD COLUMN max_priority INTEGER"))
        if version < 6:
            s.execute(text("CREATE INDEX IF NOT EXISTS ix_jobs_state_tenant_kind "
                           "ON jobs (state, tenant, kind)"))
        if version < 6 and "progress" in have:
            s.execute(text("INSERT INTO progress (job_id, doc) SELECT id, progress FROM jobs "
                           "WHERE progress IS NOT NULL"))
            s.execute(text("ALTER TABLE jobs DROP COLUMN progress"))
        if version < 7 and "waiting" in have:
            s.execute(text("ALTER TABLE jobs DROP COLUMN waiting"))
        if version < 7:  # (a location's "/"s at its end as _one_slash leaves them)
            s.execute(text("UPDATE jobs SET ckpt_location = rtrim(ckpt_location, '/') || '/' "
                           "WHERE ckpt_location LIKE '%//'"))

    def close(self) -> None:
        self.engine.dispose()

    def check_file(self) -> None:
        """Raise :class:`StoreUnavailable` if the SQLite file is gone or is another file now."""
        if self._identity is None or self.path is None:
            return
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != self._identity:
            raise StoreUnavailable(
                f"the database {self.path} was {'deleted' if st is None else 'replaced'} while "
                "tidal up was running; nothing more is stored: stop tidal up and restore "
                "the file from a backup")

    @property
    def db_id(self) -> str:
        with self._read() as s:
            row = s.get(MetaRow, "db_id")
            return row.value if row is not None else ""

    @contextlib.contextmanager
    def _write(self, defer: bool = False) -> Iterator[Session]:
        """A session to write in: this thread's batch's (its writes deferred so far run first, unless this
        one is deferred too), or a transaction of its own."""
        if (b := getattr(self._batch, "s", None)) is not None:
            if not self._batch.locked:  # (a batch takes the lock at its first write, not while it reads)
                self._acquire()
                self._batch.locked, self._batch.since = True, time.monotonic()
                self.check_file()  # (after the wait: not into a file deleted meanwhile; the batch rolls back)
            if not defer:
                self._flush_jobs(b)
            yield b
            b.flush()
            b.expunge_all()  # (rows returned detached, as outside a batch)
            self._batch.n += 1
            if self._batch.n >= BATCH_WRITES or (
                    self._waiters and time.monotonic() - self._batch.since >= BATCH_HOLD_S):
                self.commit()
            return
        self._acquire()
        try:
            self.check_file()  # (with the lock: a write that waited goes into no deleted file)
            with self._sessions.begin() as s:
                yield s
        finally:
            self._lock.release()

    def _acquire(self) -> None:
        """Take the write lock, counted among its waiters while it waits (a batch then commits sooner)."""
        if self._lock.acquire(blocking=False):
            return
        with self._waiting:
            self._waiters += 1
        try:
            self._lock.acquire()
        finally:
            with self._waiting:
                self._waiters -= 1

    @contextlib.contextmanager
    def _read(self) -> Iterator[Session]:
        if (b := getattr(self._batch, "s", None)) is not None:
            self._flush_jobs(b)
            yield b  # (this thread's batch: its own writes seen)
            b.expunge_all()
            return
        self.check_file()
        with self._sessions() as s:
            yield s

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """This thread's writes in the block in transactions of up to :data:`BATCH_WRITES` writes, committed
        then (and at :meth:`commit`, and at its end), the one open rolled back if it raises; other threads'
        writes go in between. The reconcile loop's many small writes of a step: a commit per many. The write
        lock is held only while a transaction of the batch is open (from its first write to its commit), and
        one open :data:`BATCH_HOLD_S` commits at its next write when another thread waits to write."""
        if getattr(self._batch, "s", None) is not None:
            yield
            return
        self.check_file()
        with self._sessions() as s:
            self._batch.s, self._batch.n, self._batch.locked = s, 0, False
            self._batch.events, self._batch.jobs = [], {}
            self._batch.job_ids = set[str | tuple[str, str]]()
            try:
                yield
                self._flush_jobs(s)
                self._flush_events(s)
                s.commit()
            except BaseException:
                s.rollback()
                raise
            finally:
                self._batch.s, self._batch.events, self._batch.jobs, self._batch.job_ids = None, [], {}, set()
                self._unlock_batch()
                s.expunge_all()

    def commit(self) -> None:
        """Commit this thread's batch so far (what must be stored before an action outside the database, such
        as a launch); nothing to do outside a batch."""
        if (b := getattr(self._batch, "s", None)) is not None:
            self._flush_jobs(b)
            self._flush_events(b)
            b.commit()
            self._batch.n = 0
            self._unlock_batch()  # (writes of other threads waiting go in here)

    def _unlock_batch(self) -> None:
        """Give back the write lock this thread's batch took at its first write since its last commit."""
        if self._batch.locked:
            self._batch.locked = False
            self._lock.release()

    def add_tenant(self, name: str, token_hash: str, *, quota_gpus: int = 0, weight: float = 1.0,
                   admin: bool = False, now_s: float = 0.0, max_priority: int = 0) -> TenantRow:
        with self._write() as s:
            if s.get(TenantRow, name) is not None:
                raise ValueError(f"tenant {name!r} exists")
            row = TenantRow(name=name, quota_gpus=quota_gpus, weight=weight, token_hash=token_hash,
                            admin=admin, created_s=now_s, max_priority=max_priority)
            s.add(row)
            s.add(EventRow(time_s=now_s, tenant=name, kind="tenant",
                           message=f"tenant {name} created (quota {quota_gpus} GPUs, weight {weight:g}, "
                                   f"max priority {max_priority}{', admin' if admin else ''})"))
        self.tenant_rev += 1
        return row

    def set_tenant_token(self, name: str, token_hash: str) -> None:
        with self._write() as s:
            row = s.get(TenantRow, name)
            if row is None:
                raise NotFound(name)
            row.token_hash = token_hash
            self._by_token = {h: t for h, t in self._by_token.items() if t.name != name}

    def tenant(self, name: str) -> TenantRow | None:
        with self._read() as s:
            return s.get(TenantRow, name)

    def known_tenant(self, token_hash: str) -> TenantRow | None:
        """The tenant of a token hash seen before (no I/O); None: ask :meth:`tenant_by_token_hash`."""
        return self._by_token.get(token_hash)

    def tenant_by_token_hash(self, token_hash: str) -> TenantRow | None:
        row = self._by_token.get(token_hash)
        if row is not None:
            return row
        with self._read() as s:
            row = s.scalars(select(TenantRow).where(TenantRow.token_hash == token_hash)).first()
        if row is not None:
            with self._lock:  # not cached across a concurrent token change
                if row.token_hash == token_hash and self._current(row.name, token_hash):
                    self._by_token[token_hash] = row
        return row

    def _current(self, name: str, token_hash: str) -> bool:
        with self._read() as s:
            t = s.get(TenantRow, name)
            return t is not None and t.token_hash == token_hash

    def tenants(self) -> list[TenantRow]:
        with self._read() as s:
            return list(s.scalars(select(TenantRow).order_by(TenantRow.name)))

    def admin(self) -> TenantRow | None:
        with self._read() as s:
            return s.scalars(select(TenantRow).where(TenantRow.admin.is_(True))).first()

    def submit(self, tenant: str, spec: dict, now_s: float, *, ckpt_location: str | None = None) -> JobRow:
        """Insert a pending job from a validated spec (``JobSpec.model_dump()``); its id is ``<name>-<n>``,
        ``n`` from the ``job_seq`` counter (never reused). Nothing is stored if anything fails.

        Submissions of several threads at once are stored together (group commit): the first to arrive
        stores every one waiting by then in one transaction (one statement per table) while the others wait,
        then the first still waiting stores the next group. A group that fails is stored again one submission
        at a time, so a submission fails only for what fails alone."""
        g = spec["gpus"]
        values = {**_job_defaults(), "tenant": tenant, "name": spec["name"], "spec": spec,
                  "kind": spec["kind"], "priority": spec["priority"], "min_gpus": g["min"],
                  "max_gpus": g["max"], "multiple_of": g["multiple_of"], "max_restarts": spec["max_restarts"],
                  "submit_s": now_s, "ckpt_location": _one_slash(ckpt_location)}
        me = _Submission(values)
        if getattr(self._batch, "s", None) is not None:  # (this thread's batch: stored in it)
            with self._write() as s:
                self._insert_jobs(s, [values])
            self._submitted([me])
        else:
            self._submit_grouped(me)
        if me.error is not None:
            raise me.error
        assert me.row is not None
        return me.row

    def _submit_grouped(self, me: _Submission) -> None:
        with self._subs_lock:
            self._subs.append(me)
            lead = not self._leading
            self._leading = True
        if not lead:
            me.done.wait()  # stored by another thread, or handed the lead
            if not me.lead:
                return
        try:
            while not me.stored:
                self._store_group()
        finally:
            with self._subs_lock:
                if not me.stored:  # (the store failed before taking any: this one raises, the rest go on)
                    self._subs.remove(me)
                if self._subs:  # the lead to the first still waiting: its wait ends, it stores the next group
                    self._subs[0].lead = True
                    self._subs[0].done.set()
                else:
                    self._leading = False

    def _store_group(self) -> None:
        """Store the submissions waiting once the write lock is taken (up to :data:`SUBMIT_GROUP`) in one
        transaction; if it fails, each in one of its own."""
        group: list[_Submission] = []
        try:
            with self._write() as s:  # (while it waits for the lock, more submissions come)
                with self._subs_lock:
                    group, self._subs = self._subs[:SUBMIT_GROUP], self._subs[SUBMIT_GROUP:]
                self._insert_jobs(s, [x.values for x in group])
            self._submitted(group)
        except Exception as e:
            if not group:  # (before any was taken: the caller's own fails)
                raise
            if len(group) == 1:
                group[0].error = e
                return
            for x in group:  # each alone: a submission fails only for what fails alone
                try:
                    with self._write() as s:
                        self._insert_jobs(s, [x.values])
                    self._submitted([x])
                except Exception as alone:
                    x.error = alone
        finally:
            for x in group:  # (an interrupt, even while one is stored alone: those not stored fail with it)
                if x.row is None and x.error is None:
                    x.error = StoreUnavailable("the submission was interrupted; nothing was stored")
                x.stored = True
                x.done.set()

    def _insert_jobs(self, s: Session, rows: list[dict[str, Any]]) -> None:
        """Insert new pending jobs (their column values; ``seq`` and ``id`` set here) and their submission
        events, in ``s``'s transaction (the driver's statements as written: no ORM unit of work)."""
        c = s.connection()
        take_seq, insert_job = _submit_sql(self._q)
        top = c.exec_driver_sql(take_seq, (len(rows),)).scalar()  # (the counter moved on and read: one trip)
        if top is None:  # (made by __init__; a database edited under us)
            top = (c.execute(select(func.max(_JOBS.c.seq))).scalar() or 0) + len(rows)
            c.execute(insert(_META), {"key": "job_seq", "value": str(top)})
        first = int(top) - len(rows) + 1
        for i, v in enumerate(rows):
            v["seq"], v["id"] = first + i, f"{v['name']}-{first + i}"
        c.exec_driver_sql(insert_job, [tuple(to_json(v[k]) if k in _JSON_COLS else v[k] for k in _SUBMIT_COLS)
                                       for v in rows])
        self._insert_events(s, [_event_row(v["submit_s"], v["id"], v["tenant"], "transition", "submitted",
                                           None, None, v["state"]) for v in rows])

    def _submitted(self, subs: list[_Submission]) -> None:
        """The rows of stored submissions: each caller's, and one for the reconcile loop (marked changed)."""
        for x in subs:
            x.row, x.loops = _new_row(x.values), _new_row(x.values)  # (the caller's, and the loop's to keep)
        with self._marks:
            for x in subs:
                assert x.loops is not None
                self._changed[x.loops.id] = x.loops
                self.submitted[x.loops.tenant, x.loops.kind] += 1

    def job(self, job_id: str) -> JobRow:
        with self._read() as s:
            return self._get(s, job_id)

    def jobs(self, *, tenant: str | None = None, states: Iterable[str] | None = None, offset: int = 0,
             limit: int | None = None) -> list[JobRow]:
        """Jobs in submission order, of one tenant and in some states; ``limit`` from ``offset``."""
        q = select(JobRow).order_by(JobRow.seq).offset(offset).limit(limit)
        if tenant is not None:
            q = q.where(JobRow.tenant == tenant)
        if states is not None:
            q = q.where(JobRow.state.in_([str(x) for x in states]))
        with self._read() as s:
            return list(s.scalars(q))

    def jobs_page(self, *, tenant: str | None = None, states: Iterable[str] | None = None,
                  kind: str | None = None, match: str | None = None, limit: int = 50,
                  offset: int = 0) -> tuple[list[JobRow], int]:
        """One page of jobs, newest first, and how many match in all (the dashboard's table: a page per
        call, never every row). ``match``: a substring of the job id (``%`` and ``_`` taken literally)."""
        conds = []
        if tenant is not None:
            conds.append(JobRow.tenant == tenant)
        if states is not None:
            conds.append(JobRow.state.in_([str(x) for x in states]))
        if kind is not None:
            conds.append(JobRow.kind == kind)
        if match and "\x00" in match:  # SQLite's LIKE would stop at the NUL and match every job
            return [], 0
        if match:
            like = match.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            conds.append(JobRow.id.like(f"%{like}%", escape="\\"))
        q = select(JobRow).where(*conds).order_by(JobRow.seq.desc()).limit(limit).offset(offset)
        with self._read() as s:
            total = s.scalar(select(func.count()).select_from(JobRow).where(*conds)) or 0
            return list(s.scalars(q)), int(total)

    def held(self, *, accounting: bool = False) -> list[HeldJob]:
        """The jobs holding GPUs as plain records in submission order (one Core ``SELECT``, no ORM row
        built), with their accounting and progress when asked (``/metrics``)."""
        with self._read() as s:
            if not accounting:
                return [HeldJob(*r) for r in s.execute(_HELD)]
            n, rows = len(PROGRESS_KEYS), s.execute(_HELD_ACCOUNTING).all()
            return [HeldJob(*r[:-n], progress={k: v for k, v in zip(PROGRESS_KEYS, r[-n:], strict=True)
                                               if v is not None}) for r in rows]

    def count_waiting(self) -> dict[tuple[str, str], int]:
        """(tenant, kind) -> jobs pending or backing off; one ``GROUP BY``."""
        q = select(JobRow.tenant, JobRow.kind, func.count()).where(
            JobRow.state.in_([State.PENDING.value, State.BACKOFF.value])).group_by(JobRow.tenant, JobRow.kind)
        with self._read() as s:
            return {(t, k): int(n) for t, k, n in s.execute(q)}

    def waiting_head(self, limit: int) -> list[JobRow]:
        """The first ``limit`` jobs pending or backing off in about the scheduler's order: dedicated first,
        nominated first, by priority, then when each (re)joined its queue (submission, or its last
        preemption: :attr:`tidal.model.Job.queued_s`) and by id (:func:`tidal.model.arrival`)."""
        queued = case((JobRow.last_preempted_s > JobRow.submit_s, JobRow.last_preempted_s),
                      else_=JobRow.submit_s)
        q = select(JobRow).where(JobRow.state.in_([State.PENDING.value, State.BACKOFF.value])).order_by(
            JobRow.kind != "dedicated", JobRow.nominated_s.is_(None), JobRow.priority.desc(), queued,
            JobRow.id).limit(limit)
        with self._read() as s:
            return list(s.scalars(q))

    def job_ids(self) -> set[str]:
        with self._read() as s:
            return set(s.scalars(select(JobRow.id)))

    def ckpt_locations(self, near: Iterable[str] | None = None) -> list[tuple[str, str, str, str]]:
        """(job id, tenant, location, state) of every job with a recorded checkpoint location; with ``near``,
        only of those whose location may overlap one of these (:func:`tidal.control.locations.overlaps`: the
        same, one a location is under, or one under it; the caller checks each), through the index on
        locations, not a read of every job's."""
        q = select(JobRow.id, JobRow.tenant, JobRow.ckpt_location, JobRow.state).where(
            JobRow.ckpt_location.is_not(None))
        if near is not None:
            col, found = JobRow.ckpt_location, list[ColumnElement[bool]]()
            for m in near:  # (locations are stored with at most one "/" at their end: _one_slash)
                above = {m, m.rstrip("/")} | {m[:i] for i, c in enumerate(m) if c == "/"}
                found.append(col.in_(sorted(above | {a + "/" for a in above})))
                top = m.rstrip("/")
                if self.engine.dialect.name == "sqlite":  # (byte order: the index's range, exactly)
                    found.append(and_(col >= top + "/", col < top + "0"))
                else:  # (a range in a locale's order is not the names under it: LIKE is)
                    top = top.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
                    found.append(col.like(top + "/%", escape="\\"))
            if not found:
                return []
            q = q.where(or_(*found))
        with self._read() as s:
            return [(i, t, loc, st) for i, t, loc, st in s.execute(q) if loc is not None]  # (as the query)

    def active_jobs(self) -> list[JobRow]:
        return self.jobs(states=ACTIVE)

    def jobs_by_id(self, ids: Iterable[str]) -> list[JobRow]:
        """The rows of these jobs (ids not in the store are skipped), in bounded ``IN`` lists."""
        ids, out = list(ids), list[JobRow]()
        with self._read() as s:
            for i in range(0, len(ids), 500):
                out += s.scalars(select(JobRow).where(JobRow.id.in_(ids[i:i + 500])))
        return out

    def take_changed(self) -> dict[str, JobRow | None]:
        """The jobs written since the last call (submitted, moved, updated), and forget them: each with the
        row its writer held and brought to what it wrote, where every write since was such (the row is then as
        stored; a submit's is a row of its own for the caller of this), else ``None`` (read it again)."""
        with self._marks:
            out, self._changed = self._changed, {}
            self.taken_submits = dict(self.submitted)  # (the jobs submitted among the marks taken and before)
        return out

    def count_by_state(self, tenant: str | None = None,
                       states: Iterable[str] | None = None) -> dict[str, int]:
        """How many jobs are in each state (of ``states``; states without jobs absent); one ``GROUP BY``."""
        q = select(JobRow.state, func.count()).group_by(JobRow.state)
        if tenant is not None:
            q = q.where(JobRow.tenant == tenant)
        if states is not None:
            q = q.where(JobRow.state.in_([str(x) for x in states]))
        with self._read() as s:
            return {st: int(n) for st, n in s.execute(q)}

    def transition(self, job: JobRow | str, to: State, now_s: float, message: str, *,
                   data: dict | None = None, **fields: Any) -> JobRow:
        """Move a job to ``to`` (checked against the table), set ``fields``, record the event; atomically.
        ``job``: its id, or the row the caller holds (then not read again: written while the store still has
        it in the row's state, else as by id; the row is updated in place to what was written, and the job
        marked changed with it, see :meth:`take_changed`)."""
        values = {**fields, "state": State(to).value, "message": message[:2000]}
        cols = {k: v for k, v in values.items() if k != "progress"}
        row = job if isinstance(job, JobRow) else None
        jid = job.id if isinstance(job, JobRow) else job
        q, sets, args = self._q, *self._sets(cols)
        allowed = row is not None and State(to) in TRANSITIONS.get(State(row.state), ())
        with self._write(defer=allowed) as s:
            c = s.connection()  # (the driver's statements: SQLAlchemy's Core costs several times as much)
            held = allowed and (row is not None) and self._defer(
                s, f"UPDATE jobs SET {sets} WHERE id = {q} AND state = {q}", (*args, jid, row.state), jid)
            if held:
                assert row is not None
                old, tenant = row.state, row.tenant  # (the usual case: one statement, nothing read)
            else:
                got = s.execute(select(JobRow.state, JobRow.tenant).where(JobRow.id == jid)).first()
                if got is None:
                    raise NotFound(jid)
                old, tenant = got
                check_transition(jid, old, to)
                c.exec_driver_sql(f"UPDATE jobs SET {sets} WHERE id = {q}", (*args, jid))
            if "progress" in values:  # (deferred with the row's write: a step's launches, one statement)
                self._defer(s, self._progress_sql, _progress_rows({jid: values["progress"]})[0],
                            ("progress", jid), held)
            self._insert_event(s, now_s, jid, tenant, "transition", values["message"], data, old,
                               values["state"])
        if row is None:
            self._mark(jid)
            return self.job(jid)
        written(row, values)
        if held:
            self._mark_row(row)
        else:  # (the store had it in another state: the caller's row is stale, read again)
            self._mark(jid)
        return row

    def update(self, job: JobRow | str, **fields: Any) -> JobRow:
        """Set fields that are not the state (progress, handle, bookkeeping); ``job`` as for
        :meth:`transition`."""
        if "state" in fields:
            raise ValueError("use Store.transition to change a job's state")
        row = job if isinstance(job, JobRow) else None
        jid = job.id if isinstance(job, JobRow) else job
        cols = {k: v for k, v in fields.items() if k != "progress"}
        q, sets, args = self._q, *self._sets(cols)
        deferred = row is not None and "progress" not in fields
        with self._write(defer=deferred) as s:
            if cols and not self._defer(s, f"UPDATE jobs SET {sets} WHERE id = {q}", (*args, jid), jid,
                                        deferred):
                raise NotFound(jid)
            if "progress" in fields:
                if not cols and s.scalar(select(JobRow.seq).where(JobRow.id == jid)) is None:
                    raise NotFound(jid)
                self._put_progress(s, _progress_rows({jid: fields["progress"]}))
        if row is None:
            self._mark(jid)
            return self.job(jid)
        self._mark_row(written(row, fields))
        return row

    def update_many(self, changes: dict[str, dict[str, Any]], *, mark: bool = True,
                    held: Mapping[str, JobRow] | None = None, observed: bool = False) -> None:
        """:meth:`update` of many jobs in one transaction (job id -> fields), one statement per set of fields
        changed; ids no longer in the store are skipped. ``held``: rows the caller holds, brought to what was
        written (and marked changed with them, as by :meth:`update`). ``mark=False``: not marked changed (the
        caller holds the rows and the change needs no look again). ``observed``: what was observed of running
        jobs (progress), which the next observation writes again: on PostgreSQL committed without waiting for
        its log to reach the disk (``synchronous_commit`` off for this transaction: a crash of the database
        server may lose the last few hundred milliseconds of these, never leave them half written; a later
        commit that waits writes them too), as SQLite in WAL mode (``synchronous=NORMAL``) commits every
        transaction."""
        if any("state" in f for f in changes.values()):
            raise ValueError("use Store.transition to change a job's state")
        groups: dict[str, list[tuple[Any, ...]]] = {}  # SET clause -> its rows (the same columns, in order)
        for jid, f in changes.items():
            if cols := {k: f[k] for k in sorted(f) if k != "progress"}:
                sets, args = self._sets(cols)
                groups.setdefault(sets, []).append((*args, jid))
        q = self._q  # (the driver's executemany: no statement compiled per row; made before the lock)
        statements = [(f"UPDATE jobs SET {sets} WHERE id = {q}", rows) for sets, rows in groups.items()]
        progress = _progress_rows({jid: f["progress"] for jid, f in changes.items() if "progress" in f})
        with self._write() as s:
            if observed and self.engine.dialect.name == "postgresql":
                s.connection().exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
            self._put_progress(s, progress)
            for sql, rows in statements:
                s.connection().exec_driver_sql(sql, rows)
        for jid, f in changes.items():
            if (row := (held or {}).get(jid)) is not None:
                written(row, f)
            if mark:
                self._mark_row(row) if row is not None else self._mark(jid)

    def _mark(self, *ids: str) -> None:
        """Mark jobs changed, once their write is committed (a reader that takes the mark sees the row)."""
        with self._marks:
            self._changed.update(dict.fromkeys(ids))

    def _mark_row(self, row: JobRow) -> None:
        """Mark a job changed by a write of the row its caller holds, now brought to what was written (a job
        also written otherwise since the last :meth:`take_changed` stays ``None``: read again)."""
        with self._marks:
            if self._changed.setdefault(row.id, row) is not row:
                self._changed[row.id] = None

    @property
    def _q(self) -> str:
        """The driver's parameter marker (for statements written out for its executemany)."""
        return "?" if self.engine.dialect.paramstyle == "qmark" else "%s"

    def _put_progress(self, s: Session, rows: list[tuple[str, str]]) -> None:
        """Store jobs' progress documents (:func:`_progress_rows`), one statement for all; on PostgreSQL, many
        are copied into a temporary table first (``COPY``) and stored from it by one upsert."""
        if not rows:
            return
        if len(rows) >= COPY_PROGRESS_MIN and self.engine.dialect.name == "postgresql":
            raw = s.connection().connection.driver_connection  # (psycopg's connection: its COPY)
            assert raw is not None
            with raw.cursor() as cur:
                cur.execute("CREATE TEMPORARY TABLE IF NOT EXISTS progress_in (job_id VARCHAR(80), doc JSON) "
                            "ON COMMIT DELETE ROWS")
                with cur.copy("COPY progress_in (job_id, doc) FROM STDIN") as copy:
                    for row in rows:
                        copy.write_row(row)
                cur.execute("INSERT INTO progress (job_id, doc) SELECT job_id, doc FROM progress_in "
                            "ON CONFLICT (job_id) DO UPDATE SET doc = excluded.doc")
                cur.execute("DELETE FROM progress_in")  # (a second copy in this transaction starts empty)
            return
        s.connection().exec_driver_sql(self._progress_sql, rows)

    @property
    def _progress_sql(self) -> str:
        """Store a job's progress document: (job id, JSON text)."""
        q = self._q
        return (f"INSERT INTO progress (job_id, doc) VALUES ({q}, {q}) "
                "ON CONFLICT (job_id) DO UPDATE SET doc = excluded.doc")

    def drop_before(self, cutoff_s: float, keep: Callable[[str], bool] | None = None) -> tuple[int, int]:
        """Delete the jobs that ended before ``cutoff_s`` (but those ``keep`` says to keep) with their events,
        and every event older than it; (jobs, events) deleted. Job numbers are not reused."""
        q = select(JobRow.id).where(JobRow.state.in_([str(x) for x in TERMINAL]),
                                    JobRow.finished_s < cutoff_s)
        with self._read() as s:
            ids = [i for i in s.scalars(q) if keep is None or not keep(i)]
        n_events = 0
        with self._write() as s:
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                n_events += _count(s.execute(delete(EventRow).where(EventRow.job_id.in_(chunk))))
                s.execute(delete(ProgressRow).where(ProgressRow.job_id.in_(chunk)))
                s.execute(delete(JobRow).where(JobRow.id.in_(chunk)))
            n_events += _count(s.execute(delete(EventRow).where(EventRow.time_s < cutoff_s)))
        self._mark(*ids)
        return len(ids), n_events

    def _get(self, s: Session, job_id: str) -> JobRow:
        row = s.scalars(select(JobRow).where(JobRow.id == job_id)).first()
        if row is None:
            raise NotFound(job_id)
        return row

    def record(self, kind: str, message: str, now_s: float, *, job: JobRow | None = None,
               tenant: str | None = None, data: dict | None = None) -> None:
        """An event that is not a transition (a decision, an adoption, a kill, a tenant change)."""
        with self._write() as s:
            self._insert_event(s, now_s, job.id if job else None, job.tenant if job else tenant,
                               kind, message[:2000], data)

    def _insert_event(self, s: Session, now_s: float, job_id: str | None, tenant: str | None, kind: str,
                      message: str, data: dict | None, from_state: str | None = None,
                      to_state: str | None = None) -> None:
        """Write an event in ``s``'s transaction (see :meth:`_insert_events`)."""
        self._insert_events(s, [_event_row(now_s, job_id, tenant, kind, message, data, from_state, to_state)])

    def _insert_events(self, s: Session, rows: list[tuple[Any, ...]]) -> None:
        """Write events (:func:`_event_row`) in ``s``'s transaction, in one statement; in this thread's batch,
        at its commit (in the order recorded, all in one statement: a statement each cost a round trip on
        PostgreSQL)."""
        if s is getattr(self._batch, "s", None):
            self._batch.events.extend(rows)
        elif rows:
            s.connection().exec_driver_sql(_event_sql(self._q), rows if len(rows) > 1 else rows[0])

    def _defer(self, s: Session, sql: str, args: tuple[Any, ...], jid: str | tuple[str, str],
               may: bool = True) -> bool:
        """Run a write of job ``jid``'s row that must change it: in this thread's batch (``may``), at its next
        read, other write or commit, with the writes of the same SQL in one statement (a job written again
        first runs what is deferred, so each job's writes keep their order), and True; else now, and whether
        it changed a row. ``jid`` ``("progress", id)``: the job's progress row (its own order)."""
        if not (may and s is getattr(self._batch, "s", None)):
            return bool(_count(s.connection().exec_driver_sql(sql, args)))
        if jid in self._batch.job_ids:
            self._flush_jobs(s)
        self._batch.jobs.setdefault(sql, []).append(args)
        self._batch.job_ids.add(jid)
        return True

    def _flush_jobs(self, s: Session) -> None:
        """Run this thread's batch's deferred writes (:meth:`_defer`); :class:`StoreConflict` when any found
        its job moved or gone (the caller's batch then rolls back)."""
        if not (pending := self._batch.jobs):
            return
        self._batch.jobs, self._batch.job_ids = {}, set()
        c, want = s.connection(), sum(map(len, pending.values()))
        done = sum(_count(c.exec_driver_sql(sql, rows)) for sql, rows in pending.items())
        if done != want:
            raise StoreConflict(f"{want - done} of {want} writes of jobs this plane held found them moved or "
                                "gone (another writer changed their state?): the step's batch is rolled back")

    def _flush_events(self, s: Session) -> None:
        """Write the events this thread's batch (in session ``s``) has recorded since its last commit."""
        if rows := self._batch.events:
            self._batch.events = []
            s.connection().exec_driver_sql(_event_sql(self._q), rows)

    def _sets(self, cols: Mapping[str, Any]) -> tuple[str, tuple[Any, ...]]:
        """``a = ?, b = ?`` of a job's columns and their values as the driver takes them (JSON as text);
        ``ValueError`` for a name that is no column of the jobs table."""
        if bad := cols.keys() - _JOB_COLS:
            raise ValueError(f"no such column of jobs: {sorted(bad)}")
        q = self._q
        return (", ".join(f"{k} = {q}" for k in cols),
                tuple(to_json(v) if k in _JSON_COLS and v is not None else v for k, v in cols.items()))

    def put_doc(self, key: str, doc: Any, now_s: float,
                events: Iterable[tuple[str, str, dict | None]] = ()) -> None:
        """Store ``doc`` under ``key`` with ``events`` (kind, message, data) in one transaction."""
        text_ = json.dumps(doc, separators=(",", ":"))
        with self._write() as s:
            row = s.get(DocRow, key)
            if row is None:
                s.add(DocRow(key=key, doc=text_, updated_s=now_s))
            else:
                row.doc, row.updated_s = text_, now_s
            for kind, message, data in events:  # (in order with the batch's other events)
                self._insert_event(s, now_s, None, None, kind, message[:2000], data)

    def get_doc(self, key: str) -> Any | None:
        """The document stored under ``key`` (``None``: none); ``ValueError`` naming the key if unreadable."""
        with self._read() as s:
            row = s.get(DocRow, key)
            if row is None:
                return None
            try:
                return json.loads(row.doc)
            except ValueError as e:
                raise ValueError(f"the store's document {key!r} is not valid JSON: {e}") from None

    def events(self, *, job_id: str | None = None, tenant: str | None = None, after_id: int = 0,
               limit: int = 1000) -> list[EventRow]:
        q = select(EventRow).where(EventRow.id > after_id).limit(limit)
        if job_id is not None:  # ordered along the job_id index (SQLite would scan every event by id)
            q = q.where(EventRow.job_id == job_id).order_by(EventRow.job_id, EventRow.id)
        else:
            q = q.order_by(EventRow.id)
        if tenant is not None:
            q = q.where(EventRow.tenant == tenant)
        with self._read() as s:
            if s is getattr(self._batch, "s", None):
                self._flush_events(s)  # (this thread's batch sees its own events)
            return list(s.scalars(q))


_JOBS, _EVENTS, _META, _PROGRESS = (Base.metadata.tables[t] for t in ("jobs", "events", "meta", "progress"))
# the reads made once (the writes are the driver's own SQL: _sets, _event_sql, _submit_sql)
_HELD = select(_JOBS.c.id, _JOBS.c.tenant, _JOBS.c.state, _JOBS.c.kind, _JOBS.c.placement,
               _JOBS.c.releasing).where(_JOBS.c.state.in_([str(x) for x in HELD])).order_by(_JOBS.c.seq)
PROGRESS_KEYS = ("step", "steps_per_s", "start_step", "tiers")  # (what /metrics reads of the progress)
_HELD_ACCOUNTING = _HELD.add_columns(*(_JOBS.c[k] for k in (
    "restarts", "preemptions", "lost_s", "lost_steps", "held_s", "productive_s", "attempt_launched_s")),
    *(_PROGRESS.c.doc[k] for k in PROGRESS_KEYS)).outerjoin_from(_JOBS, _PROGRESS,
                                                                  _PROGRESS.c.job_id == _JOBS.c.id)


def _job_defaults() -> dict[str, Any]:
    """A new job's column defaults, as the ORM fills them in (a fresh ``{}`` for each JSON one)."""
    return {name: make(None) if make is not None else value for name, make, value in _DEFAULTS}


# (column, its default's function or None, its value): read from the table once (the functions are ours: they
# use no context)
_DEFAULTS: list[tuple[str, Callable[[Any], Any] | None, Any]] = [
    (c.name, cast("Callable[[Any], Any]", c.default.arg), None)
    if isinstance(c.default, CallableColumnDefault) else (c.name, None, c.default.arg)
    for c in _JOBS.c if isinstance(c.default, CallableColumnDefault | ScalarElementColumnDefault)]


def _new_row(values: Mapping[str, Any]) -> JobRow:
    """A new job's row from its column values, as a read of the store gives it: every column loaded (those not
    written NULL, as stored), no change tracked (the ORM's constructor records each as a change nothing
    flushes, at ~20x the cost); no progress yet."""
    row = _NEW_JOB()
    row.__dict__.update(_NULLS, **values, progress={})
    return row


_NEW_JOB = JobRow.__mapper__.class_manager.new_instance


_JSON_COLS = frozenset(c.name for c in _JOBS.c if isinstance(c.type, JSON))  # (written as JSON text)
_JOB_COLS = frozenset(c.name for c in _JOBS.c)
_NULLS = dict.fromkeys(sorted(_JOB_COLS))  # (a new row's columns not written: NULL)
# the columns a submit writes: those with a default and the spec's (the others NULL, as the ORM leaves them)
_SUBMIT_COLS = tuple(dict.fromkeys([*_job_defaults(), "seq", "tenant", "name", "spec", "kind", "priority",
                                    "min_gpus", "max_gpus", "multiple_of", "max_restarts", "submit_s",
                                    "ckpt_location"]))


@functools.cache
def _submit_sql(q: str) -> tuple[str, str]:
    """A submit's statements with the driver's parameter marker ``q``: the counter moved on by the number of
    jobs, returning its new value, and the job's insert (written out once: the driver runs them as is)."""
    return (f"UPDATE meta SET value = CAST(CAST(value AS BIGINT) + {q} AS VARCHAR(20)) WHERE key = 'job_seq' "
            "RETURNING value",
            f"INSERT INTO jobs ({', '.join(_SUBMIT_COLS)}) VALUES ({', '.join([q] * len(_SUBMIT_COLS))})")


def _event_row(now_s: float, job_id: str | None, tenant: str | None, kind: str, message: str,
               data: dict | None, from_state: str | None = None,
               to_state: str | None = None) -> tuple[Any, ...]:
    """An event's values in the order of :func:`_event_sql`'s columns."""
    return (now_s, job_id, tenant, kind, from_state, to_state, message,
            to_json(data) if data is not None else None)


@functools.cache
def _event_sql(q: str) -> str:
    """An event's insert with the driver's parameter marker ``q``."""
    return ("INSERT INTO events (time_s, job_id, tenant, kind, from_state, to_state, message, data) "
            f"VALUES ({q}, {q}, {q}, {q}, {q}, {q}, {q}, {q})")


def _progress_rows(docs: dict[str, dict]) -> list[tuple[str, str]]:
    """(job id, JSON text) of jobs' progress documents (job id -> doc), as :meth:`Store._put_progress` stores
    them."""
    return [(jid, to_json(doc)) for jid, doc in docs.items()]


def _one_slash(location: str | None) -> str | None:
    """A checkpoint location as recorded: with at most one ``/`` at its end (the same location to
    :func:`tidal.control.locations.overlaps`), so that :meth:`Store.ckpt_locations` finds it by its name."""
    if location is None or not location.endswith("//"):
        return location
    return location.rstrip("/") + "/"


def loaded(row: JobRow, names: tuple[str, ...]) -> tuple[Any, ...]:
    """The row's values of ``names`` read from its loaded state in one call of C, not through SQLAlchemy's
    instrumented attributes (~0.8 us a read; the loop reads thousands a step of rows it loaded whole); if one
    is not loaded, all through their descriptors (which load it)."""
    try:
        return _getter(names)(row.__dict__)
    except KeyError:
        return tuple(getattr(row, k) for k in names)


@functools.cache
def _getter(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """The values of ``names`` in a dict, as a tuple (one name too)."""
    get = itemgetter(*names)
    return get if len(names) > 1 else lambda d: (get(d),)


def written(row: JobRow, values: Mapping[str, Any]) -> JobRow:
    """The caller's row brought to what was just written of it, into the row's loaded state: a row of the
    store is detached and never flushed by the ORM (the store writes its own statements), so the instrumented
    attributes' change tracking (~0.8 us an attribute; thousands a step) keeps nothing of use."""
    row.__dict__.update(values)
    return row


def _count(result: Any) -> int:
    """Rows a DELETE touched (a cursor result's ``rowcount``)."""
    return int(getattr(result, "rowcount", 0) or 0)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()
