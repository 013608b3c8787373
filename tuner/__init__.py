"""linattn-tuner: autotuned TileLang kernels for the linear-attention family."""
from .variants import VARIANTS, Variant, get as get_variant

__all__ = ["VARIANTS", "Variant", "get_variant"]
