"""linattn-tuner: autotuned TileLang kernels for the linear-attention family.

The names below load on first use, so that importing a part of the package (the oracles in a
gate's child process, a generated kernel module) does not load the database layer."""
import importlib

_LAZY = {  # public name -> (module, attribute)
    "Lookup": ("lookup", "Lookup"),
    "best_config": ("lookup", "best_config"),
    "VARIANTS": ("variants", "VARIANTS"),
    "Variant": ("variants", "Variant"),
    "get_variant": ("variants", "get"),
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tuner' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(f".{module}", __name__), attribute)
    globals()[name] = value  # later reads skip this hook
    return value
