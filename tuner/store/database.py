"""The results database: every trial's outcome, the winners, their re-measurements and the
model's calibration points, in the same database as the Optuna study: an SQLite file, or a
PostgreSQL server that workers on several machines share.

Optuna keeps its own tables (``studies``, ``trials``, ...) in that database, so ours carry a
``tuner_`` prefix: ``tuner_trials``, ``tuner_winners``, ``tuner_history``, ``tuner_calibration``,
``tuner_claims``. Every access goes through :meth:`Store.session`, which commits, rolls back and
translates errors; a locked database is waited for and retried, a corrupt or foreign file is
refused with a :class:`~tuner.errors.DatabaseError` and never written to. Writes that concurrent
workers may race on (a trial's row, a kernel's claim, a winner) are insert-or-ignore followed by
a locked read, so the first writer wins and nothing is written twice. Rows leave this module as
frozen dataclasses.
"""
from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from .. import limits
from ..status import Status
from ..stack import Stack
from ..errors import DatabaseError
from ..paths import is_shipped
from ..problem import Problem

T = TypeVar("T")

# Outcomes of a trial, in pipeline order (the values the status column may hold).
STATUSES = tuple(s.value for s in Status)
SQLITE_MAGIC = b"SQLite format 3\x00"
# PostgreSQL advisory lock held while creating tables: concurrent CREATE TABLEs of one name fail.
SCHEMA_LOCK_KEY = zlib.crc32(b"linattn-tuner schema")


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


# --------------------------------------------------------------------------------------------
# Shape buckets


@dataclass(frozen=True, order=True)
class ShapeBucket:
    """A power-of-two bucket of the shape a kernel runs at.

    ``batch * heads`` is the parallel extent of every template's grid and ``seqlen`` the
    sequential one; each is rounded to the nearest power of two (in log space), so shapes
    within a factor of ~1.4 share a winner.

    Args:
        bh (int): the bucket of ``batch * heads``.
        t (int): the bucket of ``seqlen``.
    """

    bh: int
    t: int

    @property
    def label(self) -> str:
        return f"bh{self.bh}-t{self.t}"

    def distance(self, other: ShapeBucket) -> int:
        """Steps of a factor two between the buckets, summed over both axes."""
        return abs(_log2(self.bh) - _log2(other.bh)) + abs(_log2(self.t) - _log2(other.t))


def _log2(n: int) -> int:
    return n.bit_length() - 1


def _round_pow2(n: int) -> int:
    return 2 ** round(math.log2(n))


def shape_bucket(batch: int, seqlen: int, heads: int) -> ShapeBucket:
    """The :class:`ShapeBucket` of a ``[batch, seqlen, heads]`` problem."""
    if min(batch, seqlen, heads) < 1:
        raise ValueError(f"shape must be positive, got batch={batch}, seqlen={seqlen}, heads={heads}")
    return ShapeBucket(_round_pow2(batch * heads), _round_pow2(seqlen))


# --------------------------------------------------------------------------------------------
# Tables


class Base(DeclarativeBase):
    type_annotation_map = {dict: sa.JSON, Any: sa.JSON}


class _ProblemColumns:
    variant: Mapped[str] = mapped_column(sa.String(32))
    dk: Mapped[int]
    dv: Mapped[int]
    dtype: Mapped[str] = mapped_column(sa.String(8))
    batch: Mapped[int]
    seqlen: Mapped[int]
    heads: Mapped[int]


class _EnvironmentColumns:
    gpu: Mapped[str] = mapped_column(sa.String(128))
    arch: Mapped[str] = mapped_column(sa.String(16))
    tilelang: Mapped[str] = mapped_column(sa.String(64))
    cuda: Mapped[str] = mapped_column(sa.String(64))
    driver: Mapped[str] = mapped_column(sa.String(64))
    torch: Mapped[str] = mapped_column(sa.String(64))


