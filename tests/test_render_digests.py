"""Every kernel the tuner ever judged keeps its source: the shipped winners re-render to the digests
stored beside them, and every config of every search space (valid or not, the recurrent kernels
included) renders to the bytes recorded in tests/data/render_digests.json, hashed per variant,
dimension and split. A template change that alters emitted code fails here; where that is meant (a
new parameter value, a new form), rewrite the record with ``python tests/test_render_digests.py``
and say in the commit which configs changed.
"""
from __future__ import annotations

import hashlib
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


def grid_digests(variant: str) -> dict[str, str]:
    """``"<dk>/<split>"`` -> sha256 over the rendered sources of every grid config of ``variant`` at
    DK = DV = dk in bf16, in the grid's order (the config's JSON before each source)."""
    out: dict[str, hashlib._Hash] = {}
    sp = space.load(variant)
    for dk in variants.get(variant).dims:
        problem = Problem(variant, dk, dk, "bf16")
        for config in sp.grid():
            h = out.setdefault(f"{dk}/{config.get('split', '-')}", hashlib.sha256())
            h.update(json.dumps(config, sort_keys=True).encode())
            h.update(render(problem, config).encode())
    return {key: h.hexdigest() for key, h in out.items()}


def all_grid_digests() -> dict[str, dict[str, str]]:
    with ProcessPoolExecutor(2) as pool:
        return dict(zip(NAMES, pool.map(grid_digests, NAMES)))


def test_every_shipped_winner_renders_to_its_stored_digest():
    winners = Store(paths.SHIPPED_DB, readonly=True).winners()
    assert winners
    for w in winners:
        assert Candidate.from_config(w.problem, w.config).digest == w.digest, (w.problem, w.config)


@pytest.mark.slow
def test_every_config_of_every_space_renders_as_recorded():
    recorded = json.loads(RECORD.read_text())
    assert all_grid_digests() == recorded


if __name__ == "__main__":
    RECORD.write_text(json.dumps(all_grid_digests(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}", file=sys.stderr)
