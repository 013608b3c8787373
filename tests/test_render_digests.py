"""Every kernel the tuner ever judged keeps its source: the shipped winners re-render to the digests
stored beside them, and the configs of every search space that cover each combination of four
parameter values (valid or not, the recurrent kernels included: each split's defaults with any one
to four of its parameters changed) render to the bytes recorded in tests/data/render_digests.json,
hashed per variant, dimension and split. A template change that alters emitted code fails here; where
that is meant (a new parameter value, a new form), rewrite the record with ``python
tests/test_render_digests.py`` and say in the commit which configs changed. Not the whole product:
kda's pre_seq split alone has millions of configs (kda's whole grid took 10.6 minutes to render on one core
when it had 200,448), where a change that shows only when five parameters are off their defaults
together is rare, and the shipped winners are checked one by one.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from tuner import paths, space, variants
from tuner.problem import Problem
from tuner.candidate import Candidate
from tuner.render import render
from tuner.store import Store

RECORD = Path(__file__).parent / "data" / "render_digests.json"
NAMES = (*variants.VARIANTS, *variants.RECURRENT)


def covering_configs(sp: space.Space, changed: int = 4) -> list[dict]:
    """For each split (the one base of a space without one): its default config, then that config with
    every set of up to ``changed`` parameters changed to other values of theirs, in declaration order,
    normalised, each config once."""
    names = [n for n in sp.params if n != "split"]
    defaults = sp._defaults()
    bases = [{**defaults, "split": s} for s in sp.params["split"].values] if "split" in sp.params else [defaults]
    seen, out = set(), []
    for base in bases:
        changes = [(n, v) for n in names for v in sp.params[n].values if v != base.get(n)]
        for count in range(changed + 1):
            for subset in itertools.combinations(changes, count):
                if len({n for n, _ in subset}) < count:
                    continue  # two values of one parameter
                config = sp.normalise({**base, **dict(subset)})
                key = tuple(sorted(config.items()))
                if key not in seen:
                    seen.add(key)
                    out.append(config)
    return out


def record_digests(variant: str) -> dict[str, str]:
    """``"<dk>/<split>"`` -> sha256 over the rendered sources of ``variant``'s covering configs at
    DK = DV = dk in bf16, in their order (the config's JSON before each source)."""
    out: dict[str, hashlib._Hash] = {}
    sp = space.load(variant)
    for dk in variants.get(variant).dims:
        problem = Problem(variant, dk, dk, "bf16")
        for config in covering_configs(sp):
            h = out.setdefault(f"{dk}/{config.get('split', '-')}", hashlib.sha256())
            h.update(json.dumps(config, sort_keys=True).encode())
            h.update(render(problem, config).encode())
    return {key: h.hexdigest() for key, h in out.items()}


def all_record_digests() -> dict[str, dict[str, str]]:
    with ProcessPoolExecutor(2) as pool:
        return dict(zip(NAMES, pool.map(record_digests, NAMES)))


def test_every_shipped_winner_renders_to_its_stored_digest():
    winners = Store(paths.SHIPPED_DB, readonly=True).winners()
    assert winners
    for w in winners:
        assert Candidate.from_config(w.problem, w.config).digest == w.digest, (w.problem, w.config)


@pytest.mark.slow
def test_every_four_parameter_values_of_every_space_render_as_recorded():
    recorded = json.loads(RECORD.read_text())
    assert all_record_digests() == recorded


if __name__ == "__main__":
    RECORD.write_text(json.dumps(all_record_digests(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}", file=sys.stderr)
