"""The best known config for a problem on this machine, read from the results databases.

Two databases are read: the ``results.db`` shipped at the repository root (winners tuned on
the H200) and, over it, the user's own (``db=``, else ``$LINATTN_TUNER_DB``, else the one ``tune``
writes by default in the per-user data folder, :func:`tuner.paths.user_db`). Fallbacks, best first:

- ``exact``: a winner for this GPU model and this shape bucket;
- ``nearest_bucket``: this GPU model, the nearest shape bucket;
- ``same_arch``: another GPU model of the same architecture, nearest bucket;
- ``default``: the template's default config from the variant's search space.

A packed call (``packed=``: packed sequences or grouped value heads) takes only configs of kernels
that take them, those timed on packed inputs (``Problem.packed``) first at a bucket; a dense call
never takes a winner timed on packed inputs.

A winner tuned with another TileLang or CUDA version, or whose kernel the template no longer
renders (another digest), is stale: it is passed over, reported with ``warnings.warn`` and
listed in :attr:`Lookup.skipped`, never used silently.

The backend (``backend=``, else ``$LINATTN_BACKEND``, else ``auto``; :mod:`tuner.baseline`): in
``auto``, the answer is FLA (source ``fla``) when FLA is installed and the stored FLA baseline the
winner is compared with passed the gate and is faster than it beyond the noise (``tuner.bench``'s
rule, by which ``tune regress`` judges; within the noise the tuner's kernel runs). That baseline was
measured on the winner's GPU model at the winner's shape bucket, like with like (FLA timed on the
call's kind of inputs, packed or dense, first, then FLA autotuned at that shape, then the installed FLA
version, then this driver, then the newest measurement; a
newer measurement that failed the gate rules FLA out). Without a winner (none stored, or all stale), FLA is the answer when a baseline of this GPU
model (else of its architecture) passed the gate: the template's default was never timed, FLA was.
``fla`` forces FLA, ``tuner`` the tuner's kernel. The decode kernels have no FLA baseline: their
answer is always the tuner's. :attr:`Lookup.config` is the tuner's config in every case.

Results are memoised per key, backend, installed FLA version and state of the database files, so a
repeated lookup costs a few ``stat`` calls.
"""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, replace

from . import baseline, bench, space as spaces, stack
from .stack import NONE, Stack
from .errors import UserError
from .paths import DB_ENV, SHIPPED_DB, user_db
from .problem import Problem
from .candidate import Candidate
from .store import Baseline, ShapeBucket, Store, Winner, shape_bucket

# Where the tuner's config comes from, best first.
CONFIG_SOURCES = ("exact", "nearest_bucket", "same_arch", "default")
# Where an answer comes from: FLA runs the problem, or the tuner's config from one of CONFIG_SOURCES.
SOURCES = ("fla", *CONFIG_SOURCES)


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
        config (dict): the tuner's config (what runs when the backend is the tuner).
        source (str): where the answer came from, one of :data:`SOURCES`: ``fla`` when FLA runs
            the problem, else ``config_source``.
        row (Winner | None): the stored winner the config came from; None for ``default``.
        db (str | None): the database file of ``row``.
        skipped (tuple[Skipped, ...]): stale winners that were passed over.
        config_source (str): where the config came from, one of :data:`CONFIG_SOURCES`.
        baseline (Baseline | None): the FLA measurement the winner (or, without one, the default)
            was compared with; None when there is none.
    """

    config: dict
    source: str
    row: Winner | None
    db: str | None = None
    skipped: tuple[Skipped, ...] = ()
    config_source: str = "default"
    baseline: Baseline | None = None

    @property
    def stale(self) -> bool:
        """Whether a stale winner was passed over to give this answer."""
        return bool(self.skipped)

    @property
    def backend(self) -> str:
        """What runs the problem: ``"fla"`` or ``"tuner"``."""
        return "fla" if self.source == "fla" else "tuner"


def best_config(variant: str, dk: int, dv: int | None = None, dtype: str = "bf16", batch: int = 4,
                seqlen: int = 8192, heads: int = 16, device: int | Stack | None = None,
                db: str | os.PathLike | None = None, backend: str | None = None, packed: bool = False) -> Lookup:
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
        backend (str): ``"auto"``, ``"tuner"`` or ``"fla"`` (module docstring). Default:
            ``$LINATTN_BACKEND``, else ``"auto"``.
        packed (bool): the call needs kernels that take packed sequences and grouped value heads (a
            config stating ``packed``); its shape is then ``1 x total tokens x value heads``, whatever the
            lengths of its sequences. Default: False.

    Returns:
        Lookup

    Example::

        >>> best_config("gdn", 128, seqlen=4096).source
        'exact'
    """
    problem = Problem(variant, dk, dv or dk, dtype, batch, seqlen, heads)
    chosen = baseline.backend_choice(backend)
    env = device if isinstance(device, Stack) else stack.current(device or 0)
    named = db if db is not None else os.environ.get(DB_ENV)
    if named is not None and not os.path.exists(named):
        raise UserError(f"results database {os.path.abspath(named)} does not exist")
    # The per-user default is read when a run has written it (_lookup skips a missing file).
    paths = tuple(dict.fromkeys(os.path.abspath(p) for p in (named or user_db(), SHIPPED_DB)))
    files = tuple((p, _file_state(p)) for p in paths)
    result = _lookup(problem, env, files, chosen, baseline.installed_version(), packed)
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
def _lookup(problem: Problem, env: Stack, files: tuple, backend: str, fla_version: str | None,
            packed: bool = False) -> Lookup:
    # The user's database first: on ties it wins over the shipped one.
    read = [(path, *_read(path, problem)) for path, state in files if state[0] is not None]
    # A packed call needs a config of kernels that take packed sequences; a winner timed on packed inputs
    # is no answer to a dense call (its time is of other work).
    rows = [(w, path) for path, winners, _ in read for w in winners
            if (w.config.get("packed") is True if packed else not w.problem.packed)]
    baselines = [b for _, _, found in read for b in found]
    want = shape_bucket(problem.batch, problem.seqlen, problem.heads)
    found = _tuners_config(problem, env, want, files, rows, packed)
    if not baseline.has_baseline(problem.variant):
        return found
    compared = _compared_baseline(found.row, env, want, baselines, fla_version, packed)
    fla = backend == "fla" or (backend == "auto" and fla_version is not None and compared is not None
                               and compared.timed and (found.row is None or _beats(compared, found.row)))
    return replace(found, source="fla" if fla else found.source, baseline=compared)


