"""The results database against real SQLite files: idempotent trial rows, winners kept by key,
history, FLA's baselines, calibration, and refusal of foreign, damaged and long-locked files."""
import hashlib
import shutil
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from datetime import datetime

import pytest

from tuner import paths
from tuner.stack import Stack
from tuner.errors import DatabaseError
from tuner.problem import Problem
from tuner.store import (Baseline, CalibrationPoint, Measurement, ShapeBucket, Store, TrialRecord, Winner,
                         shape_bucket)

from sqlite_lock import LOCK_HOLDER

H200 = Stack("NVIDIA H200", "sm_90", "0.1.15", "12.8.93", "570.86.15", "2.13.0")
PROBLEM = Problem("linear", 64, 64)


def trial(number, status="pass", study="s", **kw):
    return TrialRecord(study, number, PROBLEM, {"block_dv": 64, "num_stages": number}, status, H200, **kw)


def winner(median_ms, digest="d1", config=None, env=H200, problem=PROBLEM):
    return Winner(problem, env, digest, config or {"block_dv": 64}, median_ms, median_ms * 0.9, median_ms * 1.2,
                  {"rel_l2": 1e-3}, "s", 0)


def count(path, table):
    with sqlite3.connect(path) as con:
        return con.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


def digest_of(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_trial_rows_round_trip_and_are_recorded_once(tmp_path):
    db = tmp_path / "r.db"
    store = Store(db)
    first = trial(0, median_ms=0.5, p10_ms=0.4, p90_ms=0.6, gate_errors={"o": 1e-3}, prediction={"registers": 200})
    assert store.record_trial(first) is True
    assert store.record_trial(trial(0, status="crash")) is False  # same (study, number): ignored
    assert store.record_trial(trial(0, study="other")) is True
    assert count(db, "tuner_trials") == 2
    (back,) = Store(db).trials(study="s")
    assert back.status == "pass" and back.median_ms == 0.5 and back.gate_errors == {"o": 1e-3}
    assert back.problem == PROBLEM and back.stack == H200 and back.config == first.config
    with pytest.raises(Exception):  # frozen
        back.status = "nan"


def test_unknown_status_is_refused():
    with pytest.raises(ValueError, match="status"):
        trial(0, status="ok")


def test_winner_is_kept_per_key_and_only_replaced_by_a_faster_one(tmp_path):
    store = Store(tmp_path / "r.db")
    assert store.write_winner(winner(1.0), "pass").median_ms == 1.0
    assert store.write_winner(winner(2.0, config={"block_dv": 32}), "pass").median_ms == 1.0
    kept = store.write_winner(winner(0.5, config={"block_dv": 16}), "pass")
    assert kept.median_ms == 0.5 and kept.config == {"block_dv": 16}
    store.write_winner(winner(3.0, digest="d2"), "pass")  # another template digest: another key
    other_gpu = Stack("NVIDIA H100 80GB HBM3", *[getattr(H200, f) for f in ("arch", "tilelang", "cuda",
                                                                                 "driver", "torch")])
    store.write_winner(winner(3.0, env=other_gpu), "pass")
    store.write_winner(winner(3.0, problem=Problem("linear", 64, 64, seqlen=1024)), "pass")
    rows = store.winners(variant="linear")
    assert sorted(w.median_ms for w in rows) == [0.5, 3.0, 3.0, 3.0]
    # the two writes that changed the first key are its history; the slower one is not
    first = next(w for w in rows if w.digest == "d1" and w.stack == H200 and w.problem.seqlen == 8192)
    assert [m.median_ms for m in store.history(first.id)] == [1.0, 0.5]
    assert first.spread == pytest.approx((0.6 - 0.45) / 0.5)


def test_a_winner_must_have_passed_the_gate(tmp_path):
    store = Store(tmp_path / "r.db")
    with pytest.raises(ValueError, match="passed the gate"):
        store.write_winner(winner(1.0), "mismatch")
    assert store.winners() == []


def test_history_and_calibration(tmp_path):
    store = Store(tmp_path / "r.db")
    w = store.write_winner(winner(1.0), "pass")
    store.add_measurement(Measurement(w.id, "nan", H200, gate_errors={"o": float("inf")}))
    assert [m.status for m in store.history(w.id)] == ["pass", "nan"]
    point = dict(variant="linear", dk=64, dv=64, dtype="bf16", config={"block_dv": 64}, digest="d1",
                 predicted_registers=200, predicted_smem_bytes=1024, predicted_spills=False, ptxas_registers=190,
                 ptxas_spill_bytes=0, ptxas_smem_bytes=1024, ptxas_wgmma_serialized=False, tilelang="0.1.15",
                 cuda="12.8.93")
    store.add_calibration(CalibrationPoint(**point))
    store.add_calibration(CalibrationPoint(**{**point, "predicted_registers": 188}))  # refit: replaces
    (back,) = store.calibration(variant="linear")
    assert back.predicted_registers == 188 and back.ptxas_registers == 190


def test_shape_buckets_round_to_powers_of_two():
    assert shape_bucket(4, 8192, 16) == ShapeBucket(64, 8192)
    assert shape_bucket(3, 6000, 16) == ShapeBucket(64, 8192)  # 48 -> 64, log2(6000) = 12.55 -> 8192
    assert shape_bucket(1, 1000, 1).label == "bh1-t1024"
    assert ShapeBucket(64, 8192).distance(ShapeBucket(16, 2048)) == 4
    with pytest.raises(ValueError):
        shape_bucket(0, 1, 1)


def test_a_file_that_is_not_sqlite_is_refused_and_left_untouched(tmp_path):
    db = tmp_path / "notes.db"
    db.write_text("these are my notes, not a database\n" * 100)
    before = digest_of(db)
    with pytest.raises(DatabaseError, match="not an SQLite database"):
        Store(db)
    assert digest_of(db) == before


def test_a_damaged_sqlite_file_is_refused_and_left_untouched(tmp_path):
    db = tmp_path / "r.db"
    store = Store(db)
    for n in range(300):
        store.record_trial(trial(n, reason="x" * 200))
    store.close()
    with sqlite3.connect(db) as con:  # fold the WAL in so the damage below hits live pages
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.execute("PRAGMA journal_mode=DELETE")
    data = bytearray(db.read_bytes())
    data[4096:4096 * 6] = b"\xa5" * (4096 * 5)
    db.write_bytes(bytes(data))
    before = digest_of(db)
    with pytest.raises(DatabaseError, match="damaged"):
        Store(db)
    assert digest_of(db) == before


def hold_lock(db, seconds):
    proc = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(db), str(seconds)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_locked_database_is_waited_for(tmp_path):
    db = tmp_path / "r.db"
    store = Store(db)
    holder = hold_lock(db, 2.0)
    start = time.monotonic()
    assert store.record_trial(trial(0))
    assert time.monotonic() - start > 1.0  # it waited for the other process
    holder.wait()
    assert count(db, "tuner_trials") == 1


def test_a_database_locked_for_too_long_is_a_clear_error(tmp_path):
    db = tmp_path / "r.db"
    store = Store(db, busy_timeout_s=1.0)
    holder = hold_lock(db, 6.0)
    try:
        with pytest.raises(DatabaseError, match="locked for more than 1 s"):
            store.record_trial(trial(0))
    finally:
        holder.kill()
        holder.wait()
    assert store.record_trial(trial(0))  # nothing was lost: it works once the lock is gone


def test_readonly_store_reads_beside_a_writer_and_changes_nothing(tmp_path):
    db = tmp_path / "r.db"
    Store(db).write_winner(winner(1.0), "pass")
    holder = hold_lock(db, 3.0)  # a tuner in the middle of a write transaction
    try:
        start = time.monotonic()
        assert [w.median_ms for w in Store(db, readonly=True).winners()] == [1.0]
        assert time.monotonic() - start < 2.0  # WAL: readers do not wait for the writer
    finally:
        holder.wait()
    before = digest_of(db)
    Store(db, readonly=True).trials()
    assert digest_of(db) == before
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).execute("CREATE TABLE t (x)").connection.close()
    assert Store(empty, readonly=True).winners() == []  # a database without our tables: no rows
    with pytest.raises(DatabaseError, match="does not exist"):
        Store(tmp_path / "missing.db", readonly=True)


