"""The results database (see :mod:`tuner.store.database`)."""
from .database import (STATUSES, WINNER_KEY, CalibrationPoint, Measurement, ShapeBucket, Store, TrialRecord,
                       Winner, check_sqlite_file, shape_bucket, sqlite_path, utcnow)

__all__ = [
    "STATUSES", "WINNER_KEY", "ShapeBucket", "shape_bucket", "Store", "TrialRecord", "Winner",
    "Measurement", "CalibrationPoint", "check_sqlite_file", "sqlite_path", "utcnow",
]
