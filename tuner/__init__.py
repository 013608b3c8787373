"""linattn-tuner: autotuned TileLang kernels for the linear-attention family."""
from .lookup import Lookup, best_config
from .variants import VARIANTS, Variant, get as get_variant

__all__ = ["VARIANTS", "Variant", "get_variant", "best_config", "Lookup"]
