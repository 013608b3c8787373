"""Decode: the token-by-token kernels on a pool of states (templates/recurrent.py.j2,
search_spaces/recurrent.yaml, tuner/decode.py).

CPU: every variant's kernel compiles for sm_90a in both pool layouts (and gdn/kda with the state in
shared memory) without spills or a screen rejection (ptxas); every parameter changes the code; the
op wrappers' translation (FLA's form to slots and lengths, the pool form's indices, grouped value
heads, the transposed layout) is checked against the fp64 oracle with the kernel's step replaced
by the oracle run on each sequence; the config is looked up once per shape bucket. GPU: the kernels
against the oracle, 100 decode steps in a row through a pool (random, non-contiguous slots and
padding; slots not named bitwise unchanged), several tokens per sequence, a CUDA graph replay.
"""
from __future__ import annotations

import pytest
import torch
from template_checks import assert_compiles_clean, assert_every_value_changes_source, cuda, rendered_config

from tuner import decode, reference, space, variants
from tuner.problem import Problem

BASES = list(variants.VARIANTS)
OPS = {
    "gdn": lambda q, k, v, g, beta, **kw: decode.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw),
    "kda": lambda q, k, v, g, beta, **kw: decode.fused_recurrent_kda(q, k, v, g, beta, **kw),
    "simple_gla": lambda q, k, v, g, beta, **kw: decode.fused_recurrent_simple_gla(q, k, v, g=g, **kw),
    "decay": lambda q, k, v, g, beta, **kw: decode.fused_recurrent_simple_gla(q, k, v, g_gamma=g, **kw),
    "gla": lambda q, k, v, g, beta, **kw: decode.fused_recurrent_gla(q, k, v, gk=g, **kw),
    "linear": lambda q, k, v, g, beta, **kw: decode.fused_recurrent_simple_gla(q, k, v, **kw),
}


def test_every_variant_has_a_recurrent_kernel_sharing_one_template_and_space():
    assert set(variants.RECURRENT) == {variants.recurrent_name(v) for v in variants.VARIANTS}
    for name, spec in variants.RECURRENT.items():
        base = variants.VARIANTS[spec.recurrence_of]
        assert (spec.decay_per, spec.delta, spec.recurrence) == (base.decay_per, base.delta, base.recurrence)
        assert spec.template.name == "recurrent.py.j2" and spec.search_space.name == "recurrent.yaml"
        assert variants.get(name) is spec and Problem(name, 128, 128).spec is spec
    assert all(v.recurrence_of is None for v in variants.VARIANTS.values())


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("base", BASES)
def test_every_form_compiles_without_spills_or_screen_rejection(base, layout, tmp_path):
    assert_compiles_clean(rendered_config(variants.recurrent_name(base), 128, layout=layout), ["recurrent"], tmp_path)


@pytest.mark.parametrize("base", ["gdn", "kda"])
def test_state_in_shared_memory_compiles_clean(base, tmp_path):
    report = assert_compiles_clean(rendered_config(variants.recurrent_name(base), 128, state_in="shared"),
                                   ["recurrent"], tmp_path)
    # The [DK, block_dv] fp32 state tile is in shared memory (and nowhere else).
    assert report.kernels[0].dynamic_smem_bytes >= 128 * 32 * 4


@pytest.mark.parametrize("state_in,layout", [("fragment", "kv"), ("shared", "vk")])
@pytest.mark.parametrize("base", ["gdn", "kda", "simple_gla"])
def test_a_slot_per_token_compiles_clean(base, state_in, layout, tmp_path):
    rendered = rendered_config(variants.recurrent_name(base), 128, state_in=state_in, layout=layout,
                               token_states=True)
    assert_compiles_clean(rendered, ["recurrent"], tmp_path)
    assert "SlotOf: T.Tensor([N, W]" in rendered.source and "Accepted" in rendered.source


@pytest.mark.parametrize("param", list(space.load("gdn_recurrent").params))
def test_every_parameter_changes_the_code(param):
    assert_every_value_changes_source("gdn_recurrent", 128, param)


