"""FLA as the baseline of every problem the tuner tunes, and the switch that picks what ``tuner.ops`` runs.

A baseline is FLA's op of a variant (:attr:`tuner.variants.Variant.fla_op`) in a module with the
generated-module contract (``programs()`` empty, ``forward(kernels, q, k, v, g, beta, scale,
initial_state) -> (o, final_state)``), wrapped in a :class:`~tuner.candidate.Candidate` with the
config :data:`CONFIG`: the gate's child checks it against the fp64 oracle and times it exactly as it
does the tuner's kernels. The module imports FLA on its first call, with
``FLA_DISABLE_BACKEND_DISPATCH=1`` (FLA's own Triton kernels), and refuses another FLA version than
the one it was written for. FLA is timed autotuned at the problem timed: its ``before_timing`` makes
FLA's kernels autotune there (:func:`autotune_fla_at` says why), and the timing's warm-up call
absorbs the autotune.

FLA is an optional dependency (``pip install 'linattn-tuner[fla]'``): nothing here imports it; the
baseline module does in the gate's child, and :func:`fla_ops` does where ``tuner.ops`` runs FLA.

The backend switch: ``backend=`` of ``tuner.best_config`` and of the ``tuner.ops`` functions, else
``$LINATTN_BACKEND``, else ``auto`` (FLA where a stored baseline beats the tuner's winner; see
:mod:`tuner.lookup`); ``tuner`` and ``fla`` force one.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import sys

from . import variants
from .candidate import Candidate
from .errors import UserError
from .problem import Problem

BACKEND_ENV = "LINATTN_BACKEND"
BACKENDS = ("auto", "tuner", "fla")
# The distributions that install the ``fla`` package: FLA 0.6.0 keeps its ops in fla-core (which
# flash-linear-attention requires); releases from before fla-core shipped them in flash-linear-attention.
DISTRIBUTIONS = ("fla-core", "flash-linear-attention")
INSTALL = "pip install 'linattn-tuner[fla]'"
# The config of a baseline candidate: no template parameter, only what tells it from the tuner's kernels.
CONFIG = {"backend": "fla"}
# The stack fields a baseline's time depends on, with its FLA version: FLA's kernels are Triton's,
# compiled by the Triton torch brings; the TileLang version plays no part.
IDENTITY = ("gpu", "cuda", "driver", "torch")


class FlaUnavailable(UserError, ImportError):
    """FLA was asked for but cannot be imported."""


def backend_choice(backend: str | None = None) -> str:
    """The backend asked for: ``backend`` when given, else ``$LINATTN_BACKEND``, else ``"auto"``.

    Raises:
        UserError: a value other than those of :data:`BACKENDS`.
    """
    chosen = backend if backend is not None else os.environ.get(BACKEND_ENV) or "auto"
    if chosen not in BACKENDS:
        named = "backend=" if backend is not None else f"{BACKEND_ENV}="
        raise UserError(f"{named}{chosen!r} is not a backend; accepted: {', '.join(BACKENDS)}")
    return chosen


@functools.cache
def installed_version() -> str | None:
    """The installed FLA's version, read from its distribution's metadata (FLA is not imported);
    None when FLA is not installed. Read once per process."""
    for name in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def fla_ops():
    """FLA's ``fla.ops`` module (imported on the first call), whose functions bear ``tuner.ops``' names.

    Raises:
        FlaUnavailable: FLA cannot be imported (the message says how to install it).
    """
    try:
        return importlib.import_module("fla.ops")
    except ImportError as e:
        raise FlaUnavailable(f"FLA cannot be imported ({e}); install it with {INSTALL}") from None


def autotune_fla_at(at: str) -> int:
    """Make every Triton kernel of the imported FLA modules run, from its next call on, with the
    configs its autotune chooses at ``at`` (a problem and shape, as text): the choices held in memory
    are forgotten, and the ones Triton keeps on disk are keyed by ``at`` as well as by FLA's keys.

    FLA's autotune keys leave out the batch, the sequence length and the head dims (its state pass
    keys on chunk size and gate flags only), and FLA keeps the choices on disk by default, so without
    this FLA runs every shape with the configs chosen at the first shape it met on the machine:
    chunk_simple_gla (D=64, 4x8192x16, H200) took 0.28 ms in a run that autotuned there, 0.51 ms in
    one that had autotuned at 1x32768x32 first. After this call the next call autotunes at ``at``,
    once per machine: a later process that asks for the same ``at`` (a baseline's timing, then the
    benchmark's row of that shape) loads that choice and runs the same configs, where two autotunes
    could pick differently. A Triton without a disk cache of autotune choices autotunes again in
    every process.

    Returns:
        int: the autotuners reset.
    """
    if "triton" not in sys.modules:  # FLA's kernels are Triton's: none has been loaded
        return 0
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    loaded = [m for name, m in list(sys.modules.items()) if m is not None and (name == "fla" or name.startswith("fla."))]

    reset = {}
    for module in loaded:
        for obj in list(vars(module).values()):
            # triton.heuristics and triton.autotune wrap one another (and the jitted function) through .fn
            while isinstance(obj, KernelInterface):
                if isinstance(obj, Autotuner):
                    reset[id(obj)] = obj
                obj = getattr(obj, "fn", None)
    on_disk = hasattr(Autotuner, "check_disk_cache")
    for tuner in reset.values():
        tuner.cache.clear()
        tuner.cache_results = on_disk
        if on_disk:
            tuner.check_disk_cache = _disk_choices_at(tuner, at)
    return len(reset)


def problem_label(problem: Problem) -> str:
    """What :func:`autotune_fla_at` keys FLA's choices by: the problem's variant, head dims, dtype and
    shape, and whether its sequences are packed."""
    return f"{problem.variant} {problem.dk}x{problem.dv} {problem.dtype} {'packed ' if problem.packed else ''}{problem.shape}"


def _disk_choices_at(tuner, at: str):
    """``tuner``'s ``check_disk_cache`` with ``at`` added to the key it files a choice under; the
    choice found stays under the key the autotuner looks it up by."""
    check = type(tuner).check_disk_cache

    def check_disk_cache(tuning_key, configs, bench_fn):
        keyed = (*tuning_key, at)
        found = check(tuner, keyed, configs, bench_fn)
        if keyed in tuner.cache:  # a choice read from disk is stored under the key it was asked for
            tuner.cache[tuning_key] = tuner.cache.pop(keyed)
        return found

    return check_disk_cache


def has_baseline(variant: str) -> bool:
    """Whether FLA runs ``variant``'s forward: the chunk variants. The decode kernels are timed as an
    in-place step on a state pool, a form FLA's ``fused_recurrent_*`` ops do not take."""
    return variants.get(variant).recurrence_of is None


def fla_call(variant: str) -> tuple[str, str]:
    """FLA's op that computes ``variant``'s recurrence on ``forward``'s arguments, and the arguments
    of its call."""
    spec = variants.get(variant)
    if not has_baseline(variant):
        raise UserError(f"{variant} is a decode kernel: FLA is timed beside the chunk variants only")
    op, args = spec.fla_op, ["q", "k", "v"]
    if spec.decay_per == "head":
        # chunk_retention fixes RetNet's decays, log(1 - 2^(-5 - h)); FLA runs a given per-head decay
        # (the gate's inputs) through chunk_simple_gla's g_gamma, the kernels chunk_retention calls.
        op, args = "chunk_simple_gla", [*args, "g_gamma=g"]
    elif spec.decay_per is not None:
        args.append("g=g")
    if spec.delta:
        args.append("beta=beta")
    if op == "chunk_linear_attn":
        args.append("normalize=False")  # FLA normalises by default; the recurrence is unnormalised
    args += ["scale=scale", "initial_state=initial_state", "output_final_state=True", "cu_seqlens=cu_seqlens"]
    return op, ", ".join(args)


MODULE = '''"""FLA {version}'s {op} with the generated-module contract: the baseline of {variant} (tuner.baseline)."""
import functools
import os

FLA_VERSION = {version!r}


def programs():
    return []


@functools.cache
def _fla_ops():
    # FLA reads this when it is imported: its own Triton kernels, not a backend it would dispatch to.
    os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    import fla
    import fla.ops

    if fla.__version__ != FLA_VERSION:
        raise ImportError(f"FLA {{fla.__version__}} is installed; this baseline was written for FLA {{FLA_VERSION}}")
    return fla.ops


def before_timing(problem):
    # FLA's autotune keys leave out batch, length and head dims: autotune at the problem timed next.
    _fla_ops()
    from tuner.baseline import autotune_fla_at, problem_label

    autotune_fla_at(problem_label(problem))


def forward(kernels, q, k, v, g=None, beta=None, scale=None, initial_state=None, cu_seqlens=None):
    return _fla_ops().{op}({args})
'''


def source(variant: str, version: str) -> str:
    """The baseline module of ``variant`` for FLA ``version``."""
    op, args = fla_call(variant)
    return MODULE.format(version=version, op=op, variant=variant, args=args)


def candidate(problem: Problem, version: str) -> Candidate:
    """FLA ``version``'s op for ``problem`` as a candidate for the gate (config :data:`CONFIG`)."""
    return Candidate(problem, dict(CONFIG), source(problem.variant, version))
