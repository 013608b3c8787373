"""The results database: every trial's outcome, the winners, their re-measurements and the
model's calibration points, in the same database as the Optuna study: an SQLite file, or a
PostgreSQL server that workers on several machines share.

Our tables are ``tuner_trials``, ``tuner_winners``, ``tuner_history``, ``tuner_baselines``,
``tuner_calibration`` and ``tuner_claims``. Rows leave the package as frozen dataclasses.

- :mod:`.records`: the records (:class:`TrialRecord`, :class:`Winner`, :class:`Measurement`,
  :class:`Baseline`, :class:`CalibrationPoint`) and the shape buckets winners are kept by;
- :mod:`.schema`: the SQLAlchemy tables and the mapping between their rows and the records;
- :mod:`.database`: :class:`Store`, the connection, its reads and writes, and the checks of an
  SQLite file.
"""
from .database import Store, check_sqlite_file, sqlite_path
from .records import (STATUSES, Baseline, CalibrationPoint, Measurement, ShapeBucket, TrialRecord, Winner,
                      shape_bucket, utcnow)
from .schema import WINNER_KEY

__all__ = [
    "STATUSES", "WINNER_KEY", "ShapeBucket", "shape_bucket", "Store", "TrialRecord", "Winner",
    "Measurement", "Baseline", "CalibrationPoint", "check_sqlite_file", "sqlite_path", "utcnow",
]
