"""Search spaces: each variant's tunable parameters and constraints, read from
``search_spaces/<variant>.yaml``, the one file that the tuner, the docs and the tests all read.

A parameter has a list of ``values``, a ``default``, a ``doc`` line and optionally ``when``, an
expression over the other parameters that says when it applies (``split == 'fused'``). In place of
a default, a parameter may ``inherit`` another's value (``block_dv_o`` inherits ``block_dv``): a
config states it only where it differs, so a parameter added to a template this way leaves every
config from before it, and its kernel and digest, as it was. A parameter may also have
``caller_values``: values the caller sets (``tune --fix``, :mod:`tuner.ops` for a packed call), which
the search never draws; a config states such a parameter only at one of them, so it too leaves every
config from before it as it was. A parameter with ``implicit_default`` is stated only where it differs
from its default (the template reads an unstated one as its default): a searched parameter added to a
template this way leaves every config from before it, and its kernel and digest, as they were. A
constraint is a readable expression over the parameters and the problem's ``dk``, ``dv`` and
``dtype``, with the ``reason`` reported when it fails. Expressions may also use ``smem_limit``, the
per-block limit, and the measures of a rendered kernel (:data:`MEASURES`: ``smem_bytes``, its
shared memory), which the caller supplies: this module knows the space, not the kernels.
"""
from __future__ import annotations

import ast
import functools
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from . import variants
from .errors import ConstraintError, UserError
from .problem import Problem

# Largest dynamic shared memory one block may use on sm_90 (227 KiB).
SMEM_LIMIT = 232448
# Names a constraint may use that only the rendered kernel can tell (supplied by the caller).
MEASURES = ("smem_bytes",)


@dataclass(frozen=True)
class Parameter:
    name: str
    values: tuple
    default: Any
    doc: str
    when: str | None = None
    # The parameter whose value this one takes when a config does not state it (then default is None).
    inherit: str | None = None
    # Values only a caller sets, never drawn by the search; a config states the parameter only at one of them.
    caller_values: tuple = ()
    # The other parameters' values (name, value) in the default config of a caller that sets a caller value.
    caller_default: tuple = ()
    # Stated by a config only off its default (added after configs were stored; the template reads it unstated).
    implicit_default: bool = False
    # The value in a staged config's num_stages = 0 twin (a form that cannot run unstaged is compared
    # with one that can); None: the config's own.
    unstaged: Any = None
    # implicit_default: the value a config that does not state it means (its declared default; a search
    # that fixes the parameter moves ``default``, not this).
    unstated: Any = None

    @property
    def accepted(self) -> tuple:
        """Every value a config may hold: the searched ones and the caller's."""
        return (*self.values, *self.caller_values)


@dataclass(frozen=True)
class Constraint:
    require: str
    reason: str
    when: str | None = None


