"""gdn's and kda's pre_seq split with every sequence walked as segments in parallel (``segments`` > 1):
the packed kernels over each sequence's segments, a state pass giving every segment but a sequence's last
its map of the state entering it, S_end = M S_start + SL, and the maps chained on the host.

CPU: the maps, as the state pass forms them (SL from a zero state, M from the identity with no values), and
the module's chain of them give the fp64 recurrence's state at every segment start; the segments are each
sequence's, counted out, every one with a successor whole chunks, which the state pass copies by cp.async
with no mask; the glue launches the state pass and the sequential kernel over the segments and reads no
tensor's values on the host, dense or packed; block_dv must divide DK. The kernels compile as modelled in
test_packed.py; the GPU tests against the fp64 oracle are test_templates_gdn.py's and
test_templates_channel.py's ``-k segments`` (dense) and test_packed.py's (packed, grouped heads).
"""
from __future__ import annotations

import pytest
import torch
from packed_checks import CONFIGS, Launched, bounds_of, delta_inputs, module_of, refuse_host_reads
from template_checks import rendered_config

from tuner import reference, space
from tuner.candidate import violations
from tuner.problem import Problem

VARIANTS = ["gdn", "kda"]


def module(variant, tmp_path, config="roles-segments", dim=64):
    return module_of(rendered_config(variant, dim, **CONFIGS[variant][config]), tmp_path)


