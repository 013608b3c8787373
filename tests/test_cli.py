"""The `tune` command's user-facing behaviour: help, and one-line exit-2 errors for mistakes."""
import subprocess
import sys

import pytest

from tuner import cli, variants


def run_tune(*args):
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_subcommand_and_option():
    out = run_tune("--help")
    assert out.returncode == 0
    for name in cli.SUBCOMMANDS:
        assert name in out.stdout
    run_help = run_tune("run", "--help").stdout
    for option in ("--variant", "--dk", "--dv", "--dtype", "--batch", "--seqlen", "--heads", "--trials",
                   "--timeout", "--db", "--storage", "--jobs", "--gpu", "--register-budget"):
        assert option in run_help


@pytest.mark.parametrize(
    "args, expected",
    [
        pytest.param(["--variant", "bogus", "--dk", "128"], "unknown variant 'bogus'; accepted: " + ", ".join(variants.VARIANTS), id="bogus-variant"),
        pytest.param(["--variant", "gdn", "--dk", "0"], "expected a positive integer, got 0", id="dk-zero"),
        pytest.param(["--variant", "gdn", "--dk", "96"], "dk=96 is not supported by variant 'gdn'; accepted: 64, 128", id="dk-unsupported"),
        pytest.param(["--variant", "kda", "--dk", "128", "--dv", "48"], "dv=48 is not supported", id="dv-unsupported"),
        pytest.param(["render", "--variant", "gdn", "--dk", "128", "--set", "nonsense"], "--set expects NAME=VALUE", id="bad-set"),
        pytest.param(["--variant", "gdn", "--dk", "128", "--dtype", "fp8"], "invalid choice: 'fp8'", id="bad-dtype"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(args, expected):
    out = run_tune(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("tune: error: ")
    assert expected in lines[0]
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the gate runs where there is a GPU")
def test_the_gate_without_a_gpu_says_it_needs_one_in_one_line():
    out = run_tune("gate", "--variant", "linear", "--dk", "64")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "tune: error: no CUDA device: `tune gate` runs the kernel on the GPU; "
        "`tune compile` compiles it and reports its resources without one"]
