"""One config of one problem on its way down the pipeline, checked and rendered once.

``Candidate.from_config(problem, config)`` puts the config in its canonical form, judges the search
space's cheap constraints, renders the template (only then: rendering costs more), reads the
kernels from the source for the constraints that need their measures, and returns a
:class:`Candidate` holding the source, its kernels and the model's prediction. Compile, screen, gate,
time and record all take that object; nothing downstream renders it again.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

from . import model, space as spaces
from .errors import ConstraintError
from .problem import Problem
from .render import render


@dataclass(frozen=True)
class Candidate:
    """A rendered config.

    Args:
        problem (Problem): what it is rendered for.
        config (dict): its template parameters, canonical.
        source (str): the generated TileLang module.
        twin (Candidate | None): for a staged config (``num_stages > 0``), its ``num_stages = 0``
            twin, which the gate compares it with (pipelining can miscompile); :meth:`from_config`
            renders it. A candidate built from a hand-written source has none unless given one.
    """

    problem: Problem
    config: dict
    source: str
    twin: Candidate | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_config(cls, problem: Problem, config: dict) -> Candidate:
        """``config`` for ``problem``, checked against the search space and rendered.

        Raises:
            ConstraintError: the config breaks a constraint (the reasons in the message); nothing
                is rendered when a constraint that needs no measure of the kernel refuses it.
        """
        reasons, candidate = check(problem, config)
        if reasons:
            raise ConstraintError(f"config refused for {problem.variant}: " + "; ".join(reasons))
        return candidate

    @property
    def digest(self) -> str:
        """Hash of the source: any change of template or parameters changes it."""
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        p = self.problem
        return f"{p.variant}_k{p.dk}_v{p.dv}_{p.dtype}_{self.digest}"

    @functools.cached_property
    def kernels(self) -> tuple[model.Kernel, ...]:
        """The kernels of the source, as the model reads them."""
        return model.parse_kernels(self.source)

    @functools.cached_property
    def prediction(self) -> model.Prediction:
        """The register and shared-memory model's figures for the kernels."""
        return model.predict(self.kernels, self.problem.variant)


def violations(problem: Problem, config: dict) -> list[str]:
    """The reasons ``config`` is refused for ``problem`` (empty when valid), rendering it only when
    the space's constraints need a measure of the kernel."""
    return check(problem, config)[0]


def check(problem: Problem, config: dict) -> tuple[list[str], Candidate | None]:
    """The reasons ``config`` is refused for ``problem``, and its candidate when there are none.
    The answer is kept for the configs checked last, so a config the search looks at several times
    (a nearest valid config, then its proposal, then the summary) is rendered once.

    Raises:
        RenderError: the template fails to render the config (a template bug).
    """
    space = spaces.load(problem.variant)
    config = space.normalise(config)
    reasons, candidate = _checked(problem, tuple(config.items()), id(space))
    return list(reasons), candidate


@functools.lru_cache(maxsize=512)
def _checked(problem: Problem, items: tuple, space_id: int) -> tuple[tuple[str, ...], Candidate | None]:
    config = dict(items)
    sources: list[str] = []

    def measures() -> dict:
        sources.append(render(problem, config))
        return {"smem_bytes": model.shared_memory_bytes(model.parse_kernels(sources[0]))}

    reasons = spaces.load(problem.variant).violations(problem, config, measures)
    if reasons:
        return tuple(reasons), None
    twin = None
    twin_config = spaces.load(problem.variant).unstaged_twin(config)
    if twin_config is not None:
        twin_reasons, twin = check(problem, twin_config)
        if twin_reasons:
            return (f"its num_stages = 0 twin, which the gate compares it with, is refused: {'; '.join(twin_reasons)}",), None
    return (), Candidate(problem, config, sources[0] if sources else render(problem, config), twin)