def expected_lengths(lengths, C, segments):
    """Each sequence's segments counted out: every one but the last ceil(chunks / segments) whole chunks
    long or what whole chunks remain (none where they have run out), the last one the rest."""
    out = []
    for length in lengths:
        per_segment, whole = -(-length // (C * segments)) * C, length // C * C
        inner = [min(per_segment, max(whole - s * per_segment, 0)) for s in range(segments - 1)]
        out += inner + [length - sum(inner)]
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_segments_are_whole_chunks_of_each_sequence(variant, tmp_path):
    m = module(variant, tmp_path)
    lengths = [1, 15, 64, 65, 200, 1000, 257]
    bounds = m.segment_bounds(bounds_of(lengths))
    assert bounds.dtype == torch.int64 and bounds.shape == (len(lengths) * m.SEGMENTS + 1,)
    assert bounds.diff().tolist() == expected_lengths(lengths, m.C, m.SEGMENTS)
    # Every segment with a successor is whole chunks: the state pass loads no partial one.
    inner = bounds.diff().view(len(lengths), m.SEGMENTS)[:, :-1]
    assert (inner % m.C == 0).all()
    # Each sequence starts a segment: its first is the sequence's first token.
    assert bounds[::m.SEGMENTS].tolist() == bounds_of(lengths).tolist()


@pytest.mark.parametrize("variant", VARIANTS)
def test_chained_segment_maps_give_the_recurrence_state_at_every_segment_start(variant, tmp_path):
    """SL (the segment from a zero state) and M (from the identity, every value zero), in fp64 by the
    token-by-token oracle, through the module's entering_states: the state entering each segment is the
    oracle's state after the tokens before it, from the sequence's initial state."""
    m = module(variant, tmp_path)
    lengths, H, D = [300, 77, 700], 2, 64
    x = {name: t.double() for name, t in delta_inputs(variant, lengths, H=H, HV=H, D=D, seed=3).items()}
    bounds = m.segment_bounds(bounds_of(lengths)).tolist()

    def state_after(start, end, h0, values=None):
        part = {name: t[:, start:end] for name, t in x.items() if name != "initial_state"}
        if values is not None:
            part["v"] = values[:, start:end]
        _, ht = reference.recurrent(variant, **part, initial_state=h0, output_final_state=True)
        return ht

    maps = []
    for n in range(len(lengths)):
        for s in range(m.SEGMENTS - 1):
            start, end = bounds[n * m.SEGMENTS + s], bounds[n * m.SEGMENTS + s + 1]
            local = state_after(start, end, torch.zeros(1, H, D, D, dtype=torch.float64))
            identity = torch.eye(D, dtype=torch.float64).expand(1, H, D, D)
            transition = state_after(start, end, identity, values=torch.zeros_like(x["v"]))
            maps.append(torch.cat([local, transition], dim=-1))
    entering = m.entering_states(x["initial_state"], torch.cat(maps))
    assert entering.shape == (len(lengths) * m.SEGMENTS, H, D, D)
    for n in range(len(lengths)):
        for s in range(m.SEGMENTS):
            start = bounds[n * m.SEGMENTS + s]
            expected = state_after(bounds[n * m.SEGMENTS], start, x["initial_state"][n:n + 1])
            torch.testing.assert_close(entering[n * m.SEGMENTS + s], expected[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_the_glue_walks_the_segments_and_reads_nothing_on_the_host(variant, packed, tmp_path, monkeypatch):
    m = module(variant, tmp_path)
    lengths, H, HV = ([200, 1000, 15], 2, 4) if packed else ([600] * 2, 4, 4)
    x = delta_inputs(variant, lengths, H=H, HV=HV)
    cu_seqlens = bounds_of(lengths)
    if not packed:  # the same tokens as a dense batch of two rows
        x = {name: t if name == "initial_state" else t.view(2, 600, *t.shape[2:]) for name, t in x.items()}
    kernels = Launched()
    with monkeypatch.context() as patch:
        refuse_host_reads(patch)
        o, ht = m.forward(kernels, **x, **({"cu_seqlens": cu_seqlens} if packed else {}))
    N, S = len(lengths), m.SEGMENTS
    segments = m.segment_bounds(cu_seqlens)
    assert list(kernels.calls) == ["prepare", "segment_state", "sequential"]
    prepare, state_pass, sequential = (kernels.calls[name] for name in kernels.calls)
    # The precompute and the sequential kernel see N * SEGMENTS sequences; the state pass the segments with
    # a successor, over [SL | M], DV + DK columns.
    assert torch.equal(prepare[-2], segments) and torch.equal(sequential[-2 if variant == "gdn" else -3], segments)
    (sm,) = [a for a in state_pass if isinstance(a, torch.Tensor) and a.dim() == 4 and a.dtype == torch.float32]
    assert sm.shape == (N * (S - 1), HV, m.DK, m.DV + m.DK)
    entering, leaving = (a for a in sequential if isinstance(a, torch.Tensor) and a.shape == (N * S, HV, m.DK, m.DV))
    assert entering.dtype == leaving.dtype == torch.float32
    assert ht.shape == (N, HV, m.DK, m.DV) and o.shape[:2] == ((1, sum(lengths)) if packed else (2, 600))
    if not packed:  # a dense call's segments and chunk index are its shape's, built once
        again = Launched()
        with monkeypatch.context() as patch:
            refuse_host_reads(patch)
            m.forward(again, **x)
        assert all(a is b for a, b in zip(again.calls["prepare"][-2:], prepare[-2:]))


# The tensors the state pass reads per chunk, per variant and sequential form (gdn's role-split form weights
# rows from the cumulative gate, its one-warpgroup form reads the weights).
STATE_PASS_READS = {("gdn", "roles-segments"): ["AB", "GC", "K", "V"],
                    ("gdn", "segments"): ["AB", "K", "V", "WK", "WQ"],
                    ("kda", "roles-segments"): ["AB", "GL", "KG", "KW", "V"],
                    ("kda", "segments"): ["AB", "GL", "KG", "KW", "V"]}


@pytest.mark.parametrize("variant,config", list(STATE_PASS_READS))
def test_the_state_pass_copies_whole_chunks_only(variant, config):
    """Every segment with a successor is whole chunks, so the state pass reads each of its tensors by
    cp.async copies of whole chunks, the first chunk's before the loop and the next one's inside it,
    with no sequence mask."""
    source = rendered_config(variant, 64, **CONFIGS[variant][config]).source
    body = source[source.index("def segment_state():"):source.index("return segment_state")]
    assert "seqlen" not in body and "if_then_else(c" not in body
    copied = [line.strip().removeprefix("T.async_copy(").split("[")[0] for line in body.splitlines()
              if line.strip().startswith("T.async_copy(")]
    assert sorted(copied) == sorted(2 * STATE_PASS_READS[variant, config])


def test_segments_need_block_dv_to_divide_dk():
    gdn = space.load("gdn")
    problem = Problem("gdn", 64, 128)  # block_dv 128 divides DV, not DK
    config = {**CONFIGS["gdn"]["segments"], "packed": False, "block_dv": 128}
    (reason,) = violations(problem, gdn.complete(problem, config))
    assert "block_dv must divide DK" in reason
    assert not violations(problem, gdn.complete(problem, {**config, "segments": 1}))