def test_the_model_prunes_a_state_tile_that_spills_and_keeps_the_default(tmp_path):
    from tuner.compile import build_kernels

    wide = rendered_config("gdn_recurrent", 128, block_dv=128, threads=64)  # 16384 fp32 over 64 threads
    report, _, _ = build_kernels(wide, cache_dir=tmp_path)
    assert report.spills and wide.prediction.prune_reason() is not None
    default = rendered_config("gdn_recurrent", 128)
    report, _, _ = build_kernels(default, cache_dir=tmp_path)
    assert not report.spills and default.prediction.prune_reason() is None


# ---- the op wrappers, their kernel step replaced by the oracle --------------------------------------


def oracle_step(base: str, layout: str):
    """A stand-in for a generated module's step(): each sequence (tokens numbered b * T + t) run by
    reference.recurrent from its slot of h0, its state written to the same slot of ht (-1: skipped, o zeros).
    With a slot per token (slot_of [N, W] and accepted [N]): the sequences run by :func:`speculative_oracle`."""
    spec = variants.get(base)

    def step(kernels, *args):
        if args[-4].dim() == 2:  # slot_of [N, W], accepted [N]
            tokens, (scale, h0, ht, slot_of, accepted, cu_seqlens, o) = args[:-7], args[-7:]
            q, k, v, *gates = tokens
            g = gates[0] if spec.decay_per else None
            beta = gates[-1] if spec.delta else None
            kv = (lambda p: p) if layout == "kv" else (lambda p: p.transpose(-1, -2))
            o_ref, pool = speculative_oracle(base, q, k, v, g, beta, scale, kv(h0), slot_of, accepted, cu_seqlens)
            o.copy_(o_ref.to(o.dtype))
            ht.copy_(kv(pool).float())
            return
        tokens, (scale, h0, ht, slot_of, cu_seqlens, o) = args[:-6], args[-6:]
        q, k, v, *gates = (t if t.dim() == 1 else t.flatten(0, 1) for t in tokens)
        o = o.flatten(0, 1)
        g = gates[0] if spec.decay_per else None
        beta = gates[-1] if spec.delta else None
        new = {}
        for n, slot in enumerate(slot_of.tolist()):
            a, b = cu_seqlens[n].item(), cu_seqlens[n + 1].item()
            if slot < 0:
                o[a:b] = 0
                continue
            if a == b:  # an empty sequence: its state passes through
                new[slot] = h0[slot]
                continue
            state = h0[slot] if layout == "kv" else h0[slot].transpose(-1, -2)
            per_token = spec.decay_per in ("token", "channel")
            out, final = reference.recurrent(
                base, q[None, a:b], k[None, a:b], v[None, a:b], g=g[None, a:b] if per_token else g,
                beta=None if beta is None else beta[None, a:b], scale=scale, initial_state=state[None].double(),
                output_final_state=True)
            o[a:b] = out[0].to(o.dtype)
            new[slot] = final[0] if layout == "kv" else final[0].transpose(-1, -2)
        for slot, state in new.items():  # after every read: h0 and ht may be one pool
            ht[slot] = state.float()

    return step


class _OracleModule:
    def __init__(self, base, layout):
        self.step = oracle_step(base, layout)


@pytest.fixture
def oracle_kernels(monkeypatch):
    """tuner.decode.run with the oracle in place of the compiled kernel, on the CPU."""
    def kernel_for(variant, dk, dv, dtype, sequences, tokens, heads, layout, device, token_states=False):
        return _OracleModule(variant, layout), {}, {}

    monkeypatch.setattr(decode, "kernel_for", kernel_for)

    def run(base, *args, **kwargs):
        call = decode.plan(base, *args, **kwargs)
        module, kernels, _ = decode.kernel_for(base, *call.shape, 0, token_states=call.token_states)
        module.step(kernels, *call.args)
        return call.result

    monkeypatch.setattr(decode, "run", run)


