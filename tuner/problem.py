"""The problem a kernel is tuned for: variant, head dims, dtype and the shape it runs at."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from . import variants
from .errors import UserError

DTYPES = ("fp16", "bf16")


@dataclass(frozen=True)
class Problem:
    """One tuning problem. ``batch``/``seqlen``/``heads`` are the shape kernels are timed at.

    ``packed``: the calls are packed sequences (``cu_seqlens``) and grouped value heads, so kernels
    that take them are timed on such inputs, the correctness gate's ``packed`` mix of lengths at a
    fixed seed (``tuner.inputs.timing_inputs``): ``seqlen`` tokens in all, ``heads`` value heads (q
    and k with half as many where the variant groups heads), one initial state per sequence. A
    packed problem's time is not a dense one's (its sequences give far more parallel work), so each
    is compared only with its own kind.
    """

    variant: str
    dk: int
    dv: int
    dtype: str = "bf16"
    batch: int = 4
    seqlen: int = 8192
    heads: int = 16
    packed: bool = False

    def __post_init__(self):
        v = variants.get(self.variant)
        v.check_dims(self.dk, self.dv)
        if self.dtype not in DTYPES:
            raise UserError(f"dtype {self.dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
        for label in ("batch", "seqlen", "heads"):
            if getattr(self, label) < 1:
                raise UserError(f"{label} must be a positive integer, got {getattr(self, label)}")

    @property
    def spec(self) -> variants.Variant:
        return variants.get(self.variant)

    @property
    def tolerance(self) -> float:
        """Relative L2 error against the fp64 oracle that the correctness gate accepts."""
        return variants.GATE_TOLERANCE[self.dtype]

    @property
    def torch_dtype(self):
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.dtype]

    @property
    def shape(self) -> str:
        """The shape timed, as ``BxTxH``."""
        return f"{self.batch}x{self.seqlen}x{self.heads}"

    @property
    def label(self) -> str:
        """The shape, and whether its sequences are packed: ``1x32768x32 packed``."""
        return f"{self.shape} packed" if self.packed else self.shape

    def at(self, shape: str) -> "Problem":
        """The same kernel problem timed at ``shape`` (``BxTxH``)."""
        batch, seqlen, heads = parse_shape(shape)
        return replace(self, batch=batch, seqlen=seqlen, heads=heads)

    def as_dict(self) -> dict:
        return asdict(self)


def parse_shape(text: str) -> tuple[int, int, int]:
    """``BxTxH`` (e.g. ``1x32768x32``) as (batch, seqlen, heads); a UserError otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"a shape is BxTxH with positive integers, e.g. 1x32768x32; got {text!r}")
    return tuple(int(p) for p in parts)