@dataclass(frozen=True)
class Space:
    variant: str
    params: dict[str, Parameter]
    constraints: tuple[Constraint, ...] = field(default_factory=tuple)
    # (name, value) pairs held at one value by :meth:`fix`.
    fixed: tuple[tuple[str, Any], ...] = ()

    def active(self, name: str, config: dict) -> bool:
        """Whether parameter ``name`` applies given the other values in ``config``. A caller's parameter
        that ``config`` leaves out is at its default (:meth:`normalise` leaves it out there)."""
        p = self.params[name]
        if p.when is None:
            return True
        absent = self._absent_callers.get(name)
        return bool(_eval(p.when, {**absent, **config} if absent else config, None))

    @functools.cached_property
    def _absent_callers(self) -> dict[str, dict]:
        """Per parameter whose condition reads a caller's parameter: those parameters at their defaults,
        the values a config that leaves them out holds."""
        callers = {n: p.default for n, p in self.params.items() if p.caller_values}
        out = {}
        for name, p in self.params.items():
            read = _names_read(p.when) & set(callers)
            if read:
                out[name] = {n: callers[n] for n in read}
        return out

    def default(self, problem: Problem, caller: dict | None = None) -> dict:
        """The template's default config, restricted to the parameters that apply. ``caller``: caller
        parameters at a caller value (``{"packed": True}``): the default of a caller that needs them, with
        their ``caller_default`` too."""
        config = self._defaults()
        for name, value in (caller or {}).items():
            p = self._parameter(name)
            if value not in p.caller_values:
                raise UserError(f"{name}={value!r} is not one of the caller's values {list(p.caller_values)}")
            config.update(dict(p.caller_default), **{name: value})
        return self.normalise(config)

    def _defaults(self) -> dict:
        return {name: p.default for name, p in self.params.items() if p.default is not None}

    def normalise(self, config: dict) -> dict:
        """Drop the parameters that do not apply, the inherited ones at the value they would inherit
        and the caller's ones at a searched value; order as declared. Every config has this one
        canonical form."""
        return {n: config[n] for n, p in self.params.items()
                if n in config and self.active(n, config)
                and not (p.inherit is not None and config[n] == config.get(p.inherit))
                and not (p.caller_values and config[n] not in p.caller_values)
                and not (p.implicit_default and config[n] == p.unstated)}

    def stated(self, config: dict) -> dict:
        """``config`` with every inherited or implicit parameter that applies stated at its value: what
        the search is told a config's parameters are (Optuna draws an unstated one at random)."""
        out = dict(config)
        for name, p in self.params.items():
            if p.inherit is not None and name not in out and p.inherit in out and self.active(name, out):
                out[name] = out[p.inherit]
            elif p.implicit_default and name not in out and self.active(name, out):
                out[name] = p.default
        return {n: out[n] for n in self.params if n in out}

    def unstaged_twin(self, config: dict) -> dict | None:
        """The ``num_stages = 0`` twin of a staged config, which the gate compares it with
        (pipelining can miscompile), with each parameter that declares an ``unstaged`` value at
        it; None for an unstaged config."""
        if config.get("num_stages", 0) == 0:
            return None
        twin = {**config, "num_stages": 0}
        twin.update({n: p.unstaged for n, p in self.params.items() if p.unstaged is not None and n in config})
        return self.normalise(twin)

    def complete(self, problem: Problem, overrides: dict) -> dict:
        """The default config with ``overrides`` (name -> value, possibly strings) applied."""
        config = self._defaults()
        for name, raw in overrides.items():
            config[name] = self._coerce(self._parameter(name), raw)
        return self.normalise(config)

    def fix(self, values: dict) -> Space:
        """This space with each parameter of ``values`` (name -> value, possibly a string) held at
        that value: the space of a search that leaves those parameters alone."""
        params, fixed = dict(self.params), dict(self.fixed)
        for name, raw in values.items():
            value = self._coerce(self._parameter(name), raw)
            params[name] = replace(params[name], values=(value,), default=value)
            fixed[name] = value
        return replace(self, params=params, fixed=tuple(fixed.items()))

    def _parameter(self, name: str) -> Parameter:
        if name not in self.params:
            raise UserError(f"unknown parameter {name!r} for {self.variant}; accepted: {', '.join(self.params)}")
        return self.params[name]

    def violations(self, problem: Problem, config: dict,
                   measures: Callable[[], Mapping[str, Any]] | None = None) -> list[str]:
        """The reasons ``config`` is refused for ``problem``; empty when it is valid.

        ``measures`` gives the :data:`MEASURES` of the config's rendered kernel; it is called only
        when the constraints that need none pass (rendering costs more than they do). A constraint
        that needs a measure with no ``measures`` to give it is a ValueError."""
        reasons = []
        for name, p in self.params.items():
            if name in config and config[name] not in p.accepted:
                reasons.append(f"{name}={config[name]!r} is not one of {list(p.accepted)}")
            elif (name not in config and p.inherit is None and not p.caller_values and not p.implicit_default
                  and self.active(name, {**self._defaults(), **config})):
                reasons.append(f"{name} is missing")
        if reasons:
            return reasons
        # Inherited and implicit parameters at the values the template reads them as.
        env = _ConstraintScope(problem, self.stated(config), measures)
        cheap = [c for c in self.constraints if not any(m in c.require for m in MEASURES)]
        for batch in (cheap, [c for c in self.constraints if c not in cheap]):
            for c in batch:
                if c.when is not None and not _eval(c.when, config, env):
                    continue
                if not _eval(c.require, config, env):
                    reasons.append(f"{c.reason} ({c.require})")
            if reasons:
                break
        return reasons

    def validate(self, problem: Problem, config: dict, measures: Callable[[], Mapping[str, Any]] | None = None) -> None:
        """Raise ConstraintError with the reasons when :meth:`violations` finds any."""
        reasons = self.violations(problem, config, measures)
        if reasons:
            raise ConstraintError(f"config refused for {problem.variant}: " + "; ".join(reasons))

    def digest(self) -> str:
        """A short hash of the parameters' names and values: what a search draws from."""
        import hashlib

        domains = repr([(name, p.values) for name, p in self.params.items()])
        return hashlib.sha256(domains.encode()).hexdigest()[:8]

    def nearest_valid(self, config: dict, rng, is_valid: Callable[[dict], bool]) -> dict | None:
        """A config ``is_valid`` accepts that changes the fewest parameters of ``config``, ties
        drawn with ``rng`` (a ``random.Random``); None when it accepts none of the space. Where the
        search goes when a proposal breaks a constraint: TPE sees every broken constraint as equally
        bad, so in a space that is mostly invalid it keeps proposing invalid configs."""
        def changed(other: dict) -> int:
            return sum(config.get(name) != other.get(name) for name in {*config, *other})

        # Searched outwards by the number of parameters set to another value, never listing the grid (kda's
        # holds millions of configs): a config that differs from ``config`` in m parameters is reached by
        # at most m such changes, so once as many changes as the best distance found have been tried, every
        # valid config at that distance (the ties) has been seen and none nearer is left.
        start = {**self._defaults(), **config}
        alternatives = [[(name, v) for v in p.values if v != start.get(name)] for name, p in self.params.items()]
        alternatives = [a for a in alternatives if a]
        seen, best, ties = set(), None, []
        for count in range(len(alternatives) + 1):
            if best is not None and count > best:
                break
            for chosen in itertools.combinations(alternatives, count):
                for changes in itertools.product(*chosen):
                    candidate = self.normalise({**start, **dict(changes)})
                    key = tuple(sorted(candidate.items()))
                    distance = changed(candidate)
                    if key in seen or (best is not None and distance > best):
                        continue
                    seen.add(key)
                    if is_valid(candidate):
                        if best is None or distance < best:
                            best, ties = distance, []
                        ties.append(candidate)
        return rng.choice(ties) if ties else None

    def grid(self) -> list[dict]:
        """Every combination of values, restricted to the parameters that apply (deduplicated)."""
        return [dict(c) for c in self._grid]

    @functools.cached_property
    def _grid(self) -> tuple[dict, ...]:
        """The normalised configs of the product of all values, first occurrences in product order.
        A parameter that does not apply given the ones declared before it, and whose value no
        condition or inheritance reads, takes only its first value: the others normalise to the
        same configs later in the product, so the grid and its order are unchanged."""
        names = list(self.params)
        reads = {n: _names_read(p.when) for n, p in self.params.items()}
        read_by_others = set().union(*reads.values()) | {p.inherit for p in self.params.values() if p.inherit}
        # Whether a parameter's condition can be settled by the ones before it, and no one reads it.
        skippable = [name not in read_by_others and reads[name] <= set(names[:index])
                     for index, name in enumerate(names)]
        seen, out = set(), []

        def walk(index: int, partial: dict) -> None:
            if index == len(names):
                cfg = self.normalise(partial)
                key = tuple(sorted(cfg.items()))
                if key not in seen:
                    seen.add(key)
                    out.append(cfg)
                return
            name = names[index]
            values = self.params[name].values
            if skippable[index] and not self.active(name, partial):
                values = values[:1]
            for value in values:
                partial[name] = value
                walk(index + 1, partial)
            del partial[name]

        walk(0, {})
        return tuple(out)

    @staticmethod
    def _coerce(p: Parameter, raw):
        if not isinstance(raw, str):
            return raw
        for v in p.accepted:
            if str(v).lower() == raw.lower():
                return v
        raise UserError(f"{p.name}={raw} is not one of {list(p.accepted)}")


