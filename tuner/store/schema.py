"""The tables of the results database, and the mapping between their rows and the records.

Optuna keeps its own tables (``studies``, ``trials``, ...) in the same database, so ours carry a
``tuner_`` prefix. A record's problem and stack are spread over columns of their own.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ..problem import Problem
from ..stack import Stack
from .records import STATUSES

Record = TypeVar("Record")


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
    # Added after the first databases were written: their rows are dense problems.
    packed: Mapped[bool] = mapped_column(default=False, server_default=sa.false())


class _StackColumns:
    gpu: Mapped[str] = mapped_column(sa.String(128))
    arch: Mapped[str] = mapped_column(sa.String(16))
    tilelang: Mapped[str] = mapped_column(sa.String(64))
    cuda: Mapped[str] = mapped_column(sa.String(64))
    driver: Mapped[str] = mapped_column(sa.String(64))
    torch: Mapped[str] = mapped_column(sa.String(64))


PROBLEM_COLUMNS = ("variant", "dk", "dv", "dtype", "batch", "seqlen", "heads", "packed")
STACK_COLUMNS = ("gpu", "arch", "tilelang", "cuda", "driver", "torch")


class TrialModel(_ProblemColumns, _StackColumns, Base):
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


class WinnerModel(_ProblemColumns, _StackColumns, Base):
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


class HistoryModel(_StackColumns, Base):
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


class BaselineModel(_ProblemColumns, _StackColumns, Base):
    """A measurement of FLA's op beside the winners: when a problem is tuned, and at every later
    ``tune regress``. A database written before this table existed reads as having no baselines."""

    __tablename__ = "tuner_baselines"

    id: Mapped[int] = mapped_column(primary_key=True)
    fla_version: Mapped[str] = mapped_column(sa.String(64))
    status: Mapped[str] = mapped_column(sa.String(16))
    median_ms: Mapped[float | None]
    p10_ms: Mapped[float | None]
    p90_ms: Mapped[float | None]
    floor_ms: Mapped[float | None]
    gate_errors: Mapped[dict | None]
    message: Mapped[str] = mapped_column(sa.Text, default="")
    measured_at: Mapped[datetime]
    # Added after the table: rows written before it read False (Store adds the column to older files).
    autotuned_at_shape: Mapped[bool] = mapped_column(default=False, server_default=sa.false())


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
# Rows <-> records

# Record fields spread over several columns: name -> (type, its columns).
_SPREAD = {"problem": (Problem, PROBLEM_COLUMNS), "stack": (Stack, STACK_COLUMNS)}


def columns_of(record) -> dict:
    """A record's fields as column values, its problem and stack spread out; the id is left to
    the database."""
    values = {}
    for name in record.__dataclass_fields__:
        value = getattr(record, name)
        if name in _SPREAD:
            values.update({c: getattr(value, c) for c in _SPREAD[name][1]})
        elif name != "id":
            values[name] = value
    return values


def record_of(kind: type[Record], row) -> Record:
    """The record of type ``kind`` that a table row holds, its problem and stack gathered from
    their columns."""
    values = {}
    for name in kind.__dataclass_fields__:
        if name in _SPREAD:
            spread_type, columns = _SPREAD[name]
            values[name] = spread_type(**{c: getattr(row, c) for c in columns})
        else:
            values[name] = getattr(row, name)
    return kind(**values)
