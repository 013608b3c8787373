import os

import pytest


@pytest.fixture
def cache_env(tmp_path):
    """The environment with fresh kernel caches (ours and TileLang's), so a tuner run really compiles."""
    return {**os.environ, "LINATTN_CACHE": str(tmp_path / "cache"), "TILELANG_CACHE_DIR": str(tmp_path / "tilelang")}