class _ConstraintScope(dict):
    """Names available to constraint expressions; the measures are asked for on first use."""

    def __init__(self, problem: Problem, config: dict, measures: Callable[[], Mapping[str, Any]] | None):
        super().__init__(config)
        self.update(dk=problem.dk, dv=problem.dv, dtype=problem.dtype, smem_limit=SMEM_LIMIT)
        self._measures = measures

    def __missing__(self, key):
        if key in MEASURES:
            if self._measures is None:
                raise ValueError(f"a constraint needs {key}, a measure of the rendered kernel, and none was given")
            self.update(self._measures())
            return self[key]
        raise KeyError(key)


def _names_read(expr: str | None) -> set[str]:
    """The names a condition reads (none without one)."""
    if not expr:
        return set()
    return {node.id for node in ast.walk(ast.parse(expr, mode="eval")) if isinstance(node, ast.Name)}


def _eval(expr: str, config: dict, env: dict | None):
    scope = env if env is not None else dict(config)
    try:
        return eval(expr, {"__builtins__": {}}, scope)  # noqa: S307 - expressions come from our own YAML
    except NameError:
        # A name of a parameter that does not apply: the expression does not constrain this config.
        return True


@functools.cache
def load(variant: str) -> Space:
    """The search space of ``variant`` from its YAML file."""
    spec = variants.get(variant)
    with open(spec.search_space) as f:
        doc = yaml.safe_load(f)
    params = {
        name: Parameter(name, tuple(p["values"]), p.get("default"), p.get("doc", ""), p.get("when"), p.get("inherit"),
                        tuple(p.get("caller_values", ())), tuple(p.get("caller_default", {}).items()),
                        bool(p.get("implicit_default", False)), p.get("unstaged"),
                        p.get("default") if p.get("implicit_default", False) else None)
        for name, p in doc["parameters"].items()
    }
    constraints = tuple(Constraint(c["require"], c["reason"], c.get("when")) for c in doc.get("constraints", ()))
    for p in params.values():
        if p.inherit is None and p.default not in p.values:
            raise ValueError(f"{spec.search_space}: default of {p.name} is not among its values")
        if p.inherit is not None and (p.default is not None or p.inherit not in params):
            raise ValueError(f"{spec.search_space}: {p.name} inherits {p.inherit!r}: it needs that parameter and no default")
    return Space(variant, params, constraints)