def _beats(fla: Baseline, row: Winner) -> bool:
    """Whether FLA's measurement is faster than the winner's beyond the noise (``tuner.bench``'s rule,
    the one ``tune regress`` judges by). Within the noise the tuner's kernel runs: FLA's times spread
    wider (its autotune), and its host path is longer."""
    if None in (fla.p10_ms, fla.p90_ms, row.p10_ms, row.p90_ms):
        return fla.median_ms < row.median_ms
    return bench.change_beyond_noise(fla, row) == "faster"


def _tuners_config(problem: Problem, env: Stack, want: ShapeBucket, files: tuple,
                   rows: list[tuple[Winner, str]], packed: bool = False) -> Lookup:
    """The tuner's config for ``problem`` (in the bucket ``want``) from the winners ``rows`` (with
    their files), by the fallbacks; ``packed``: the default is that of a caller of packed kernels."""
    fresh, skipped = [], []
    for w, path in rows:
        reason = _stale_reason(w, env)
        if reason:
            skipped.append(Skipped(w, reason, path))
        else:
            fresh.append((w, path))
    same_gpu = [x for x in fresh if x[0].stack.gpu == env.gpu]
    same_arch = [x for x in fresh if x[0].stack.arch == env.arch != NONE and x not in same_gpu]
    exact = [x for x in same_gpu if x[0].bucket == want]
    order = {path: i for i, (path, _) in enumerate(files)}

    def rank(x):  # nearest bucket, timed on the call's kind of inputs, this driver, the user's database, fastest
        w, path = x
        return (w.bucket.distance(want), w.problem.packed != packed, w.stack.driver != env.driver, order[path],
                w.median_ms)

    for source, group in (("exact", exact), ("nearest_bucket", same_gpu), ("same_arch", same_arch)):
        if group:
            w, path = min(group, key=rank)
            return Lookup(dict(w.config), source, w, path, tuple(skipped), config_source=source)
    default = spaces.load(problem.variant).default(problem, {"packed": True} if packed else None)
    return Lookup(default, "default", None, None, tuple(skipped))


def _compared_baseline(row: Winner | None, env: Stack, want: ShapeBucket, baselines: list[Baseline],
                       fla_version: str | None, packed: bool = False) -> Baseline | None:
    """The FLA measurement to compare the winner ``row`` with (module docstring); without a winner,
    the one nearest the bucket ``want`` on this GPU model, else on its architecture. FLA timed on the
    call's kind of inputs (``packed`` or dense) comes first; the other kind only where there is none."""
    if row is not None:
        groups = [[b for b in baselines if b.stack.gpu == row.stack.gpu and b.bucket == row.bucket]]
    else:
        groups = [[b for b in baselines if b.stack.gpu == env.gpu],
                  [b for b in baselines if b.stack.arch == env.arch != NONE]]
    group = next((g for g in groups if g), [])

    def rank(b: Baseline):  # the call's kind of inputs, nearest bucket, FLA autotuned there, the installed FLA,
        # this driver, the newest
        return (b.problem.packed == packed, -b.bucket.distance(want), b.autotuned_at_shape,
                b.fla_version == fla_version, b.stack.driver == env.driver, b.measured_at)

    return max(group, key=rank, default=None)


def _read(path: str, problem: Problem) -> tuple[list[Winner], list[Baseline]]:
    """The winners and FLA's baselines of ``problem``'s variant, head dims and dtype in one database."""
    store = Store(path, readonly=True)
    key = dict(variant=problem.variant, dk=problem.dk, dv=problem.dv, dtype=problem.dtype)
    try:
        return store.winners(**key), store.baselines(**key)
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
