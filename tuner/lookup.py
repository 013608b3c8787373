"""The best known config for a problem on this machine, read from the results databases.

Two databases are read: the ``results.db`` shipped at the repository root (winners tuned on
the H200) and, over it, the user's own (``db=``, else ``$LINATTN_TUNER_DB``, else the one ``tune``
writes by default in the per-user data folder, :func:`tuner.paths.user_db`). Fallbacks, best first:

- ``exact``: a winner for this GPU model and this shape bucket;
- ``nearest_bucket``: this GPU model, the nearest shape bucket;
- ``same_arch``: another GPU model of the same architecture, nearest bucket;
- ``default``: the template's default config from the variant's search space.

A winner tuned with another TileLang or CUDA version, or whose kernel the template no longer
renders (another digest), is stale: it is passed over, reported with ``warnings.warn`` and
listed in :attr:`Lookup.skipped`, never used silently. Results are memoised per key and per
state of the database files, so a repeated lookup costs a few ``stat`` calls.
"""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

from . import space as spaces, stack
from .stack import NONE, Stack
from .errors import UserError
from .paths import DB_ENV, SHIPPED_DB, user_db
from .problem import Problem
from .candidate import Candidate
from .store import Store, Winner, shape_bucket

SOURCES = ("exact", "nearest_bucket", "same_arch", "default")


@dataclass(frozen=True)
class Skipped:
    """A stored winner passed over, with why (and the database it was read from)."""

    row: Winner
    reason: str
    db: str


@dataclass(frozen=True)
class Lookup:
    """The answer of :func:`best_config`.

    Args:
        config (dict): the config to use.
        source (str): where it came from, one of :data:`SOURCES`.
        row (Winner | None): the stored winner it came from; None for ``default``.
        db (str | None): the database file of ``row``.
        skipped (tuple[Skipped, ...]): stale winners that were passed over.
    """

    config: dict
    source: str
    row: Winner | None
    db: str | None = None
    skipped: tuple[Skipped, ...] = ()

    @property
    def stale(self) -> bool:
        """Whether a stale winner was passed over to give this answer."""
        return bool(self.skipped)


def best_config(variant: str, dk: int, dv: int | None = None, dtype: str = "bf16", batch: int = 4,
                seqlen: int = 8192, heads: int = 16, device: int | Stack | None = None,
                db: str | os.PathLike | None = None) -> Lookup:
    """The best stored config for a problem on this machine, and where it came from.

    Args:
        variant (str): one of the variants (``"gdn"``, ...).
        dk (int): key/query head dim. dv (int): value head dim. Default: ``dk``.
        dtype (str): ``"bf16"`` or ``"fp16"``. Default: ``"bf16"``.
        batch, seqlen, heads (int): the shape the kernel will run at. Default: 4, 8192, 16.
        device (int | Stack): the CUDA device index to look up for, or the
            :class:`~tuner.stack.Stack` of another machine. Default: device 0.
        db (str | os.PathLike): the user's results database, read over the shipped one.
            Default: ``$LINATTN_TUNER_DB`` when set, else the per-user database ``tune`` writes to
            (:func:`tuner.paths.user_db`) when it exists.

    Returns:
        Lookup

    Example::

        >>> best_config("gdn", 128, seqlen=4096).source
        'exact'
    """
    problem = Problem(variant, dk, dv or dk, dtype, batch, seqlen, heads)
    env = device if isinstance(device, Stack) else stack.current(device or 0)
    named = db if db is not None else os.environ.get(DB_ENV)
    if named is not None and not os.path.exists(named):
        raise UserError(f"results database {os.path.abspath(named)} does not exist")
    # The per-user default is read when a run has written it (_lookup skips a missing file).
    paths = tuple(dict.fromkeys(os.path.abspath(p) for p in (named or user_db(), SHIPPED_DB)))
    files = tuple((p, _file_state(p)) for p in paths)
    result = _lookup(problem, env, files)
    for s in result.skipped:  # memoised answers warn again: a stale row is never silent
        warnings.warn(f"stale winner passed over ({s.db}, {s.row.config}): {s.reason}", stacklevel=2)
    return result


def _file_state(path: str) -> tuple:
    """What changes when a tuner writes the database (the WAL file first, the main file later)."""
    out = []
    for p in (path, path + "-wal"):
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            out.append(None)
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _lookup(problem: Problem, env: Stack, files: tuple) -> Lookup:
    # The user's database first: on ties it wins over the shipped one.
    rows = [(w, path) for path, state in files if state[0] is not None
            for w in _winners(path, problem)]
    fresh, skipped = [], []
    for w, path in rows:
        reason = _stale_reason(w, env)
        if reason:
            skipped.append(Skipped(w, reason, path))
        else:
            fresh.append((w, path))
    want = shape_bucket(problem.batch, problem.seqlen, problem.heads)
    same_gpu = [x for x in fresh if x[0].stack.gpu == env.gpu]
    same_arch = [x for x in fresh if x[0].stack.arch == env.arch != NONE and x not in same_gpu]
    exact = [x for x in same_gpu if x[0].bucket == want]
    order = {path: i for i, (path, _) in enumerate(files)}

    def rank(x):  # nearest bucket, then this driver, then the user's database, then fastest
        w, path = x
        return (w.bucket.distance(want), w.stack.driver != env.driver, order[path], w.median_ms)

    for source, group in (("exact", exact), ("nearest_bucket", same_gpu), ("same_arch", same_arch)):
        if group:
            w, path = min(group, key=rank)
            return Lookup(dict(w.config), source, w, path, tuple(skipped))
    return Lookup(spaces.load(problem.variant).default(problem), "default", None, None, tuple(skipped))


def _winners(path: str, problem: Problem) -> list[Winner]:
    store = Store(path, readonly=True)
    try:
        return store.winners(variant=problem.variant, dk=problem.dk, dv=problem.dv, dtype=problem.dtype)
    finally:
        store.close()


def _stale_reason(w: Winner, env: Stack) -> str | None:
    if w.stack.tilelang != env.tilelang:
        return f"tuned with TileLang {w.stack.tilelang}, this machine has {env.tilelang}"
    if w.stack.cuda != env.cuda:
        return f"tuned with CUDA {w.stack.cuda}, this machine has {env.cuda}"
    digest = _digest(w.problem.variant, w.problem.dk, w.problem.dv, w.problem.dtype,
                      tuple(sorted(w.config.items())))
    if digest is None:
        return "the search space no longer accepts this config"
    if digest != w.digest:
        return f"the template now renders this config differently (digest {digest}, stored {w.digest})"
    return None


@functools.lru_cache(maxsize=4096)
def _digest(variant: str, dk: int, dv: int, dtype: str, config: tuple) -> str | None:
    """The digest the current template gives ``config``; None when the space refuses it now."""
    try:
        return Candidate.from_config(Problem(variant, dk, dv, dtype), dict(config)).digest
    except UserError:
        return None