def inputs(base, batch, seqlen, heads=2, value_heads=None, dk=16, dv=8, seed=0):
    """FLA-layout inputs (bf16 q, k, v; fp32 gates) with ``value_heads`` heads for v, g, beta."""
    gen = torch.Generator().manual_seed(seed)
    spec = variants.get(base)
    HV = value_heads or heads
    q = torch.randn(batch, seqlen, heads, dk, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(batch, seqlen, heads, dk, generator=gen), dim=-1)
    v = torch.randn(batch, seqlen, HV, dv, generator=gen)
    g_shape = {None: None, "head": (HV,), "token": (batch, seqlen, HV), "channel": (batch, seqlen, HV, dk)}[spec.decay_per]
    g = None if g_shape is None else torch.log(0.9 + 0.099 * torch.rand(g_shape, generator=gen))
    beta = torch.rand(batch, seqlen, HV, generator=gen) if spec.delta else None
    return [t.bfloat16() for t in (q, k, v)] + [g, beta]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("base", BASES)
def test_fla_form_matches_the_oracle(base, state_v_first, oracle_kernels):
    if base == "linear" and state_v_first:
        pytest.skip("FLA's fused_recurrent_linear_attn has no state_v_first")
    q, k, v, g, beta = inputs(base, batch=3, seqlen=5)
    h0 = torch.randn(3, 2, 16, 8)
    kw = dict(state_v_first=True) if state_v_first else {}
    o, ht = OPS[base](q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous() if state_v_first else h0,
                      output_final_state=True, **kw)
    o_ref, ht_ref = reference.recurrent(base, q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True)
    assert rel(o, o_ref) < 1e-2
    assert rel(ht.transpose(-1, -2) if state_v_first else ht, ht_ref) < 1e-6
    assert OPS[base](q, k, v, g, beta, initial_state=h0)[1] is None


