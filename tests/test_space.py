"""Search spaces: every variant's file loads, its defaults are valid, and broken configs are refused
with their reason before a kernel is rendered; the measures of a rendered kernel come from the caller."""
import random

import pytest

from tuner import model, space, variants
from tuner.candidate import Candidate, violations
from tuner.errors import ConstraintError, UserError
from tuner.problem import Problem
from tuner.render import render

ALL = list(variants.VARIANTS)


@pytest.mark.parametrize("variant", ALL)
@pytest.mark.parametrize("dim", [64, 128])
def test_default_config_is_valid_and_documented(variant, dim):
    sp = space.load(variant)
    problem = Problem(variant, dim, dim)
    assert violations(problem, sp.default(problem)) == []
    for p in sp.params.values():
        assert p.doc, f"{variant}.{p.name} has no doc"


@pytest.mark.parametrize("variant", ALL)
def test_block_dv_not_dividing_dv_is_refused_with_its_reason(variant):
    problem = Problem(variant, 128, 64)
    config = space.load(variant).complete(problem, {"block_dv": "128"})
    with pytest.raises(ConstraintError, match="block_dv"):
        Candidate.from_config(problem, config)


def test_config_over_the_shared_memory_limit_is_refused():
    problem = Problem("decay", 128, 128)
    sp = space.load("decay")
    config = sp.complete(problem, {"num_stages": "4", "warp_specialized": "true", "qk_in": "shared",
                                   "decay_in": "shared", "block_dv": "64"})
    assert model.shared_memory_bytes(model.parse_kernels(render(problem, config))) > space.SMEM_LIMIT
    with pytest.raises(ConstraintError, match="shared memory"):
        Candidate.from_config(problem, config)


def test_the_measures_are_asked_for_only_when_the_other_constraints_pass_and_needed():
    problem = Problem("decay", 128, 128)
    sp = space.load("decay")
    asked = []

    def measures():
        asked.append(1)
        return {"smem_bytes": space.SMEM_LIMIT + 1}

    cheap_break = {**sp.default(problem), "warp_specialized": False, "num_stages": 2}
    assert sp.violations(problem, cheap_break, measures) and not asked
    assert sp.violations(problem, sp.default(problem), measures) == [
        "the shared memory of the config must fit one block's limit on sm_90 (smem_bytes <= smem_limit)"]
    assert asked == [1]
    with pytest.raises(ValueError, match="needs smem_bytes"):
        sp.violations(problem, sp.default(problem))


def test_overrides_are_coerced_and_unknown_names_refused():
    problem = Problem("gdn", 128, 128)
    sp = space.load("gdn")
    assert sp.complete(problem, {"block_dv": "64"})["block_dv"] == 64
    with pytest.raises(UserError, match="unknown parameter 'bogus'"):
        sp.complete(problem, {"bogus": "1"})
    with pytest.raises(UserError, match="not one of"):
        sp.complete(problem, {"block_dv": "48"})


def test_fix_holds_parameters_at_one_value_and_leaves_the_rest():
    problem = Problem("gdn", 128, 128)
    sp = space.load("gdn")
    held = sp.fix({"split": "chunked", "block_dv": "64"})
    assert held.fixed == (("split", "chunked"), ("block_dv", 64))
    assert held.default(problem) == {**sp.default(problem), "block_dv": 64}
    grid = held.grid()
    assert {(c["split"], c["block_dv"]) for c in grid} == {("chunked", 64)}
    assert {c["solve"] for c in grid} == set(sp.params["solve"].values)  # the rest still varies
    assert violations(problem, {**held.default(problem), "block_dv": 32}) == []  # valid in the whole space,
    assert held.violations(problem, {**held.default(problem), "block_dv": 32})  # but outside the held one
    assert sp.fix({}) == sp and sp.params["block_dv"].values == (16, 32, 64, 128)  # the loaded space is untouched
    with pytest.raises(UserError, match="unknown parameter 'bogus'"):
        sp.fix({"bogus": "1"})
    with pytest.raises(UserError, match="not one of"):
        sp.fix({"block_dv": "48"})


