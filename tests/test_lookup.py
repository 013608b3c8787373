"""best_config against real SQLite files: every fallback level, the stale-row rule, the overlay
of the user's database on the shipped one, memoisation and reading beside a writer."""
import dataclasses
import subprocess
import sys
import time

import pytest

from tuner import lookup, paths, space
from tuner.stack import Stack
from tuner.lookup import best_config
from tuner.problem import Problem
from tuner.candidate import Candidate
from tuner.store import Store, Winner

H200 = Stack("NVIDIA H200", "sm_90", "0.1.15", "13.0.88", "570.86.15", "2.13.0")
H100 = dataclasses.replace(H200, gpu="NVIDIA H100 80GB HBM3")
A100 = dataclasses.replace(H200, gpu="NVIDIA A100-SXM4-80GB", arch="sm_80")
FAST = space.load("linear").complete(Problem("linear", 64, 64), {"block_dv": 32, "num_stages": 1})
OTHER = {**FAST, "block_dv": 16}


def put(db, config, *, env=H200, seqlen=8192, median_ms=0.3, digest=None, batch=4):
    problem = Problem("linear", 64, 64, seqlen=seqlen, batch=batch)
    digest = digest or Candidate.from_config(problem, config).digest
    Store(db).write_winner(Winner(problem, env, digest, config, median_ms, median_ms * 0.95, median_ms * 1.1,
                                  {"rel_l2": 1e-3}, "s", 0), "pass")


@pytest.fixture(autouse=True)
def no_shipped_db(tmp_path, monkeypatch):
    """Point the shipped database at a file of the test's own (absent unless a test writes it)."""
    monkeypatch.setattr(lookup, "SHIPPED_DB", tmp_path / "shipped.db")
    monkeypatch.delenv(lookup.DB_ENV, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # no per-user database either


def ask(db, env=H200, **shape):
    return best_config("linear", 64, device=env, db=db, **shape)


def test_exact(tmp_path):
    db = tmp_path / "user.db"
    put(db, FAST)
    put(db, OTHER, seqlen=2048)
    got = ask(db)
    assert (got.source, got.config, got.stale) == ("exact", FAST, False)
    assert got.row.problem.seqlen == 8192 and got.db == str(db)
    # a shape in the same power-of-two bucket is the same answer
    assert ask(db, seqlen=7000, batch=5).source == "exact"


def test_nearest_bucket_on_the_same_gpu(tmp_path):
    db = tmp_path / "user.db"
    put(db, OTHER, seqlen=1024)
    put(db, FAST, seqlen=4096)
    put(db, OTHER, env=H100)  # an exact bucket, but on another GPU model: ranks below
    got = ask(db)
    assert (got.source, got.config, got.row.problem.seqlen) == ("nearest_bucket", FAST, 4096)


def test_same_arch_on_another_gpu_model(tmp_path):
    db = tmp_path / "user.db"
    put(db, FAST, env=H100)
    put(db, OTHER, env=A100)
    got = ask(db)
    assert (got.source, got.config, got.row.stack.gpu) == ("same_arch", FAST, H100.gpu)


def test_default_when_nothing_fits(tmp_path):
    db = tmp_path / "user.db"
    put(db, FAST, env=A100)  # another architecture is never used
    got = ask(db)
    default = space.load("linear").default(Problem("linear", 64, 64))
    assert (got.source, got.config, got.row) == ("default", default, None)
    assert ask(db, env=dataclasses.replace(H200, gpu="none", arch="none")).source == "default"


@pytest.mark.parametrize("change, reason", [
    (dict(env=dataclasses.replace(H200, tilelang="0.1.14")), "TileLang 0.1.14"),
    (dict(env=dataclasses.replace(H200, cuda="12.4.131")), "CUDA 12.4.131"),
    (dict(digest="0123456789abcdef"), "renders this config differently"),
], ids=["tilelang", "cuda", "digest"])
def test_a_stale_winner_is_reported_and_passed_over(tmp_path, change, reason):
    db = tmp_path / "user.db"
    put(db, OTHER, **change)  # the exact bucket, but stale
    put(db, FAST, seqlen=4096)
    with pytest.warns(UserWarning, match=reason):
        got = ask(db)
    assert (got.source, got.config) == ("nearest_bucket", FAST)
    assert got.stale and reason in got.skipped[0].reason and got.skipped[0].row.config == OTHER


def test_a_config_the_space_no_longer_accepts_is_stale(tmp_path):
    db = tmp_path / "user.db"
    put(db, {**FAST, "block_dv": 48}, digest="0123456789abcdef")
    with pytest.warns(UserWarning, match="no longer accepts"):
        assert ask(db).source == "default"


def test_the_user_database_overlays_the_shipped_one(tmp_path, monkeypatch):
    shipped, user = tmp_path / "shipped.db", tmp_path / "user.db"
    put(shipped, OTHER, median_ms=0.1)
    put(user, FAST, median_ms=0.3)
    got = ask(user)
    assert (got.config, got.db) == (FAST, str(user))  # same level: the user's row wins
    user2 = tmp_path / "user2.db"
    put(user2, FAST, seqlen=2048)
    assert (ask(user2).source, ask(user2).config) == ("exact", OTHER)  # a better level wins over the overlay
    monkeypatch.setenv(lookup.DB_ENV, str(user))
    assert best_config("linear", 64, device=H200).config == FAST
    assert ask(None).config == FAST


def test_a_missing_user_database_is_an_error(tmp_path):
    from tuner.errors import UserError

    with pytest.raises(UserError, match="does not exist"):
        ask(tmp_path / "nope.db")


def test_a_warm_lookup_is_memoised_and_sees_new_writes(tmp_path):
    db = tmp_path / "user.db"
    put(db, OTHER, median_ms=0.5)
    assert ask(db).config == OTHER
    start = time.perf_counter()
    for _ in range(1000):
        ask(db)
    assert (time.perf_counter() - start) / 1000 < 200e-6  # a few stat calls, no database or render
    put(db, FAST, median_ms=0.2)  # a faster winner for the same key replaces the row
    assert ask(db).config == FAST


WRITER = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN IMMEDIATE")
con.execute("UPDATE tuner_winners SET median_ms = 99")
print("writing", flush=True)
time.sleep(3)
con.execute("ROLLBACK")
"""


def test_lookup_reads_while_a_tuner_writes(tmp_path):
    db = tmp_path / "user.db"
    put(db, FAST)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        start = time.monotonic()
        got = ask(db)
        assert time.monotonic() - start < 2.0
        assert got.source == "exact" and got.row.median_ms == pytest.approx(0.3)  # the committed state
    finally:
        writer.wait()


def test_the_shipped_database_is_read_without_side_files(tmp_path, monkeypatch):
    # Installed packages may sit in read-only folders: a WAL database would need -wal/-shm files
    # beside it to be read. The shipped one is in rollback-journal mode and a lookup writes nothing.
    import shutil

    shipped = tmp_path / "results.db"
    shutil.copy(paths.SHIPPED_DB, shipped)  # the real one (the fixture above points elsewhere)
    assert shipped.read_bytes()[18:20] == b"\x01\x01"  # file format: rollback journal, not WAL
    monkeypatch.setattr(lookup, "SHIPPED_DB", shipped)
    found = best_config("gdn", 128, device=None)
    assert found.source in ("exact", "nearest_bucket", "same_arch", "default")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.db"]