@pytest.mark.parametrize("base", ["gdn", "kda"])
def test_packed_sequences_and_grouped_value_heads_match_the_oracle(base, oracle_kernels):
    q, k, v, g, beta = inputs(base, batch=1, seqlen=9, heads=2, value_heads=4)
    cu = torch.tensor([0, 2, 2, 6, 9])
    h0 = torch.randn(4, 4, 16, 8)
    o, ht = OPS[base](q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = reference.recurrent(base, q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                        cu_seqlens=cu)
    assert rel(o, o_ref) < 1e-2 and rel(ht, ht_ref) < 1e-6


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("base", ["gdn", "kda", "simple_gla"])
def test_pool_form_updates_the_named_slots_in_place_and_no_other(base, state_v_first, oracle_kernels):
    slots = torch.tensor([5, -1, 0, 3])  # out of order, a padded entry, slots 1, 2, 4 and 6 unnamed
    q, k, v, g, beta = inputs(base, batch=4, seqlen=1)
    pool = torch.randn(7, 2, 16, 8)
    stored = pool.transpose(-1, -2).contiguous() if state_v_first else pool.clone()
    before = stored.clone()
    o, final = OPS[base](q, k, v, g, beta, initial_state=stored, ssm_state_indices=slots,
                         state_v_first=state_v_first)
    assert final is stored  # in place
    named = slots[slots >= 0]
    gather = lambda t: t if t is None or t.dim() == 1 else t[slots >= 0]  # noqa: E731
    o_ref, ht_ref = reference.recurrent(base, q[slots >= 0], k[slots >= 0], v[slots >= 0], g=gather(g),
                                        beta=gather(beta), initial_state=pool[named], output_final_state=True)
    after = stored.transpose(-1, -2) if state_v_first else stored
    assert rel(o[slots >= 0], o_ref) < 1e-2 and rel(after[named], ht_ref) < 1e-6
    unnamed = [s for s in range(7) if s not in named.tolist()]
    assert torch.equal(stored[unnamed], before[unnamed])


def speculative_oracle(base, q, k, v, g, beta, scale, pool, slot_of, accepted, cu_seqlens):
    """Speculative decoding by its definition, in fp64: sequence n starts from pool[slot_of[n, accepted[n]
    - 1]] (-1: skipped, o zeros, no state kept) and its state after token t (the recurrence over its first
    t + 1 tokens) goes to pool[slot_of[n, t]] (-1, or t past W: kept nowhere). Returns (o, the new pool),
    every state read before any is written."""
    spec = variants.get(base)
    flat = lambda x: None if x is None or x.dim() == 1 else x.flatten(0, 1)[None]  # noqa: E731
    q, k, v, g_all, beta_all = flat(q), flat(k), flat(v), g if g is not None and g.dim() == 1 else flat(g), flat(beta)
    o = torch.zeros(v.shape[1:], dtype=torch.float64)
    new = pool.double().clone()
    W = slot_of.shape[1]
    for n in range(slot_of.shape[0]):
        a, b = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        start = int(slot_of[n, int(accepted[n]) - 1])
        if start < 0 or a == b:
            continue
        per_token = spec.decay_per in ("token", "channel")
        part = lambda x: None if x is None else x[:, a:b]  # noqa: E731
        out, _ = reference.recurrent(base, part(q), part(k), part(v), g=part(g_all) if per_token else g_all,
                                     beta=part(beta_all), scale=scale, initial_state=pool[start][None].double())
        o[a:b] = out[0]
        for t in range(min(b - a, W)):
            if int(slot_of[n, t]) >= 0:
                _, state = reference.recurrent(
                    base, q[:, a:a + t + 1], k[:, a:a + t + 1], v[:, a:a + t + 1],
                    g=g_all[:, a:a + t + 1] if per_token else g_all,
                    beta=None if beta_all is None else beta_all[:, a:a + t + 1], scale=scale,
                    initial_state=pool[start][None].double(), output_final_state=True)
                new[int(slot_of[n, t])] = state[0]
    return o.reshape(v.shape[1:]), new


def speculative_case(base, state_v_first, device="cpu", dk=16, dv=8):
    """Three sequences of 3, 2 and 3 tokens (packed) on a pool of 10: one resumes from its second
    draft token, one from its first, one whose accepted token's slot is -1 (skipped); a token slot of -1
    keeps nothing."""
    q, k, v, g, beta = (t if t is None else t.to(device) for t in
                        inputs(base, batch=1, seqlen=8, heads=2, value_heads=4 if base in ("gdn", "kda") else 2,
                               dk=dk, dv=dv))
    cu = torch.tensor([0, 3, 5, 8], device=device)
    slot_of = torch.tensor([[1, 2, 3], [4, -1, 6], [7, 8, -1]], dtype=torch.int32, device=device)
    accepted = torch.tensor([2, 1, 3], dtype=torch.int32, device=device)
    pool = torch.randn(10, v.shape[2], dk, dv, generator=torch.Generator().manual_seed(3)).to(device) * 0.5
    return q, k, v, g, beta, cu, slot_of, accepted, pool


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("base", ["gdn", "kda"])
def test_speculative_decoding_resumes_from_the_accepted_token_and_keeps_every_tokens_state(
        base, state_v_first, oracle_kernels):
    q, k, v, g, beta, cu, slot_of, accepted, pool = speculative_case(base, state_v_first)
    stored = pool.transpose(-1, -2).contiguous() if state_v_first else pool.clone()
    o, final = OPS[base](q, k, v, g, beta, initial_state=stored, cu_seqlens=cu, ssm_state_indices=slot_of,
                         num_accepted_tokens=accepted, state_v_first=state_v_first)
    assert final is stored
    after = stored.transpose(-1, -2) if state_v_first else stored
    # Sequence 0 starts from slot 2 (its second token's), 1 from slot 4, 2 from slot -1: skipped.
    o_ref0, _ = reference.recurrent(base, q[:, 0:3], k[:, 0:3], v[:, 0:3], g=g[:, 0:3], beta=beta[:, 0:3],
                                    initial_state=pool[2][None])
    assert rel(o[:, 0:3], o_ref0) < 1e-2 and torch.count_nonzero(o[:, 5:8]) == 0
    for slot, (a, t) in {1: (0, 1), 2: (0, 2), 3: (0, 3), 4: (3, 1)}.items():  # slot: (first token, tokens)
        start = pool[2] if a == 0 else pool[4]
        _, state = reference.recurrent(base, q[:, a:a + t], k[:, a:a + t], v[:, a:a + t], g=g[:, a:a + t],
                                       beta=beta[:, a:a + t], initial_state=start[None], output_final_state=True)
        assert rel(after[slot], state[0]) < 1e-6, slot
    for slot in (0, 5, 6, 7, 8, 9):  # unnamed, or named by the skipped sequence or by a token past its end
        assert torch.equal(after[slot], pool[slot]), slot


def test_num_accepted_tokens_needs_a_slot_per_token():
    q, k, v, g, beta = inputs("gdn", batch=2, seqlen=2)
    pool = torch.zeros(4, 2, 16, 8)
    with pytest.raises(decode.DecodeInputError, match=r"num_accepted_tokens needs ssm_state_indices of shape \[N, tokens\]"):
        decode.plan("gdn", q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([0, 1]),
                    num_accepted_tokens=torch.tensor([1, 1]))
    with pytest.raises(decode.DecodeInputError, match="num_accepted_tokens needs ssm_state_indices"):
        decode.plan("gdn", q, k, v, g, beta, num_accepted_tokens=torch.tensor([1, 1]))
    with pytest.raises(decode.DecodeInputError, match=r"num_accepted_tokens must have shape \[2\]"):
        decode.plan("gdn", q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([[0, 1], [2, 3]]),
                    num_accepted_tokens=torch.tensor([1, 1, 1]))
    with pytest.raises(decode.DecodeInputError, match="num_accepted_tokens must be int32 or int64"):
        decode.plan("gdn", q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([[0, 1], [2, 3]]),
                    num_accepted_tokens=torch.tensor([1.0, 1.0]))
    call = decode.plan("gdn", q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([[0, 1], [2, 3]]))
    slot_of, accepted = call.args[-4], call.args[-3]
    assert call.token_states and slot_of.dtype == accepted.dtype == torch.int32 and accepted.tolist() == [1, 1]


def test_pool_form_needs_the_pool_and_refuses_what_it_does_not_support():
    q, k, v, g, beta = inputs("gdn", batch=2, seqlen=1)
    with pytest.raises(decode.DecodeInputError, match="needs initial_state"):
        decode.plan("gdn", q, k, v, g, beta, ssm_state_indices=torch.tensor([0, 1]))
    with pytest.raises(decode.DecodeInputError, match="ssm_state_indices must have shape"):
        decode.plan("gdn", q, k, v, g, beta, initial_state=torch.zeros(4, 2, 16, 8),
                    ssm_state_indices=torch.tensor([0, 1, 2]))
    with pytest.raises(decode.DecodeInputError, match="`A_log` must be provided when `use_gate_in_kernel=True`"):
        decode.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, use_gate_in_kernel=True)
    with pytest.raises(decode.DecodeInputError, match="`g` \\(raw pre-activation\\) must be provided"):
        decode.fused_recurrent_gated_delta_rule(q, k, v, beta=beta, use_gate_in_kernel=True, A_log=torch.zeros(2))
    with pytest.raises(decode.DecodeInputError, match="grouped value heads"):
        decode.plan("simple_gla", *inputs("simple_gla", batch=1, seqlen=1, heads=2, value_heads=4)[:4])


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_the_activations_reach_the_kernels_as_fla_computes_them(variant, monkeypatch):
    """FLA's use_gate_in_kernel and use_beta_sigmoid_in_kernel: the kernels get the activated g and beta."""
    from tuner.activations import activated

    q, k, v, g, beta = inputs(variant, batch=2, seqlen=3)
    ran = {}
    monkeypatch.setattr(decode, "run", lambda variant, q, k, v, g, beta, *rest: ran.update(g=g, beta=beta))
    options = dict(use_gate_in_kernel=True, A_log=torch.randn(2), dt_bias=torch.randn(g[0, 0].numel()),
                   use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    op = decode.fused_recurrent_kda if variant == "kda" else decode.fused_recurrent_gated_delta_rule
    op(q, k, v, g=g, beta=beta, **options)
    want_g, want_beta = activated(g, beta, **options)
    assert torch.equal(ran["g"], want_g) and torch.equal(ran["beta"], want_beta)
    assert not torch.equal(want_g, g.float()) and bool((want_beta > 0).all() and (want_beta < 2).all())


def test_the_config_is_looked_up_once_per_shape_bucket(monkeypatch):
    lookups = []

    def best_config(name, dk, dv, dtype, batch, seqlen, heads, device):
        lookups.append(batch * heads)
        return type("Lookup", (), {"config": space.load(name).default(Problem(name, dk, dv, dtype))})()

    monkeypatch.setattr(decode, "best_config", best_config)
    monkeypatch.setattr(decode, "_compiled", lambda *args: (None, {}))
    decode.kernel_for.cache_clear()
    decode._config.cache_clear()
    for batch in (1, 1, 8, 1024, 1000, 1024):  # 1000 and 1024 sequences of 16 heads share a bucket
        decode.kernel_for("gdn", 128, 128, "bf16", batch, batch, 16, "kv", 0)
    assert lookups == [16, 128, 16384]
    assert decode.kernel_for("gdn", 128, 128, "bf16", 8, 8, 16, "vk", 0)[2]["layout"] == "vk"
    decode.kernel_for.cache_clear()
    decode._config.cache_clear()


# ---- on the GPU ------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("base", BASES)
def test_kernel_matches_the_oracle(base, layout):
    from tuner.compile import load_kernels
    from tuner.inputs import make_inputs

    rendered = rendered_config(variants.recurrent_name(base), 128, layout=layout)
    module, kernels = load_kernels(rendered)
    for regime, seqlen in (("default", 1), ("initial_state", 1), ("initial_state", 37)):
        x = make_inputs(rendered.problem, regime, seed=1, device="cuda", batch=3, seqlen=seqlen, heads=4)
        o, ht = module.forward(kernels, **x)
        o_ref, ht_ref = reference.recurrent(base, **x, output_final_state=True)
        assert rel(o, o_ref) < rendered.problem.tolerance and rel(ht, ht_ref) < 1e-4, (regime, seqlen)


@cuda
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("base", BASES)
def test_hundred_decode_steps_through_a_pool(base, state_v_first):
    """100 steps of 6 sequences, B = 8 with 2 padded entries, over random non-contiguous slots of a pool
    of 20 (a new draw every 10 steps: sequences move between slots, as a server's pool does); each step
    against the fp64 oracle carried on its own states; slots not named bitwise unchanged."""
    if base == "linear" and state_v_first:
        pytest.skip("FLA's fused_recurrent_linear_attn has no state_v_first")
    gen = torch.Generator().manual_seed(0)
    H, HV, D, slots_n = 2, (4 if base in ("gdn", "kda") else 2), 128, 20
    pool = torch.randn(slots_n, HV, D, D, generator=gen).cuda() * 0.1
    if state_v_first:
        pool = pool.transpose(-1, -2).contiguous()
    state_of = lambda p, s: (p[s].transpose(-1, -2) if state_v_first else p[s]).double()  # noqa: E731
    slots = torch.randperm(slots_n, generator=gen)[:6]
    states = torch.stack([state_of(pool, s) for s in slots])  # the oracle's, per sequence
    for t in range(100):
        if t % 10 == 0 and t:  # move the sequences to other slots
            new = torch.randperm(slots_n, generator=gen)[:6]
            for s, state in zip(new, states):
                pool[s] = (state.transpose(-1, -2) if state_v_first else state).float()
            slots = new
        order = torch.randperm(8, generator=gen)
        indices = torch.full((8,), -1, dtype=torch.int32)
        indices[order[:6]] = slots.int()
        q, k, v, g, beta = (t_ if t_ is None else t_.cuda() for t_ in
                            inputs(base, batch=8, seqlen=1, heads=H, value_heads=HV, dk=D, dv=D, seed=t + 1))
        before = pool.clone()
        o, final = OPS[base](q, k, v, g, beta, initial_state=pool, ssm_state_indices=indices.cuda(),
                             state_v_first=state_v_first)
        live = order[:6]
        gather = lambda x: x if x is None or x.dim() == 1 else x[live]  # noqa: E731
        o_ref, states = reference.recurrent(base, q[live], k[live], v[live], g=gather(g), beta=gather(beta),
                                            initial_state=states, output_final_state=True)
        assert final is pool
        assert rel(o[live], o_ref) < 1e-2, t
        assert torch.count_nonzero(o[order[6:]]) == 0
        assert rel(torch.stack([state_of(pool, s) for s in slots]), states) < 1e-4, t
        unnamed = [s for s in range(slots_n) if s not in slots.tolist()]
        assert torch.equal(pool[unnamed], before[unnamed]), t


@cuda
@pytest.mark.parametrize("base", ["gdn", "kda"])
def test_several_tokens_per_sequence_in_the_pool(base):
    q, k, v, g, beta = (t if t is None else t.cuda() for t in
                        inputs(base, batch=1, seqlen=14, heads=2, value_heads=4, dk=128, dv=128))
    cu = torch.tensor([0, 4, 8, 8, 12, 14], device="cuda")
    indices = torch.tensor([7, 2, 4, -1, 0], dtype=torch.int32, device="cuda")
    pool = torch.randn(9, 4, 128, 128, device="cuda") * 0.1
    h0 = pool[indices[:3].long()].clone(), pool[0].clone()
    o, _ = OPS[base](q, k, v, g, beta, initial_state=pool, ssm_state_indices=indices, cu_seqlens=cu)
    keep = torch.tensor([0, 1, 2, 4])
    keep_cu = torch.tensor([0, 4, 8, 8, 10])
    tokens = torch.cat([torch.arange(0, 8), torch.arange(12, 14)]).cuda()
    pick = lambda x: None if x is None else x[:, tokens]  # noqa: E731
    o_ref, ht_ref = reference.recurrent(base, pick(q), pick(k), pick(v), g=pick(g), beta=pick(beta),
                                        initial_state=torch.cat([h0[0], h0[1][None]]), output_final_state=True,
                                        cu_seqlens=keep_cu)
    assert rel(o[:, tokens], o_ref) < 1e-2
    assert torch.count_nonzero(o[:, 8:12]) == 0
    assert rel(pool[indices[keep].long()], ht_ref) < 1e-4


@cuda
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("base", ["gdn", "kda"])
def test_speculative_decoding_on_the_gpu_matches_its_definition(base, state_v_first):
    q, k, v, g, beta, cu, slot_of, accepted, pool = speculative_case(base, state_v_first, "cuda", dk=128, dv=128)
    stored = pool.transpose(-1, -2).contiguous() if state_v_first else pool.clone()
    o, _ = OPS[base](q, k, v, g, beta, initial_state=stored, cu_seqlens=cu, ssm_state_indices=slot_of,
                     num_accepted_tokens=accepted, state_v_first=state_v_first)
    o_ref, pool_ref = speculative_oracle(base, *(x if x is None else x.cpu() for x in (q, k, v, g, beta)),
                                         128 ** -0.5, pool.cpu(), slot_of.cpu(), accepted.cpu(), cu.cpu())
    after = (stored.transpose(-1, -2) if state_v_first else stored).cpu()
    assert rel(o.cpu()[0], o_ref) < 1e-2
    assert rel(after, pool_ref) < 1e-4
    assert torch.equal(after[[0, 5, 6, 9]], pool.cpu()[[0, 5, 6, 9]])  # slots no kept state names


@cuda
def test_a_cuda_graph_replays_the_decode_step_as_eager():
    q, k, v, g, beta = (t.cuda() for t in inputs("gdn", batch=8, seqlen=1, heads=4, dk=128, dv=128))
    indices = torch.tensor([3, 1, -1, 6, 0, 9, 2, 5], dtype=torch.int32, device="cuda")
    pool = torch.randn(10, 4, 128, 128, device="cuda") * 0.1
    out = torch.empty_like(v)
    eager_pool = pool.clone()
    decode.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=eager_pool,
                                            ssm_state_indices=indices, out=out)  # compiles, warms up
    eager_pool.copy_(pool)
    eager_o = decode.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=eager_pool,
                                                      ssm_state_indices=indices)[0]
    graph_pool = pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=graph_pool,
                                                ssm_state_indices=indices, out=out)
    graph_pool.copy_(pool)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_o) and torch.equal(graph_pool, eager_pool)
    # New data through the captured buffers: a second step from the first one's states.
    q.copy_(torch.randn_like(q))
    expected = decode.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=eager_pool,
                                                       ssm_state_indices=indices)[0]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected) and torch.equal(graph_pool, eager_pool)