def test_a_refused_config_is_steered_to_a_valid_one_with_the_fewest_changes():
    problem = Problem("gdn", 128, 128)
    sp = space.load("gdn")
    default = sp.default(problem)
    # 256 threads break a constraint of the chunked split that one change repairs two ways: back to 128
    # threads, or the output kernel's score tile in shared memory; the draw picks among those only.
    valid = lambda c: not violations(problem, c)  # noqa: E731
    refused = {**default, "threads": 256}
    assert violations(problem, refused)
    drawn = {tuple(sorted(sp.nearest_valid(refused, random.Random(seed), valid).items())) for seed in range(20)}
    assert drawn == {tuple(sorted(default.items())), tuple(sorted({**refused, "scores_in": "shared"}.items()))}
    # Fused, warp-specialised, two stages: the one valid config a single change away is chunked.
    refused = {**default, "split": "fused", "warp_specialized": True, "num_stages": 2}
    assert violations(problem, refused)
    assert sp.nearest_valid(refused, random.Random(0), valid) == {**refused, "split": "chunked"}


def test_ties_among_the_nearest_valid_configs_are_drawn_at_random():
    problem = Problem("linear", 64, 64)
    sp = space.load("linear")
    # Two stages without warp specialisation: warp specialisation on, or 0 or 1 stage, mends it.
    refused = {**sp.default(problem), "warp_specialized": False, "num_stages": 2}
    assert violations(problem, refused)
    valid = lambda c: not violations(problem, c)  # noqa: E731
    drawn = {tuple(sorted(sp.nearest_valid(refused, random.Random(seed), valid).items())) for seed in range(40)}
    assert drawn == {tuple(sorted({**refused, **change}.items()))
                     for change in ({"warp_specialized": True}, {"num_stages": 0}, {"num_stages": 1})}


def test_nearest_valid_is_none_when_nothing_in_the_space_is_valid():
    problem = Problem("linear", 64, 64)
    sp = space.load("linear").fix({"warp_specialized": "false", "num_stages": "2"})
    assert sp.nearest_valid(sp.default(problem), random.Random(0), lambda c: not sp.violations(problem, c)) is None


def test_an_inherited_parameter_is_stated_only_where_it_differs():
    problem = Problem("gdn", 128, 128)
    sp = space.load("gdn")
    default = sp.default(problem)  # chunked, block_dv 32, block_dv_o unstated
    assert "block_dv_o" not in default and sp.params["block_dv_o"].inherit == "block_dv"
    # One canonical form: stating the inherited value is the same config and the same kernel.
    assert sp.normalise({**default, "block_dv_o": 32}) == default
    digest = lambda c: Candidate.from_config(problem, c).digest  # noqa: E731
    assert digest({**default, "block_dv_o": 32}) == digest(default)
    wider = {**default, "block_dv_o": 128}
    assert sp.normalise(wider) == wider and violations(problem, wider) == []
    assert digest(wider) != digest(default)
    # What the search is told: every inherited (and implicit) parameter that applies, at its value.
    implicit = {"scores_in": "fragment"}
    assert sp.stated(default) == {**default, "block_dv_o": 32, **implicit} and sp.stated(wider) == {**wider, **implicit}
    fused = {**sp.default(problem), "split": "fused"}
    assert sp.normalise({**fused, "block_dv_o": 128}) == sp.stated(fused) == fused  # it does not apply
    # Every chunked config with the others at the default's values (the whole grid is hundreds of thousands).
    chunked = sp.fix({n: v for n, v in sp.stated(default).items() if n not in ("block_dv", "block_dv_o")}).grid()
    assert {c["block_dv"] for c in chunked} == set(sp.params["block_dv"].values)
    assert all(c.get("block_dv_o") != c["block_dv"] for c in chunked)
    assert len(chunked) == 4 * len({tuple((k, v) for k, v in c.items() if k != "block_dv_o") for c in chunked})
    assert violations(Problem("gdn", 64, 64), wider) == [
        "block_dv_o must divide DV: the output kernel's grid has DV / block_dv_o column blocks (dv % block_dv_o == 0)"]
    with pytest.raises(UserError, match="not one of"):
        sp.complete(problem, {"block_dv_o": "48"})


