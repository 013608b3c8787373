"""Render a variant's Jinja template into plain TileLang Python for one config.

The Jinja environment is strict (an undefined name is an error, not an empty string), and a
template error is re-raised with the template's name and line and the config that caused it.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

import jinja2

from . import space as spaces
from .problem import Problem
from .variants import TEMPLATES_DIR

TILELANG_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


class RenderError(RuntimeError):
    """A template failed to render: a bug in the template, not in the user's input."""


@dataclass(frozen=True)
class Rendered:
    problem: Problem
    config: dict
    source: str

    @property
    def digest(self) -> str:
        """Hash of the rendered source: any change of template or parameters changes it."""
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        p = self.problem
        return f"{p.variant}_k{p.dk}_v{p.dv}_{p.dtype}_{self.digest}"


@functools.cache
def jinja_environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def context(problem: Problem, config: dict) -> dict:
    """The names a template sees: the problem, the config's parameters, and the dtypes."""
    return {
        "variant": problem.variant,
        "dk": problem.dk,
        "dv": problem.dv,
        "dtype": TILELANG_DTYPES[problem.dtype],
        "accum_dtype": "float32",
        "config_json": json.dumps(config, sort_keys=True),
        **config,
    }


def render(problem: Problem, config: dict) -> Rendered:
    """The TileLang source of ``problem``'s kernel for ``config``.

    Raises ConstraintError (before rendering anything) when the config breaks a constraint of
    the variant's search space, with the reason.
    """
    space = spaces.load(problem.variant)
    config = space.normalise(config)
    space.validate(problem, config)
    return Rendered(problem, config, render_unchecked(problem, config))


def render_unchecked(problem: Problem, config: dict) -> str:
    """The source the template emits for ``config`` (in its canonical form), whether or not the
    config keeps the space's constraints: what the model measures, and what a test renders to show
    that a constraint stands for a real compiler refusal."""
    config = spaces.load(problem.variant).normalise(config)
    template_name = problem.spec.template.name
    try:
        return jinja_environment().get_template(template_name).render(**context(problem, config))
    except jinja2.TemplateError as e:
        where = f"{getattr(e, 'filename', None) or template_name}:{getattr(e, 'lineno', '?')}"
        raise RenderError(f"{where}: {e} (config {config})") from e