class TrialModel(_ProblemColumns, _EnvironmentColumns, Base):
    """One row per finished Optuna trial; (study, number) is unique so a resumed or shared
    study never records a trial twice."""

    __tablename__ = "tuner_trials"
    __table_args__ = (
        sa.UniqueConstraint("study", "number", name="uq_tuner_trials_study_number"),
        sa.CheckConstraint(f"status IN ({', '.join(repr(s) for s in STATUSES)})", name="ck_tuner_trials_status"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    study: Mapped[str] = mapped_column(sa.String(256), index=True)
    number: Mapped[int]
    config: Mapped[dict]
    digest: Mapped[str | None] = mapped_column(sa.String(32), index=True)
    status: Mapped[str] = mapped_column(sa.String(16))
    reason: Mapped[str] = mapped_column(sa.Text, default="")
    repeat_of: Mapped[int | None]
    prediction: Mapped[dict | None]
    compile_report: Mapped[dict | None]
    gate_errors: Mapped[dict | None]
    median_ms: Mapped[float | None]
    p10_ms: Mapped[float | None]
    p90_ms: Mapped[float | None]
    compile_seconds: Mapped[float | None]
    gpu_seconds: Mapped[float | None]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime]


# What changes the answer to "which config is fastest": everything in a winner's key.
WINNER_KEY = ("variant", "dk", "dv", "dtype", "bucket_bh", "bucket_t",
              "gpu", "arch", "tilelang", "cuda", "driver", "digest")


class WinnerModel(_ProblemColumns, _EnvironmentColumns, Base):
    """The fastest config that passed the gate, per key (:data:`WINNER_KEY`)."""

    __tablename__ = "tuner_winners"
    __table_args__ = (sa.UniqueConstraint(*WINNER_KEY, name="uq_tuner_winners_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    bucket_bh: Mapped[int]
    bucket_t: Mapped[int]
    digest: Mapped[str] = mapped_column(sa.String(32))
    config: Mapped[dict]
    median_ms: Mapped[float]
    p10_ms: Mapped[float]
    p90_ms: Mapped[float]
    spread: Mapped[float]
    gate_errors: Mapped[dict]
    study: Mapped[str] = mapped_column(sa.String(256))
    trial_number: Mapped[int]
    updated_at: Mapped[datetime]


class HistoryModel(_EnvironmentColumns, Base):
    """A measurement of a winner: at tuning time and at every later ``tune regress``."""

    __tablename__ = "tuner_history"

    id: Mapped[int] = mapped_column(primary_key=True)
    winner_id: Mapped[int] = mapped_column(sa.ForeignKey("tuner_winners.id"), index=True)
    status: Mapped[str] = mapped_column(sa.String(16))
    median_ms: Mapped[float | None]
    p10_ms: Mapped[float | None]
    p90_ms: Mapped[float | None]
    gate_errors: Mapped[dict | None]
    digest: Mapped[str | None] = mapped_column(sa.String(64))  # the kernel source that was timed
    measured_at: Mapped[datetime]


class ClaimModel(Base):
    """Which trial of a study judges a kernel (digest): the first to claim it. Workers that
    propose the same kernel meanwhile wait for that trial's outcome instead of judging it again."""

    __tablename__ = "tuner_claims"
    __table_args__ = (sa.UniqueConstraint("study", "digest", name="uq_tuner_claims_study_digest"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    study: Mapped[str] = mapped_column(sa.String(256))
    digest: Mapped[str] = mapped_column(sa.String(32))
    number: Mapped[int]
    claimed_at: Mapped[datetime]


class CalibrationModel(Base):
    """The register model's prediction beside what ptxas reported, per compiled kernel source."""

    __tablename__ = "tuner_calibration"
    __table_args__ = (sa.UniqueConstraint("digest", "tilelang", "cuda", name="uq_tuner_calibration_digest"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    variant: Mapped[str] = mapped_column(sa.String(32))
    dk: Mapped[int]
    dv: Mapped[int]
    dtype: Mapped[str] = mapped_column(sa.String(8))
    config: Mapped[dict]
    digest: Mapped[str] = mapped_column(sa.String(32))
    predicted_registers: Mapped[int]
    predicted_smem_bytes: Mapped[int]
    predicted_spills: Mapped[bool]
    ptxas_registers: Mapped[int]
    ptxas_spill_bytes: Mapped[int]
    ptxas_smem_bytes: Mapped[int]
    ptxas_wgmma_serialized: Mapped[bool]
    report: Mapped[dict | None]
    tilelang: Mapped[str] = mapped_column(sa.String(64))
    cuda: Mapped[str] = mapped_column(sa.String(64))
    created_at: Mapped[datetime]


# --------------------------------------------------------------------------------------------
# Rows as they leave the module


@dataclass(frozen=True)
class TrialRecord:
    """One trial's outcome. ``problem``'s shape is the one timed; ``repeat_of`` names the
    earlier trial whose kernel (same digest) this trial re-proposed, reusing its outcome."""

    study: str
    number: int
    problem: Problem
    config: dict
    status: str
    stack: Stack
    reason: str = ""
    digest: str | None = None
    repeat_of: int | None = None
    prediction: dict | None = None
    compile_report: dict | None = None
    gate_errors: dict | None = None
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    compile_seconds: float | None = None
    gpu_seconds: float | None = None
    started_at: datetime | None = None
    finished_at: datetime = field(default_factory=utcnow)
    id: int | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")


@dataclass(frozen=True)
class Winner:
    """The fastest gated config of a key; ``problem``'s shape is the one it was timed at."""

    problem: Problem
    stack: Stack
    digest: str
    config: dict
    median_ms: float
    p10_ms: float
    p90_ms: float
    gate_errors: dict
    study: str
    trial_number: int
    updated_at: datetime = field(default_factory=utcnow)
    id: int | None = None

    @property
    def bucket(self) -> ShapeBucket:
        return shape_bucket(self.problem.batch, self.problem.seqlen, self.problem.heads)

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative noise of the timing."""
        return (self.p90_ms - self.p10_ms) / self.median_ms


@dataclass(frozen=True)
class Measurement:
    """One (re-)measurement of a stored winner."""

    winner_id: int
    status: str
    stack: Stack
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    gate_errors: dict | None = None
    digest: str | None = None
    measured_at: datetime = field(default_factory=utcnow)
    id: int | None = None


@dataclass(frozen=True)
class CalibrationPoint:
    """The model's prediction and ptxas' report for one compiled kernel source."""

    variant: str
    dk: int
    dv: int
    dtype: str
    config: dict
    digest: str
    predicted_registers: int
    predicted_smem_bytes: int
    predicted_spills: bool
    ptxas_registers: int
    ptxas_spill_bytes: int
    ptxas_smem_bytes: int
    ptxas_wgmma_serialized: bool
    tilelang: str
    cuda: str
    report: dict | None = None
    created_at: datetime = field(default_factory=utcnow)
    id: int | None = None


_PROBLEM_FIELDS = ("variant", "dk", "dv", "dtype", "batch", "seqlen", "heads")
_ENV_FIELDS = ("gpu", "arch", "tilelang", "cuda", "driver", "torch")


def _problem_of(row) -> Problem:
    return Problem(**{f: getattr(row, f) for f in _PROBLEM_FIELDS})


def _stack_of(row) -> Stack:
    return Stack(**{f: getattr(row, f) for f in _ENV_FIELDS})


def _flat(obj, nested: dict[str, tuple[str, ...]]) -> dict:
    """A record's fields as column values, the nested problem and stack spread out."""
    out = {}
    for name in obj.__dataclass_fields__:
        value = getattr(obj, name)
        if name in nested:
            out.update({f: getattr(value, f) for f in nested[name]})
        elif name != "id":
            out[name] = value
    return out


def _trial_of(row: TrialModel) -> TrialRecord:
    plain = {f: getattr(row, f) for f in TrialRecord.__dataclass_fields__ if f not in ("problem", "stack")}
    return TrialRecord(problem=_problem_of(row), stack=_stack_of(row), **plain)


def _winner_of(row: WinnerModel) -> Winner:
    plain = {f: getattr(row, f) for f in Winner.__dataclass_fields__ if f not in ("problem", "stack")}
    return Winner(problem=_problem_of(row), stack=_stack_of(row), **plain)


def _measurement_of(row: HistoryModel) -> Measurement:
    plain = {f: getattr(row, f) for f in Measurement.__dataclass_fields__ if f != "stack"}
    return Measurement(stack=_stack_of(row), **plain)


def _calibration_of(row: CalibrationModel) -> CalibrationPoint:
    return CalibrationPoint(**{f: getattr(row, f) for f in CalibrationPoint.__dataclass_fields__})


# --------------------------------------------------------------------------------------------
# The store


def sqlite_path(path_or_url: str | os.PathLike) -> str | None:
    """The file behind a path or an ``sqlite:///`` URL; None for another database's URL."""
    text = os.fspath(path_or_url)
    if "://" not in text:
        return os.path.abspath(text)
    url = sa.engine.make_url(text)
    return os.path.abspath(url.database) if url.get_backend_name() == "sqlite" and url.database else None


def check_sqlite_file(path: str) -> None:
    """Refuse a file that is not a sound SQLite database, reading it only.

    A missing or empty file is fine (SQLite creates the database in it).
    """
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb") as f:
        if f.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
            raise DatabaseError(f"{path} is not an SQLite database; it was left untouched")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1.0)
        try:
            problems = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]
        finally:
            conn.close()
    except sqlite3.OperationalError as e:
        if "locked" in str(e) or "busy" in str(e):
            return  # in use by another process, hence a working database; Store waits for it
        raise DatabaseError(f"{path} is a damaged SQLite database ({e}); it was left untouched") from None
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"{path} is a damaged SQLite database ({e}); it was left untouched") from None
    if problems != ["ok"]:
        raise DatabaseError(f"{path} is a damaged SQLite database ({problems[0]}); it was left untouched")


class _Locked(DatabaseError):
    """The database is locked by another connection; retried by Store.run()."""


def _is_lock(e: exc.DBAPIError) -> bool:
    text = str(e.orig).lower()
    return "locked" in text or "busy" in text


class Store:
    """The results database at ``path_or_url`` (a file path or an SQLAlchemy URL).

    Args:
        path_or_url (str | os.PathLike): an SQLite file (created when missing) or a URL such
            as ``postgresql://host/db``.
        readonly (bool): open an SQLite file read-only (``mode=ro``): safe beside a running
            tuner, never creates or changes anything. Default: False.
        busy_timeout_s (float): how long to wait for a locked database before giving up with
            a DatabaseError. Default: 60.

    Example::

        store = Store("results.db")
        store.record_trial(record)          # False if (study, number) was already recorded
        store.trials(study="gdn-k128-...")
    """

    def __init__(self, path_or_url: str | os.PathLike, *, readonly: bool = False,
                 busy_timeout_s: float = limits.DATABASE_BUSY_S):
        self.path = sqlite_path(path_or_url)
        self.readonly = readonly
        self.busy_timeout_s = busy_timeout_s
        if self.path is not None:
            if readonly and not os.path.exists(self.path):
                raise DatabaseError(f"{self.path} does not exist")
            check_sqlite_file(self.path)
            self.url = f"sqlite:///{self.path}"
            self._engine = self._sqlite_engine()
        else:
            if readonly:
                raise DatabaseError("read-only access is only offered for SQLite files")
            self.url = os.fspath(path_or_url)
            self._engine = sa.create_engine(self.url, pool_pre_ping=True)
        self._has_tables = True
        if readonly:
            self._has_tables = self._retrying(lambda: sa.inspect(self._engine).has_table(TrialModel.__tablename__))
        else:
            if self.path is not None:
                self._retrying(self._check_writable)
            with self.schema_lock():
                self._retrying(lambda: Base.metadata.create_all(self._engine))

    def _sqlite_engine(self) -> sa.Engine:
        # SQLite's own busy handler waits up to a second per attempt; _retrying() retries with
        # backoff up to busy_timeout_s, so the total wait is bounded and reported.
        if self.readonly:
            path = self.path
            engine = sa.create_engine("sqlite://", creator=lambda: sqlite3.connect(
                f"file:{path}?mode=ro", uri=True, timeout=1.0, check_same_thread=False))
        else:
            engine = sa.create_engine(self.url, connect_args={"timeout": 1.0, "check_same_thread": False})
        begin = "BEGIN" if self.readonly else "BEGIN IMMEDIATE"

        # WAL: readers never block the tuner. The shipped database keeps (or gets back) rollback-journal
        # mode: a WAL file needs -wal/-shm files beside it to be read, and an installed package's
        # folder may be read-only.
        journal_mode = "DELETE" if is_shipped(self.path) else "WAL"

        # pysqlite's implicit transactions start late and cannot wait for a write lock; take the
        # lock at BEGIN instead (SQLAlchemy's documented recipe for SQLite transactions).
        @event.listens_for(engine, "connect")
        def _connect(dbapi_connection, _record):
            dbapi_connection.isolation_level = None
            if not self.readonly:
                dbapi_connection.execute(f"PRAGMA journal_mode={journal_mode}")

        @event.listens_for(engine, "begin")
        def _begin(conn):
            conn.exec_driver_sql(begin)

        return engine

    def _check_writable(self) -> None:
        """Refuse a file this process may read but not write, before any work is done for it.

        SQLite opens such a file read-only without a word and fails at the first commit; file
        permissions say nothing for root, so a write is tried in a transaction rolled back."""
        with self._engine.connect() as conn:
            try:
                conn.exec_driver_sql("CREATE TABLE tuner_write_probe (x INTEGER)")
            except exc.OperationalError as e:
                if "readonly" not in str(e.orig):
                    raise
                raise DatabaseError(f"{self.path} is read-only for this user; name a database you may write "
                                    "with --db (it was left untouched)") from None
            finally:
                conn.rollback()

    def _retrying(self, action: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.busy_timeout_s
        delay = 0.05
        while True:
            try:
                try:
                    return action()
                except exc.DBAPIError as e:
                    raise self._translate(e) from None
            except _Locked:
                if time.monotonic() >= deadline:
                    raise DatabaseError(f"{self.where} stayed locked for more than {self.busy_timeout_s:g} s "
                                        "(another process holds it)") from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _translate(self, e: exc.DBAPIError) -> DatabaseError:
        if isinstance(e, exc.OperationalError) and _is_lock(e):
            return _Locked(f"{self.where} is locked")
        return DatabaseError(f"{self.where}: {e.orig}")

    @property
    def where(self) -> str:
        return self.path or self.url

    @contextlib.contextmanager
    def schema_lock(self) -> Iterator[None]:
        """Hold off other processes that create tables in this database (ours or Optuna's) until
        the block ends. On PostgreSQL an advisory lock; on SQLite nothing, because our DDL runs
        in BEGIN IMMEDIATE transactions already, and a held file lock would block Optuna's own
        connection in the same process."""
        if self.path is not None:
            yield
            return
        try:
            conn = self._engine.connect()
            conn.execute(sa.select(sa.func.pg_advisory_lock(SCHEMA_LOCK_KEY)))
        except exc.DBAPIError as e:
            raise self._translate(e) from None
        try:
            yield
        finally:
            conn.execute(sa.select(sa.func.pg_advisory_unlock(SCHEMA_LOCK_KEY)))
            conn.close()

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits on success, rolls back on any error, and turns database
        errors into DatabaseError. Prefer :meth:`run`, which also retries a locked database."""
        session = Session(self._engine, expire_on_commit=False)
        try:
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise
            finally:
                session.close()
        except exc.DBAPIError as e:
            raise self._translate(e) from None

    def run(self, work: Callable[[Session], T]) -> T:
        """``work(session)`` in one transaction, retried while the database is locked."""
        def attempt():
            with self.session() as s:
                return work(s)
        return self._retrying(attempt)

    def close(self) -> None:
        self._engine.dispose()

    # ---- trials

    def record_trial(self, record: TrialRecord) -> bool:
        """Insert ``record`` unless its (study, number) is already there. True if inserted."""
        values = _flat(record, {"problem": _PROBLEM_FIELDS, "stack": _ENV_FIELDS})
        return self.run(lambda s: _insert_ignore(s, TrialModel, values, ("study", "number")))

    def trials(self, study: str | None = None, digest: str | None = None) -> list[TrialRecord]:
        """Recorded trials, of one study or all, of one kernel (digest) or all, in recording order."""
        if not self._has_tables:
            return []
        query = sa.select(TrialModel).order_by(TrialModel.id)
        if study is not None:
            query = query.where(TrialModel.study == study)
        if digest is not None:
            query = query.where(TrialModel.digest == digest)
        return self.run(lambda s: [_trial_of(r) for r in s.scalars(query)])

    # ---- claims

    def claim(self, study: str, digest: str, number: int) -> int:
        """Claim the judging of kernel ``digest`` in ``study`` for trial ``number``, unless a
        trial already holds it; returns the number of the trial that holds it."""
        values = {"study": study, "digest": digest, "number": number, "claimed_at": utcnow()}

        def work(s: Session) -> int:
            _insert_ignore(s, ClaimModel, values, ("study", "digest"))
            return s.scalar(sa.select(ClaimModel.number).filter_by(study=study, digest=digest))

        return self.run(work)

    def take_over(self, study: str, digest: str, lost: int, number: int) -> bool:
        """Move the claim of ``digest`` from trial ``lost`` (whose worker died) to trial
        ``number``; False when another trial took it over first."""
        update = (sa.update(ClaimModel).filter_by(study=study, digest=digest, number=lost)
                  .values(number=number, claimed_at=utcnow()))
        return self.run(lambda s: s.execute(update).rowcount == 1)

    # ---- winners

    def write_winner(self, winner: Winner, gate_status: str) -> Winner:
        """Keep ``winner`` if it is the first or the fastest of its key; returns the kept one.

        Only a config that passed the gate may be a winner: ``gate_status`` must be "pass".
        Every write also appends the measurement to the winner's history.
        """
        if gate_status != "pass":
            raise ValueError(f"a winner must have passed the gate, this one is {gate_status!r}")
        values = _flat(winner, {"problem": _PROBLEM_FIELDS, "stack": _ENV_FIELDS})
        values.update(bucket_bh=winner.bucket.bh, bucket_t=winner.bucket.t, spread=winner.spread)

        def work(s: Session) -> Winner:
            # Insert first, then read the row locked: concurrent workers writing the same key
            # queue up here, and each compares with what the one before it kept.
            inserted = _insert_ignore(s, WinnerModel, values, WINNER_KEY)
            key = {k: values[k] for k in WINNER_KEY}
            row = s.scalars(sa.select(WinnerModel).filter_by(**key).with_for_update()).one()
            if not inserted:
                if row.median_ms <= winner.median_ms:
                    return _winner_of(row)
                for k, v in values.items():
                    setattr(row, k, v)
                s.flush()
            s.add(HistoryModel(winner_id=row.id, status=gate_status, median_ms=winner.median_ms,
                               p10_ms=winner.p10_ms, p90_ms=winner.p90_ms, gate_errors=winner.gate_errors,
                               digest=winner.digest, measured_at=winner.updated_at,
                               **{f: values[f] for f in _ENV_FIELDS}))
            return _winner_of(row)

        return self.run(work)

    def winners(self, **where) -> list[Winner]:
        """Stored winners whose columns equal ``where`` (e.g. ``variant="gdn", dk=128``)."""
        if not self._has_tables:
            return []
        query = sa.select(WinnerModel).filter_by(**where).order_by(WinnerModel.id)
        return self.run(lambda s: [_winner_of(r) for r in s.scalars(query)])

    # ---- history

    def add_measurement(self, measurement: Measurement) -> Measurement:
        """Append a re-measurement of a stored winner."""
        values = _flat(measurement, {"stack": _ENV_FIELDS})

        def work(s: Session) -> Measurement:
            row = HistoryModel(**values)
            s.add(row)
            s.flush()
            return _measurement_of(row)

        return self.run(work)

    def history(self, winner_id: int | None = None) -> list[Measurement]:
        """Measurements of one winner or of all, oldest first."""
        if not self._has_tables:
            return []
        query = sa.select(HistoryModel).order_by(HistoryModel.measured_at, HistoryModel.id)
        if winner_id is not None:
            query = query.where(HistoryModel.winner_id == winner_id)
        return self.run(lambda s: [_measurement_of(r) for r in s.scalars(query)])

    # ---- calibration

    def add_calibration(self, point: CalibrationPoint) -> None:
        """Insert ``point``, replacing an earlier one of the same source, TileLang and CUDA."""
        values = _flat(point, {})

        def work(s: Session) -> None:
            s.execute(sa.delete(CalibrationModel).filter_by(digest=point.digest, tilelang=point.tilelang,
                                                            cuda=point.cuda))
            s.add(CalibrationModel(**values))

        self.run(work)

    def calibration(self, **where) -> list[CalibrationPoint]:
        """Calibration points whose columns equal ``where`` (e.g. ``variant="kda"``)."""
        if not self._has_tables:
            return []
        query = sa.select(CalibrationModel).filter_by(**where).order_by(CalibrationModel.id)
        return self.run(lambda s: [_calibration_of(r) for r in s.scalars(query)])


def _insert_ignore(session: Session, model, values: dict, unique: tuple[str, ...]) -> bool:
    """INSERT ... ON CONFLICT DO NOTHING, so concurrent workers may record the same row."""
    dialect = session.get_bind().dialect.name
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    elif dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        raise DatabaseError(f"results databases on {dialect} are not supported (SQLite or PostgreSQL)")
    # RETURNING tells whether a row went in: psycopg reports no rowcount for this statement.
    statement = insert(model).values(**values).on_conflict_do_nothing(index_elements=list(unique))
    return session.execute(statement.returning(model.id)).first() is not None


__all__ = [
    "STATUSES", "WINNER_KEY", "ShapeBucket", "shape_bucket", "Store", "TrialRecord", "Winner",
    "Measurement", "CalibrationPoint", "check_sqlite_file", "sqlite_path",
]