def test_the_shipped_database_is_written_in_rollback_journal_mode(tmp_path, monkeypatch):
    # An installed package may sit in a read-only folder, where a WAL database cannot be read.
    shipped = tmp_path / "results.db"
    shutil.copy(paths.SHIPPED_DB, shipped)
    with sqlite3.connect(shipped) as con:  # as a tuning run into it once left it
        con.execute("PRAGMA journal_mode=WAL")
    monkeypatch.setattr(paths, "SHIPPED_DB", shipped)
    store = Store(shipped)
    store.record_trial(trial(10**6, study="journal-mode test"))
    store.close()
    assert shipped.read_bytes()[18:20] == b"\x01\x01"  # file format bytes: rollback journal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.db"]
    other = tmp_path / "user.db"  # any other database: WAL, so that readers never block the tuner
    Store(other).record_trial(trial(1))
    assert other.read_bytes()[18:20] == b"\x02\x02"


def fla_measured(status="pass", median_ms=0.8, problem=PROBLEM, env=H200, **kw):
    timed = status == "pass"
    return Baseline(problem, env, "0.6.0", status, median_ms if timed else None, median_ms * 0.95 if timed else None,
                    median_ms * 1.05 if timed else None, 0.126 if timed else None, {"default": {"o": 3e-3}}, **kw)


