"""benchmarks/kernel_breakdown.py's arguments, on the CPU (its timings need a GPU)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_breakdown  # noqa: E402


@pytest.mark.parametrize("args", [["--variant", "gdn", "--dk", "64"], ["--variant", "kda", "--dk", "128"]])
def test_flashqla_comparison_is_refused_where_flashqla_has_no_kernel(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        kernel_breakdown.main(args + ["--flashqla"])
    assert exit_.value.code == 2
    assert "FlashQLA's gdn kernels, which take DK = 128 only" in capsys.readouterr().err
