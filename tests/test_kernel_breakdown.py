"""benchmarks/kernel_breakdown.py's arguments, on the CPU (its timings need a GPU)."""
import sys
from pathlib import Path

import dataclasses

import pytest

from tuner import space
from tuner.errors import UserError
from tuner.problem import Problem
from tuner.stack import Stack

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_breakdown  # noqa: E402


@pytest.mark.parametrize("args", [["--variant", "gdn", "--dk", "64"], ["--variant", "kda", "--dk", "128"]])
def test_flashqla_comparison_is_refused_where_flashqla_has_no_kernel(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        kernel_breakdown.main(args + ["--flashqla"])
    assert exit_.value.code == 2
    assert "FlashQLA's gdn kernels, which take DK = 128 only" in capsys.readouterr().err


def test_packed_needs_a_shape_of_one_row(capsys):
    with pytest.raises(SystemExit) as exit_:
        kernel_breakdown.main(["--variant", "gdn", "--packed", "--shape", "4x8192x16"])
    assert exit_.value.code == 2 and "--packed: the shape is 1xTxHV" in capsys.readouterr().err


# The shipped results.db's stacks: kda D 128's role-split winners were tuned on an H100, its chunked ones
# on the H200 (tuner.best_config checks the rest of the stack as it does for every lookup).
H200 = Stack("NVIDIA H200", "sm_90", "0.1.15", "13.0.88", "580.159.04", "2.11.0+cu130")
H100 = dataclasses.replace(H200, gpu="NVIDIA H100 80GB HBM3")


def shipped_only(monkeypatch, tmp_path):
    """Lookups read the shipped results.db alone: no user database."""
    monkeypatch.delenv("LINATTN_TUNER_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))


def test_stored_starts_from_this_gpus_winner_and_set_changes_it(monkeypatch, tmp_path):
    shipped_only(monkeypatch, tmp_path)
    problem = Problem("kda", 128, 128, batch=4, seqlen=8192, heads=16)
    h100 = kernel_breakdown.starting_config(problem, {}, stored=True, device=H100)
    assert h100["split"] == "pre_seq" and h100["row_factors"] == "once" and h100["block_dk"] == 128
    changed = kernel_breakdown.starting_config(problem, {"solve": "blocked"}, stored=True, device=H100)
    assert changed == {**h100, "solve": "blocked"}
    assert kernel_breakdown.starting_config(problem, {}, stored=False) != h100


@pytest.mark.parametrize("variant,split", [("decay", "chunked"), ("gla", "pre_seq"), ("gdn", "pre_seq")])
def test_a_packed_problem_starts_from_what_a_packed_call_runs(variant, split):
    """Without a stored winner a packed call runs its packed parameter's caller_default (the split with
    packed kernels, and its parameters), which --packed times and --set changes: the template's plain
    default has no packed kernels."""
    problem = Problem(variant, 128, 128, batch=1, seqlen=32768, heads=32, packed=True)
    caller_default = space.load(variant).default(problem, {"packed": True})
    assert caller_default["split"] == split
    assert kernel_breakdown.starting_config(problem, {"packed": "true"}, stored=False) == caller_default
    changed = kernel_breakdown.starting_config(problem, {"packed": "true", "block_dv": "32"}, stored=False)
    assert changed == space.load(variant).normalise({**caller_default, "block_dv": 32})


def test_stored_without_a_winner_says_so(monkeypatch, tmp_path):
    shipped_only(monkeypatch, tmp_path)
    other = dataclasses.replace(H200, gpu="NVIDIA A100-SXM4-80GB", arch="sm_80")
    with pytest.raises(UserError, match="no winner of kda k128 at 4x8192x16 is stored for this GPU"):
        kernel_breakdown.starting_config(Problem("kda", 128, 128), {}, stored=True, device=other)
