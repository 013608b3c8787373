"""Where the tuner's files live: the shipped results database, the user's own, the kernel cache.

A tuning run writes to the user's database (``$LINATTN_TUNER_DB``, else ``results.db`` in the
per-user data folder, ``$XDG_DATA_HOME/linattn-tuner`` or ``~/.local/share/linattn-tuner``), never
to the ``results.db`` shipped at the repository root unless it is named with ``--db``: that file
is what every user's :func:`tuner.best_config` reads, under the user's own.
"""
from __future__ import annotations

import os
from pathlib import Path

from .variants import ROOT

SHIPPED_DB = ROOT / "results.db"
DB_ENV = "LINATTN_TUNER_DB"
CACHE_ENV = "LINATTN_CACHE"
APP = "linattn-tuner"


def _xdg(variable: str, fallback: str) -> Path:
    # The XDG base-directory rule: a relative value is invalid and ignored.
    value = os.environ.get(variable, "")
    return Path(value) if os.path.isabs(value) else Path.home() / fallback


def data_dir() -> Path:
    """The per-user data folder: ``$XDG_DATA_HOME/linattn-tuner``, else ``~/.local/share/linattn-tuner``."""
    return _xdg("XDG_DATA_HOME", ".local/share") / APP


def cache_dir() -> Path:
    """The kernel cache's root: ``$LINATTN_CACHE``, else ``$XDG_CACHE_HOME/linattn-tuner`` (``~/.cache/...``)."""
    named = os.environ.get(CACHE_ENV)
    return Path(named) if named else _xdg("XDG_CACHE_HOME", ".cache") / APP


def user_db() -> Path:
    """The user's results database: ``$LINATTN_TUNER_DB``, else ``results.db`` in :func:`data_dir`."""
    named = os.environ.get(DB_ENV)
    return Path(named) if named else data_dir() / "results.db"


def is_shipped(path: str | os.PathLike) -> bool:
    """Whether ``path`` is the results database shipped with the package."""
    return os.path.abspath(path) == os.path.abspath(SHIPPED_DB)


def written_db(named: str | os.PathLike | None = None) -> str:
    """The database a run writes to: ``named`` (``--db``), else :func:`user_db`, its folder created."""
    if named is not None:
        return os.fspath(named)
    path = user_db()
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path)
