"""The variant registry: the one place that knows the six linear-attention variants.

Every other module asks this one what a variant's inputs are, which recurrence it follows,
where its template and search space live, which FLA op it mirrors and how tightly the
correctness gate judges it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .errors import UserError

ROOT = Path(__file__).resolve().parent.parent
# Relative L2 error against the fp64 oracle that the correctness gate accepts, per input dtype.
# The H200 gate of every default config reached at most 8.3e-4 in fp16 and 4.1e-3 in bf16
# (benchmarks/gate_defaults_h200.json).
GATE_TOLERANCE = {"fp16": 5e-3, "bf16": 1e-2}
TEMPLATES_DIR = ROOT / "templates"
SEARCH_SPACES_DIR = ROOT / "search_spaces"


@dataclass(frozen=True)
class Variant:
    """What the rest of the tuner needs to know about one variant.

    decay_per: what the log-space decay ``g`` varies with, which sets its shape: ``None`` (no
        decay), ``"head"`` ([H]), ``"token"`` ([B, T, H]) or ``"channel"`` ([B, T, H, DK]).
    delta: whether the state update is the delta rule (takes ``beta`` [B, T, H]).
    """

    name: str
    title: str
    decay_per: str | None
    delta: bool
    recurrence: str
    fla_op: str
    dims: tuple[int, ...] = (64, 128)
    # For a token-by-token (decode) kernel: the chunk variant whose recurrence it runs. The six
    # recurrent kernels share one template and one search space.
    recurrence_of: str | None = None

    @property
    def template(self) -> Path:
        return TEMPLATES_DIR / ("recurrent.py.j2" if self.recurrence_of else f"{self.name}.py.j2")

    @property
    def search_space(self) -> Path:
        return SEARCH_SPACES_DIR / ("recurrent.yaml" if self.recurrence_of else f"{self.name}.yaml")

    @property
    def per_channel(self) -> bool:
        return self.decay_per == "channel"

    def g_shape(self, B: int, T: int, H: int, DK: int) -> tuple[int, ...] | None:
        return {None: None, "head": (H,), "token": (B, T, H), "channel": (B, T, H, DK)}[self.decay_per]

    def check_dims(self, dk: int, dv: int) -> None:
        for label, d in (("dk", dk), ("dv", dv)):
            if d not in self.dims:
                accepted = ", ".join(str(x) for x in self.dims)
                raise UserError(f"{label}={d} is not supported by variant {self.name!r}; accepted: {accepted}")


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("linear", "linear attention (no decay)", None, False,
                "S_t = S_{t-1} + k_t v_t^T", "chunk_linear_attn"),
        Variant("decay", "constant per-head decay (RetNet, Lightning)", "head", False,
                "S_t = exp(g_h) S_{t-1} + k_t v_t^T", "chunk_retention"),
        Variant("simple_gla", "data-dependent scalar gate (Mamba2 / SSD)", "token", False,
                "S_t = exp(g_t) S_{t-1} + k_t v_t^T", "chunk_simple_gla"),
        Variant("gla", "per-channel gate (GLA)", "channel", False,
                "S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T", "chunk_gla"),
        Variant("gdn", "Gated DeltaNet", "token", True,
                "S' = exp(g_t) S_{t-1};  S_t = S' + beta_t k_t (v_t - S'^T k_t)^T", "chunk_gated_delta_rule"),
        Variant("kda", "Kimi Delta Attention (per-channel gated delta rule)", "channel", True,
                "S' = Diag(exp(g_t)) S_{t-1};  S_t = S' + beta_t k_t (v_t - S'^T k_t)^T", "chunk_kda"),
    )
}


# Variants whose FLA ops take grouped value heads (fewer query/key heads than value heads).
GROUPED_HEADS = ("gdn", "kda")


# FLA's token-by-token op of each variant.
FUSED_RECURRENT_OPS = {
    "linear": "fused_recurrent_linear_attn", "decay": "fused_recurrent_retention",
    "simple_gla": "fused_recurrent_simple_gla", "gla": "fused_recurrent_gla",
    "gdn": "fused_recurrent_gated_delta_rule", "kda": "fused_recurrent_kda",
}


def recurrent_name(variant: str) -> str:
    """The name of ``variant``'s token-by-token kernel in :data:`RECURRENT`."""
    return f"{variant}_recurrent"


# The token-by-token kernels (decode: one or a few tokens per sequence, states in a pool), one per
# variant, with the variant's recurrence; tuned and stored under their own names.
RECURRENT: dict[str, Variant] = {
    recurrent_name(v.name): replace(v, name=recurrent_name(v.name), title=f"{v.title}, token by token",
                                    fla_op=FUSED_RECURRENT_OPS[v.name], recurrence_of=v.name)
    for v in VARIANTS.values()
}


def get(name: str) -> Variant:
    """The variant (or recurrent kernel) called ``name``; a UserError naming the accepted ones otherwise."""
    try:
        return VARIANTS[name] if name in VARIANTS else RECURRENT[name]
    except KeyError:
        raise UserError(f"unknown variant {name!r}; accepted: {', '.join(VARIANTS)}") from None
