import os
import sys
from pathlib import Path

import pytest

from tuner import baseline, lookup, ops

# A stand-in for FLA (tests/fla_standin): the six chunk ops by the fp64 oracle, with fla-core's metadata.
FLA_STANDIN = Path(__file__).resolve().parent / "fla_standin"
INSTALLED_VERSION = baseline.installed_version


@pytest.fixture
def cache_env(tmp_path):
    """The environment with fresh kernel caches (ours and TileLang's), so a tuner run really compiles."""
    return {**os.environ, "LINATTN_CACHE": str(tmp_path / "cache"), "TILELANG_CACHE_DIR": str(tmp_path / "tilelang")}


def forget_fla() -> None:
    """Drop what this process holds of FLA: its modules, its version and the answers that depended on them."""
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[name]
    INSTALLED_VERSION.cache_clear()
    lookup._lookup.cache_clear()
    ops._plan.cache_clear()


@pytest.fixture(autouse=True)
def fla_absent(monkeypatch):
    """FLA is absent unless a test asks for the stand-in: a machine with FLA installed runs the tests as
    one without (nothing imports it, no version is read)."""
    forget_fla()
    monkeypatch.setattr(baseline, "installed_version", lambda: None)
    monkeypatch.setitem(sys.modules, "fla", None)
    yield
    forget_fla()


@pytest.fixture
def fla_standin(fla_absent, monkeypatch):
    """The stand-in FLA installed, for this process and its children (the gate's): on the path, its
    version read from its metadata."""
    monkeypatch.delitem(sys.modules, "fla")
    monkeypatch.syspath_prepend(str(FLA_STANDIN))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(FLA_STANDIN), os.environ.get("PYTHONPATH")))))
    monkeypatch.setattr(baseline, "installed_version", INSTALLED_VERSION)
    forget_fla()
    yield "0.6.0+standin"
    forget_fla()


@pytest.fixture
def fla_installed(fla_absent, monkeypatch):
    """The FLA installed on this machine, with a GPU to run it; the test is skipped without both."""
    import torch

    monkeypatch.delitem(sys.modules, "fla")
    monkeypatch.setattr(baseline, "installed_version", INSTALLED_VERSION)
    forget_fla()
    if not torch.cuda.is_available() or INSTALLED_VERSION() is None:
        pytest.skip("needs FLA installed (pip install -e '.[fla]') and a CUDA device")
    yield INSTALLED_VERSION()
    forget_fla()
