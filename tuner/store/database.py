"""The results database's connection: an SQLite file or a PostgreSQL server, reads and writes of
records, and the handling of what can go wrong with the file or the server.

Every access goes through :meth:`Store.session`, which commits, rolls back and translates
errors; a locked database is waited for and retried, a corrupt or foreign file is refused with a
:class:`~tuner.errors.DatabaseError` and never written to. Writes that concurrent workers may
race on (a trial's row, a kernel's claim, a winner) are insert-or-ignore followed by a locked
read, so the first writer wins and nothing is written twice.
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import zlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.orm import Session

from .. import limits
from ..errors import DatabaseError
from ..paths import is_shipped
from .records import Baseline, CalibrationPoint, Measurement, TrialRecord, Winner, utcnow
from .schema import (STACK_COLUMNS, WINNER_KEY, Base, BaselineModel, CalibrationModel, ClaimModel, HistoryModel,
                     TrialModel, WinnerModel, columns_of, record_of)

T = TypeVar("T")

SQLITE_MAGIC = b"SQLite format 3\x00"
# PostgreSQL advisory lock held while creating tables: concurrent CREATE TABLEs of one name fail.
SCHEMA_LOCK_KEY = zlib.crc32(b"linattn-tuner schema")


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
        if readonly:
            # What is there to read: a database written before a table or a column existed lacks it.
            self._columns = self._retrying(self._columns_in_file)
        else:
            if self.path is not None:
                self._retrying(self._check_writable)
            with self.schema_lock():
                self._retrying(lambda: Base.metadata.create_all(self._engine))
                self._retrying(self._add_new_columns)
            self._columns = {name: set(table.columns.keys()) for name, table in Base.metadata.tables.items()}

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

    def _columns_in_file(self) -> dict[str, set[str]]:
        """Our tables in the database and the columns each has there."""
        inspector = sa.inspect(self._engine)
        return {name: {c["name"] for c in inspector.get_columns(name)}
                for name in inspector.get_table_names() if name in Base.metadata.tables}

    def _add_new_columns(self) -> None:
        """Add to a table written by an earlier version the columns added since (each has a server
        default, which the rows already there take)."""
        present = self._columns_in_file()
        with self._engine.begin() as conn:
            for name, table in Base.metadata.tables.items():
                for column in table.columns:
                    if column.name not in present[name]:
                        type_ = column.type.compile(dialect=self._engine.dialect)
                        default = column.server_default.arg.compile(dialect=self._engine.dialect)
                        conn.exec_driver_sql(f'ALTER TABLE {name} ADD COLUMN {column.name} {type_} '
                                             f'NOT NULL DEFAULT {default}')

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

    def _has(self, model) -> bool:
        return model.__tablename__ in self._columns

    def _rows(self, model, *, where: dict, order_by: tuple) -> Callable[[Session], list]:
        """A read of ``model``'s rows for :func:`record_of`: a column that an older file lacks
        (read-only, so it was not added) reads as its default."""
        present = self._columns[model.__tablename__]
        columns = [c if c.name in present else sa.literal(c.default.arg, c.type).label(c.name)
                   for c in model.__table__.columns]
        query = sa.select(*columns).filter_by(**where).order_by(*order_by)
        return lambda s: list(s.execute(query))

    def _append(self, model, record: T) -> T:
        """``record`` inserted as a new row of ``model``; returned with its id."""
        values = columns_of(record)

        def work(s: Session) -> T:
            row = model(**values)
            s.add(row)
            s.flush()
            return record_of(type(record), row)

        return self.run(work)

    # ---- trials

    def record_trial(self, record: TrialRecord) -> bool:
        """Insert ``record`` unless its (study, number) is already there. True if inserted."""
        values = columns_of(record)
        return self.run(lambda s: _insert_ignore(s, TrialModel, values, ("study", "number")))

    def trials(self, study: str | None = None, digest: str | None = None) -> list[TrialRecord]:
        """Recorded trials, of one study or all, of one kernel (digest) or all, in recording order."""
        if not self._has(TrialModel):
            return []
        where = {k: v for k, v in (("study", study), ("digest", digest)) if v is not None}
        return [record_of(TrialRecord, r) for r in self.run(self._rows(TrialModel, where=where, order_by=(TrialModel.id,)))]

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
        values = columns_of(winner)
        values.update(bucket_bh=winner.bucket.bh, bucket_t=winner.bucket.t, spread=winner.spread)

        def work(s: Session) -> Winner:
            # Insert first, then read the row locked: concurrent workers writing the same key
            # queue up here, and each compares with what the one before it kept.
            inserted = _insert_ignore(s, WinnerModel, values, WINNER_KEY)
            key = {k: values[k] for k in WINNER_KEY}
            row = s.scalars(sa.select(WinnerModel).filter_by(**key).with_for_update()).one()
            if not inserted:
                if row.median_ms <= winner.median_ms:
                    return record_of(Winner, row)
                for k, v in values.items():
                    setattr(row, k, v)
                s.flush()
            s.add(HistoryModel(winner_id=row.id, status=gate_status, median_ms=winner.median_ms,
                               p10_ms=winner.p10_ms, p90_ms=winner.p90_ms, gate_errors=winner.gate_errors,
                               digest=winner.digest, measured_at=winner.updated_at,
                               **{f: values[f] for f in STACK_COLUMNS}))
            return record_of(Winner, row)

        return self.run(work)

    def winners(self, **where) -> list[Winner]:
        """Stored winners whose columns equal ``where`` (e.g. ``variant="gdn", dk=128``)."""
        if not self._has(WinnerModel):
            return []
        return [record_of(Winner, r) for r in self.run(self._rows(WinnerModel, where=where, order_by=(WinnerModel.id,)))]

    # ---- history

    def add_measurement(self, measurement: Measurement) -> Measurement:
        """Append a re-measurement of a stored winner."""
        return self._append(HistoryModel, measurement)

    def history(self, winner_id: int | None = None) -> list[Measurement]:
        """Measurements of one winner or of all, oldest first."""
        if not self._has(HistoryModel):
            return []
        query = sa.select(HistoryModel).order_by(HistoryModel.measured_at, HistoryModel.id)
        if winner_id is not None:
            query = query.where(HistoryModel.winner_id == winner_id)
        return self.run(lambda s: [record_of(Measurement, r) for r in s.scalars(query)])

    # ---- FLA's baselines

    def add_baseline(self, baseline: Baseline) -> Baseline:
        """Append a measurement of FLA's op."""
        return self._append(BaselineModel, baseline)

    def baselines(self, **where) -> list[Baseline]:
        """Measurements of FLA's op whose columns equal ``where`` (e.g. ``variant="gdn", gpu=...``), oldest first."""
        if not self._has(BaselineModel):
            return []
        read = self._rows(BaselineModel, where=where, order_by=(BaselineModel.measured_at, BaselineModel.id))
        return [record_of(Baseline, r) for r in self.run(read)]

    # ---- calibration

    def add_calibration(self, point: CalibrationPoint) -> None:
        """Insert ``point``, replacing an earlier one of the same source, TileLang and CUDA."""
        values = columns_of(point)

        def work(s: Session) -> None:
            s.execute(sa.delete(CalibrationModel).filter_by(digest=point.digest, tilelang=point.tilelang,
                                                            cuda=point.cuda))
            s.add(CalibrationModel(**values))

        self.run(work)

    def calibration(self, **where) -> list[CalibrationPoint]:
        """Calibration points whose columns equal ``where`` (e.g. ``variant="kda"``)."""
        if not self._has(CalibrationModel):
            return []
        query = sa.select(CalibrationModel).filter_by(**where).order_by(CalibrationModel.id)
        return self.run(lambda s: [record_of(CalibrationPoint, r) for r in s.scalars(query)])


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

