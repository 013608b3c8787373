"""FLA as a baseline (tuner.baseline): the backend switch, FLA's version read without importing it,
the module that runs FLA's op of each variant, and that module through the real gate's child on the
CPU with the stand-in FLA (tests/fla_standin): checked against the fp64 oracle, timed at every shape,
FLA's backend dispatch off, a wrong or another FLA seen."""
import json
import subprocess
import sys
import types

import pytest

from tuner import baseline, bench, gate, reference, variants
from tuner.bench import memory_floor_ms
from tuner.errors import UserError
from tuner.inputs import make_inputs
from tuner.problem import Problem
from tuner.store import Store

SMALL = Problem("gdn", 64, 64, batch=1, seqlen=128, heads=2)
CPU_GATE = dict(regimes=["default"], seqlens=(64,), batch=1, heads=1, seeds=(0,), rep=3, warmup_ms=1)


def test_the_backend_is_the_argument_else_the_environment_else_auto(monkeypatch):
    monkeypatch.delenv(baseline.BACKEND_ENV, raising=False)
    assert baseline.backend_choice() == "auto"
    monkeypatch.setenv(baseline.BACKEND_ENV, "tuner")
    assert baseline.backend_choice() == "tuner"
    assert baseline.backend_choice("fla") == "fla"
    monkeypatch.setenv(baseline.BACKEND_ENV, "triton")
    with pytest.raises(UserError, match=r"^LINATTN_BACKEND='triton' is not a backend; accepted: auto, tuner, fla$"):
        baseline.backend_choice()
    with pytest.raises(UserError, match=r"^backend='FLA' is not a backend"):
        baseline.backend_choice("FLA")


def test_without_fla_nothing_is_installed_and_asking_for_it_says_how_to_install_it():
    assert baseline.installed_version() is None
    with pytest.raises(baseline.FlaUnavailable, match=r"pip install 'linattn-tuner\[fla\]'"):
        baseline.fla_ops()


def test_the_stand_in_reads_as_installed_from_its_metadata_without_being_imported(fla_standin):
    assert baseline.installed_version() == fla_standin == "0.6.0+standin"
    assert "fla" not in sys.modules
    assert baseline.fla_ops().chunk_kda.__module__ == "fla.ops"