def test_baselines_round_trip_oldest_first_with_their_gate_verdict(tmp_path):
    store = Store(tmp_path / "r.db")
    later = fla_measured(median_ms=0.7, measured_at=datetime(2026, 3, 2))
    earlier = fla_measured(measured_at=datetime(2026, 3, 1))
    failed = fla_measured("mismatch", problem=Problem("linear", 64, 64, seqlen=1024), message="relative L2 above 0.01")
    for b in (later, earlier, failed):
        store.add_baseline(b)
    back = Store(tmp_path / "r.db", readonly=True).baselines(seqlen=8192)
    assert [b.median_ms for b in back] == [0.8, 0.7] and all(b.timed for b in back)
    assert back[0] == replace(earlier, id=back[0].id) and back[0].bucket == shape_bucket(4, 8192, 16)
    (bad,) = store.baselines(status="mismatch")
    assert not bad.timed and bad.message == "relative L2 above 0.01" and bad.gate_errors == {"default": {"o": 3e-3}}
    assert store.baselines(fla_version="0.5.0") == [] and count(tmp_path / "r.db", "tuner_baselines") == 3
    with pytest.raises(ValueError, match="status"):
        fla_measured("slow")


def test_a_database_from_before_the_baselines_reads_as_having_none_and_gains_their_table_when_written(tmp_path):
    # The shipped results.db was written before the table existed.
    db = tmp_path / "results.db"
    shutil.copy(paths.SHIPPED_DB, db)
    with sqlite3.connect(db) as con:
        con.execute("DROP TABLE IF EXISTS tuner_baselines")  # as it was before any baseline was stored
        schema = dict(con.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
    before = digest_of(db)
    reader = Store(db, readonly=True)
    assert reader.baselines() == [] and reader.winners()  # its winners read as before
    reader.close()
    assert digest_of(db) == before
    Store(db).add_baseline(fla_measured())
    with sqlite3.connect(db) as con:
        after = dict(con.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
    assert {k: v for k, v in after.items() if k in schema} == schema  # no existing table changed
    assert set(after) - set(schema) == {"tuner_baselines"}
    assert len(Store(db, readonly=True).baselines()) == 1


def test_baselines_from_before_fla_was_autotuned_at_their_shape_read_so_and_the_column_is_added_when_written(tmp_path):
    db = tmp_path / "results.db"
    store = Store(db)
    store.add_baseline(fla_measured())
    store.close()
    with sqlite3.connect(db) as con:  # the table as it was written before the column existed
        con.execute("ALTER TABLE tuner_baselines DROP COLUMN autotuned_at_shape")
        schema = dict(con.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
    before = digest_of(db)
    reader = Store(db, readonly=True)
    (old,) = reader.baselines()
    assert old.autotuned_at_shape is False and old.median_ms == 0.8
    assert reader.baselines(seqlen=8192) == [old]
    reader.close()
    assert digest_of(db) == before  # a reader changes nothing
    writer = Store(db)
    writer.add_baseline(fla_measured(median_ms=0.5, autotuned_at_shape=True))
    assert [(b.median_ms, b.autotuned_at_shape) for b in Store(db, readonly=True).baselines()] == [(0.8, False),
                                                                                                  (0.5, True)]
    with sqlite3.connect(db) as con:
        after = dict(con.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
    assert {k: v for k, v in after.items() if k != "tuner_baselines"} == {k: v for k, v in schema.items()
                                                                          if k != "tuner_baselines"}
    assert "autotuned_at_shape BOOLEAN NOT NULL DEFAULT 0" in after["tuner_baselines"]
