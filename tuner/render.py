"""Render a variant's Jinja template into plain TileLang Python for one config.

Rendering is all this module does: it knows the templates, not the search space, so it checks no
constraint (:mod:`tuner.candidate` does, before anything is rendered) and takes the config as given,
in its canonical form (:meth:`tuner.space.Space.normalise`). The Jinja environment is strict (an
undefined name is an error, not an empty string), and a template error is re-raised with the
template's name and line and the config that caused it.
"""
from __future__ import annotations

import functools
import json

import jinja2

from .problem import Problem
from .variants import TEMPLATES_DIR

TILELANG_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


class RenderError(RuntimeError):
    """A template failed to render: a bug in the template, not in the user's input."""


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
        # The kernels of packed sequences: a config states it only where a space offers them.
        "packed": False,
        **config,
    }


def render(problem: Problem, config: dict) -> str:
    """The source ``problem``'s template emits for ``config`` (canonical, not checked)."""
    template_name = problem.spec.template.name
    try:
        return jinja_environment().get_template(template_name).render(**context(problem, config))
    except jinja2.TemplateError as e:
        where = f"{getattr(e, 'filename', None) or template_name}:{getattr(e, 'lineno', '?')}"
        raise RenderError(f"{where}: {e} (config {config})") from e