def load(source: str) -> types.ModuleType:
    module = types.ModuleType("baseline_under_test")
    exec(compile(source, "baseline_under_test", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("variant", list(variants.VARIANTS))
def test_the_baseline_module_computes_the_variants_recurrence_with_fla(variant, fla_standin, monkeypatch):
    # The stand-in's ops are FLA's signatures on the oracle: chunk_retention with RetNet's fixed decays
    # would not match the gate's per-head decays, chunk_linear_attn normalises unless told not to.
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "0")  # the module turns it off before importing FLA
    problem = Problem(variant, 64, 64, "bf16", batch=2, seqlen=40, heads=3)
    module = load(baseline.source(variant, fla_standin))
    assert module.programs() == []
    x = make_inputs(problem, "initial_state", seed=1)
    o, state = module.forward({}, **x)
    ref_o, ref_state = reference.chunked(variant, **x, output_final_state=True)
    for out, ref in ((o, ref_o), (state, ref_state)):
        assert ((out.double() - ref).norm() / ref.norm()).item() < problem.tolerance
    fla = sys.modules["fla.ops"]
    assert fla.calls == [baseline.fla_call(variant)[0]] and fla.DISPATCH_DISABLED
    expected = "chunk_simple_gla" if variant == "decay" else variants.get(variant).fla_op
    assert baseline.fla_call(variant)[0] == expected


def test_the_baseline_module_refuses_another_fla_version(fla_standin, monkeypatch):
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")
    module = load(baseline.source("gdn", "0.5.0"))
    x = make_inputs(SMALL, seqlen=16)
    with pytest.raises(ImportError, match=r"FLA 0.6.0\+standin is installed; this baseline was written for FLA 0.5.0"):
        module.forward({}, **x)


def fake_triton(monkeypatch, disk_cache: bool = True) -> types.SimpleNamespace:
    """Triton's kernel wrappers as FLA's modules hold them, for a process without Triton. An autotuner
    keeps its choices in ``cache`` (by autotune key); ``run`` takes the choice from there, else (with
    ``cache_results``) through ``check_disk_cache`` from the machine's disk (a file named by the key,
    written after a benchmark), else benchmarks, as Triton 3's ``Autotuner.run`` does. ``disk_cache``
    False: a Triton without ``check_disk_cache``."""
    class KernelInterface:
        def __init__(self, fn):
            self.fn = fn

    class Autotuner(KernelInterface):
        disk = {}  # Triton's cache folder: one per machine, shared by its processes

        def __init__(self, fn):
            super().__init__(fn)
            self.cache, self.cache_results = {("BT", 64): "config chosen at 4x8192x16"}, True
            self.benchmarked = []

        def run(self, key, timings: dict):
            """The config for autotune ``key``; ``timings``: each config's time at the shape called at."""
            if key not in self.cache:
                def benchmark():
                    self.benchmarked.append(key)
                    self.cache[key] = min(timings, key=timings.get)
                    self.configs_timings = timings

                if self.cache_results:
                    self.check_disk_cache(key, list(timings), benchmark)
                else:
                    benchmark()
            return self.cache[key]

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        file = str(tuning_key)
        if file in self.disk:
            self.cache[tuning_key] = self.disk[file]
            return True
        bench_fn()
        self.disk[file] = min(self.configs_timings, key=self.configs_timings.get)
        return False

    if disk_cache:
        Autotuner.check_disk_cache = check_disk_cache

    class Heuristics(KernelInterface):
        pass

    names = {"triton": types.ModuleType("triton"), "triton.runtime": types.ModuleType("triton.runtime"),
             "triton.runtime.autotuner": types.ModuleType("triton.runtime.autotuner"),
             "triton.runtime.jit": types.ModuleType("triton.runtime.jit")}
    names["triton.runtime.autotuner"].Autotuner = Autotuner
    names["triton.runtime.jit"].KernelInterface = KernelInterface
    for name, module in names.items():
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(Autotuner=Autotuner, Heuristics=Heuristics, KernelInterface=KernelInterface)


def fla_module(monkeypatch, name: str, **kernels) -> None:
    module = types.ModuleType(name)
    vars(module).update(kernels)
    monkeypatch.setitem(sys.modules, name, module)


def test_fla_forgets_its_autotune_choices_in_every_wrapper_of_every_module_of_its_own(monkeypatch):
    triton = fake_triton(monkeypatch)
    state_pass = triton.Heuristics(triton.Autotuner(triton.KernelInterface(lambda: None)))  # heuristics(autotune(jit))
    output = triton.Autotuner(triton.Heuristics(triton.KernelInterface(lambda: None)))      # autotune(heuristics(jit))
    shared = triton.Autotuner(triton.KernelInterface(lambda: None))
    elsewhere = triton.Autotuner(triton.KernelInterface(lambda: None))
    not_a_kernel = types.SimpleNamespace(fn=triton.Autotuner(triton.KernelInterface(lambda: None)))
    fla_module(monkeypatch, "fla.ops.common.chunk_h", chunk_fwd_kernel_h=state_pass, imported=shared)
    fla_module(monkeypatch, "fla.ops.common.chunk_o", chunk_fwd_kernel_o=output, imported=shared, hook=not_a_kernel)
    fla_module(monkeypatch, "not_fla.kernels", kernel=elsewhere)

    assert baseline.autotune_fla_at("gdn 128x128 bf16 4x8192x16") == 3
    for tuner in (state_pass.fn, output, shared):
        assert tuner.cache == {}
    for tuner in (elsewhere, not_a_kernel.fn):  # not FLA's, or not reached through Triton's wrappers
        assert tuner.cache == {("BT", 64): "config chosen at 4x8192x16"}


def test_a_choice_made_at_a_problem_is_what_a_later_process_runs_there_and_only_there(monkeypatch):
    triton = fake_triton(monkeypatch)
    at_reference, at_long = "gdn 128x128 bf16 4x8192x16", "gdn 128x128 bf16 1x32768x32"
    key = ("BT", 64)  # FLA's key: the same at both shapes
    first = triton.Autotuner(triton.KernelInterface(lambda: None))
    fla_module(monkeypatch, "fla.ops.common.chunk_h", chunk_fwd_kernel_h=first)
    baseline.autotune_fla_at(at_reference)
    assert first.run(key, {"BV=32": 1.0, "BV=64": 2.0}) == "BV=32" and first.benchmarked == [key]

    # A later process (its own autotuner, the same disk), whose autotune would pick otherwise.
    later = triton.Autotuner(triton.KernelInterface(lambda: None))
    fla_module(monkeypatch, "fla.ops.common.chunk_h", chunk_fwd_kernel_h=later)
    baseline.autotune_fla_at(at_reference)
    assert later.run(key, {"BV=32": 2.0, "BV=64": 1.0}) == "BV=32" and later.benchmarked == []
    baseline.autotune_fla_at(at_long)  # another shape: autotuned there, not the reference's choice
    assert later.run(key, {"BV=32": 2.0, "BV=64": 1.0}) == "BV=64" and later.benchmarked == [key]
    baseline.autotune_fla_at(at_reference)
    assert later.run(key, {"BV=32": 2.0, "BV=64": 1.0}) == "BV=32" and later.benchmarked == [key]
    assert len(later.disk) == 2 and all(at_reference in f or at_long in f for f in later.disk)


def test_without_a_disk_cache_of_choices_fla_autotunes_in_every_process(monkeypatch):
    triton = fake_triton(monkeypatch, disk_cache=False)
    tuner = triton.Autotuner(triton.KernelInterface(lambda: None))
    fla_module(monkeypatch, "fla.ops.common.chunk_h", chunk_fwd_kernel_h=tuner)
    for timings, chosen in (({"BV=32": 1.0, "BV=64": 2.0}, "BV=32"), ({"BV=32": 2.0, "BV=64": 1.0}, "BV=64")):
        assert baseline.autotune_fla_at("gdn 128x128 bf16 4x8192x16") == 1
        assert not tuner.cache_results and tuner.run(("BT", 64), timings) == chosen
    assert len(tuner.benchmarked) == 2


def test_without_triton_loaded_there_is_nothing_to_forget(monkeypatch):
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    assert baseline.autotune_fla_at("gdn 128x128 bf16 4x8192x16") == 0


def test_the_baseline_module_makes_fla_autotune_at_the_problem_before_each_timing(fla_standin, monkeypatch):
    calls = []
    monkeypatch.setattr(baseline, "autotune_fla_at", lambda at: calls.append(f"at {at}, fla {'fla.ops' in sys.modules}"))
    module = load(baseline.source("gdn", fla_standin))
    forward = module.forward
    module.forward = lambda *args, **kwargs: (calls.append("forward"), forward(*args, **kwargs))[1]
    x = make_inputs(SMALL, seqlen=16)
    module.forward({}, **x)
    assert calls == ["forward"]  # the gate's calls leave FLA's choices alone
    calls.clear()
    bench.time_module(SMALL, module, {}, x, rep=2, warmup_ms=0)
    bench.time_module(SMALL, module, {}, x, rep=2, warmup_ms=0)
    # Before each timing's first call (its warm-up, which absorbs the autotune), with FLA imported.
    at = f"at {baseline.problem_label(SMALL)}, fla True"
    assert calls == ([at] + ["forward"] * 3) * 2


def test_a_decode_kernel_has_no_baseline():
    assert not baseline.has_baseline("gdn_recurrent") and baseline.has_baseline("gdn")
    with pytest.raises(UserError, match="decode kernel"):
        baseline.fla_call("gdn_recurrent")


def test_fla_is_timed_by_the_gates_child_at_every_shape_with_its_backend_dispatch_off(fla_standin, tmp_path,
                                                                                      monkeypatch):
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FLA_STANDIN_LOG", str(log))
    candidate = baseline.candidate(SMALL, fla_standin)
    assert candidate.config == {"backend": "fla"} and candidate.twin is None
    result = gate.gate_and_time(candidate, also_at=("1x256x2",), timeout_s=120, device=0, **CPU_GATE)
    assert result.status == "pass", result.message
    assert result.errors["default"]["o"] < 1e-2
    large = result.timing_at["1x256x2"]
    assert result.timing["p10_ms"] <= result.timing["median_ms"] <= result.timing["p90_ms"]
    assert (result.timing["floor_ms"], large["floor_ms"]) == (memory_floor_ms(SMALL), memory_floor_ms(SMALL.at("1x256x2")))
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls and all(c == {"op": "chunk_gated_delta_rule", "dispatch_disabled": True} for c in calls)


def test_a_wrong_fla_fails_the_gate(fla_standin, monkeypatch):
    monkeypatch.setenv("FLA_STANDIN_WRONG", "1")
    result = gate.gate_and_time(baseline.candidate(SMALL, fla_standin), timeout_s=120, device=0, **CPU_GATE)
    assert result.status == "mismatch" and result.timing is None
    assert result.errors["default"]["o"] == pytest.approx(0.05, rel=0.05)


def test_another_fla_than_the_baselines_is_a_crash_with_the_reason(fla_standin):
    result = gate.gate_and_time(baseline.candidate(SMALL, "0.5.0"), timeout_s=120, device=0, **CPU_GATE)
    assert result.status == "crash" and "this baseline was written for FLA 0.5.0" in result.message


def test_using_the_tuner_imports_no_fla(fla_standin, tmp_path):
    # FLA (Triton, its models) is imported only where it runs: a lookup, the ops module, a tuning
    # run's modules leave it alone even when it is installed.
    code = ("import sys, tuner, tuner.ops, tuner.search, tuner.regress, tuner.dashboard; "
            "tuner.best_config('gdn', 128, db=sys.argv[1]); print(tuner.baseline.installed_version(), 'fla' in sys.modules)")
    db = tmp_path / "empty.db"
    Store(db).close()
    out = subprocess.run([sys.executable, "-c", code, str(db)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [fla_standin, "False"]


# ---- on the GPU, with FLA installed


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(variants.VARIANTS))
def test_flas_op_passes_the_gate_as_a_kernel_would(variant, fla_installed):
    # Every regime of the variant: what tune and tune regress run FLA through before timing it.
    problem = Problem(variant, 128, 128, batch=1, seqlen=4096, heads=4)
    result = gate.gate_and_time(baseline.candidate(problem, fla_installed), timeout_s=1800, device=0, rep=10)
    assert result.status == "pass", (result.message, result.errors)
    assert result.timing["median_ms"] > 0


@pytest.mark.gpu
def test_the_op_forced_to_fla_is_flas_op(fla_installed):
    import torch

    from tuner import ops

    x = make_inputs(Problem("gla", 64, 64, batch=2, seqlen=512, heads=4), "initial_state", seed=0, device="cuda")
    args = (x["q"], x["k"], x["v"], x["g"])
    o, state = ops.chunk_gla(*args, initial_state=x["initial_state"], output_final_state=True, backend="fla")
    fla_o, fla_state = baseline.fla_ops().chunk_gla(*args, initial_state=x["initial_state"], output_final_state=True)
    assert torch.equal(o, fla_o) and torch.equal(state, fla_state)