def test_an_implicit_default_is_stated_only_off_its_default_so_earlier_configs_keep_their_kernels():
    problem = Problem("simple_gla", 128, 128)
    sp = space.load("simple_gla")
    assert sp.params["gate_cumsum"].implicit_default and sp.params["gate_cumsum"].default == "in_loop"
    default = sp.default(problem)  # fused
    assert "gate_cumsum" not in default and violations(problem, default) == []  # unstated is not missing
    digest = lambda c: Candidate.from_config(problem, c).digest  # noqa: E731
    assert sp.normalise({**default, "gate_cumsum": "in_loop"}) == default
    assert digest({**default, "gate_cumsum": "in_loop"}) == digest(default)
    prepass = {**default, "gate_cumsum": "prepass"}
    assert sp.normalise(prepass) == prepass and digest(prepass) != digest(default)
    # The search is told the value that applies; where it does not apply, nothing.
    assert sp.stated(default) == {**default, "gate_cumsum": "in_loop"}
    chunked = sp.default(problem, None) | {"split": "chunked"}
    assert "gate_cumsum" not in sp.stated(sp.normalise(chunked))
    assert sp.normalise({**chunked, "gate_cumsum": "prepass"}) == sp.normalise(chunked)


def test_an_implicit_parameter_fixed_off_its_default_stays_stated():
    """``tune --fix sequential_roles=true``: the fixed space's configs keep the value, so what is
    rendered and checked is the role-split kernel, not the one a config without it means."""
    problem = Problem("gdn", 128, 128)
    fixed = space.load("gdn").fix({"split": "pre_seq", "solve": "merged", "block_dv": "64",
                                   "sequential_roles": "true", "num_stages": "2"})
    config = fixed.complete(problem, {})
    assert config["sequential_roles"] is True and fixed.normalise(config)["sequential_roles"] is True
    assert violations(problem, config) == []
    # unfixed, its default (false) is still left unstated
    assert "sequential_roles" not in space.load("gdn").normalise({**config, "sequential_roles": False})


def test_an_inherited_parameter_with_a_default_or_nothing_to_inherit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(variants, "SEARCH_SPACES_DIR", tmp_path)
    for bad in ("    inherit: block_dv\n    default: 64\n", "    inherit: block_size\n"):
        (tmp_path / "gdn.yaml").write_text("parameters:\n  block_dv:\n    values: [32, 64]\n    default: 32\n"
                                           "  block_dv_o:\n    values: [32, 64]\n" + bad)
        space.load.cache_clear()
        with pytest.raises(ValueError, match="block_dv_o inherits"):
            space.load("gdn")
    monkeypatch.undo()
    space.load.cache_clear()
    assert space.load("gdn").params["block_dv_o"].inherit == "block_dv"


@pytest.mark.parametrize("variant", ["linear", "gla", "gdn_recurrent", "gdn"])
def test_the_grid_is_the_full_products_normalised_configs_in_order(variant):
    """The grid skips the values of parameters that do not apply; it must still be every distinct
    normalised config of the whole product, each where the product first reaches it. gdn, whose
    conditional parameters are where it skips most, with five unconditional ones, three of pre_seq's and
    gc_loads cut to two values, and chunk_size, tail_loads and sequence_groups (a packed kernel's, never in
    the searched grid), new_values (only v_swizzle's condition reads it), output_scores_in, values_loads,
    v_swizzle, prepare_min_blocks, fast_math, prepare_grid and o_store (no condition reads them) and
    sequential_min_blocks (only the packed kernels' constraint reads it) cut to one
    (its full product is about 2.4 trillion; cut so, about 790,000, each normalised in some 150 us)."""
    import dataclasses
    import itertools

    sp = space.load(variant)
    if variant == "gdn":
        kept = {"block_dv": 2, "block_dv_o": 2, "num_stages": 2, "decay_in": 2, "solve": 2, "chunk_size": 1,
                "segments": 2, "prepare_loads": 2, "prepare_chunks": 2, "tail_loads": 1, "sequence_groups": 1,
                "new_values": 1, "output_scores_in": 1, "values_loads": 1, "v_swizzle": 1, "gc_loads": 2,
                "prepare_min_blocks": 1, "fast_math": 1, "prepare_grid": 1, "o_store": 1,
                "sequential_min_blocks": 1}
        sp = dataclasses.replace(sp, params={n: dataclasses.replace(p, values=tuple(p.values)[:kept[n]]) if n in kept
                                             else p for n, p in sp.params.items()})
    names = list(sp.params)
    first: dict[tuple, dict] = {}
    for combo in itertools.product(*(sp.params[n].values for n in names)):
        config = sp.normalise(dict(zip(names, combo)))
        first.setdefault(tuple(sorted(config.items())), config)
    assert sp.grid() == list(first.values())
