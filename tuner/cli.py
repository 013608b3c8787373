"""The ``tune`` command: a thin layer over the library.

``tune --variant gdn --dk 128`` runs the main job (search, gate, time, record); the other
subcommands expose one pipeline stage each. User mistakes exit with code 2 and one line.
"""
from __future__ import annotations

import argparse
import json
import sys

from . import variants
from .errors import UserError

SUBCOMMANDS = ("run", "render", "compile", "gate", "predict", "calibrate", "regress", "dashboard")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise UserError(message)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _gpu_list(text: str) -> str | list[int]:
    if text == "all":
        return text
    try:
        devices = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'all' or device indices like 0,1, got {text!r}") from None
    if min(devices) < 0 or len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"expected distinct device indices >= 0, got {text!r}")
    return devices


def _add_problem(p: argparse.ArgumentParser, shape: bool = True) -> None:
    g = p.add_argument_group("problem")
    g.add_argument("--variant", required=True, metavar="V",
                   help=f"one of: {', '.join(variants.VARIANTS)}")
    g.add_argument("--dk", required=True, type=_positive, metavar="N", help="key/query head dim (64 or 128)")
    g.add_argument("--dv", type=_positive, metavar="N", help="value head dim (default: --dk)")
    g.add_argument("--dtype", default="bf16", choices=("fp16", "bf16"), help="input dtype (default bf16)")
    if shape:
        g.add_argument("--batch", type=_positive, default=4, metavar="B", help="batch size timed (default 4)")
        g.add_argument("--seqlen", type=_positive, default=8192, metavar="T", help="sequence length timed (default 8192)")
        g.add_argument("--heads", type=_positive, default=16, metavar="H", help="heads timed (default 16)")


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override one template parameter of the default config (repeatable)")


def _add_db(p: argparse.ArgumentParser, writes: bool = False) -> None:
    if writes:  # results go to the user's database; the shipped results.db only when named
        from .paths import DB_ENV, user_db

        p.add_argument("--db", metavar="PATH",
                       help=f"results database written (default ${DB_ENV}, else {user_db()}; the shipped "
                            "results.db only when named, e.g. --db results.db for winners to commit)")
    else:
        p.add_argument("--db", default="results.db", metavar="PATH", help="results database (default results.db)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tune",
        description="Autotune TileLang kernels for linear attention. "
                    "`tune --variant gdn --dk 128` is short for `tune run --variant gdn --dk 128`.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser("run", help="search, gate, time and record the best config (the main job)",
                         description="Search the variant's space with Optuna under the register budget; "
                                     "compile candidates on CPU, gate and time them on the GPU, record every "
                                     "outcome and the winner; with FLA installed, FLA's op is gated and timed at every "
                                     "shape tuned and stored beside the winners as their baseline. Without a GPU "
                                     "everything but gate and timing runs. "
                                     "Results go to your own database (see --db), which tuner.best_config reads "
                                     "over the shipped results.db.")
    _add_problem(run)
    budget = run.add_mutually_exclusive_group()
    budget.add_argument("--trials", type=_positive, metavar="N", help="kernels to compile and judge (default 40); broken constraints, "
                                                                         "model prunes and repeats are free")
    budget.add_argument("--timeout", type=_positive, metavar="S", help="stop after S seconds plus the gate in progress; queued trials "
                                                                          "are given back to the study for the next run")
    _add_db(run, writes=True)
    run.add_argument("--storage", metavar="URL",
                     help="database URL shared by workers on several hosts, e.g. postgresql://user:pw@host/db: "
                          "the study and the results live there instead of --db")
    run.add_argument("--jobs", type=_positive, default=2, metavar="J",
                     help="CPU compile processes, per worker (default 2)")
    device = run.add_mutually_exclusive_group()
    # default None, not 0: argparse lets an option given at its default pass as "not given".
    device.add_argument("--gpu", type=int, metavar="ID", help="CUDA device index (default 0)")
    device.add_argument("--gpus", type=_gpu_list, metavar="all|I,J,...",
                        help="one worker process per CUDA device, all on the same study (needs CUDA devices)")
    run.add_argument("--register-budget", type=_positive, default=255, metavar="R",
                     help="prune configs predicted above R registers per thread (default 255)")
    run.add_argument("--fix", action="append", default=[], type=name_value, metavar="NAME=VALUE",
                     help="hold one template parameter at a value and search the rest (repeatable; "
                          "a study of its own)")
    run.add_argument("--seed", type=int, metavar="N",
                     help="seed the sampling: the same seed, study and progress propose the same configs "
                          "(with --gpus, worker i uses N + i)")
    run.add_argument("--also-at", action="append", default=[], type=shape, metavar="BxTxH",
                     help="also time every passing kernel at this shape and keep its own winner there "
                          "(repeatable); the search follows --batch/--seqlen/--heads")

    render = sub.add_parser("render", help="print the rendered TileLang source of one config")
    _add_problem(render, shape=False)
    _add_config(render)

    comp = sub.add_parser("compile", help="compile one config for sm_90a (no GPU needed) and report resources")
    _add_problem(comp, shape=False)
    _add_config(comp)
    comp.add_argument("--json", action="store_true", help="print the report as JSON")

    gate = sub.add_parser("gate", help="run the correctness gate for one config on the GPU and print its errors",
                          description="Compile one config, run it in a child process with a watchdog over the "
                                      "variant's regimes (T a multiple of the chunk and not, several seeds) and "
                                      "compare output and final state with the fp64 chunked oracle.")
    _add_problem(gate, shape=False)
    _add_config(gate)
    gate.add_argument("--timeout", type=_positive, default=300, metavar="S", help="watchdog seconds (default 300)")
    gate.add_argument("--gpu", type=int, default=0, metavar="ID", help="CUDA device index (default 0)")
    gate.add_argument("--json", action="store_true", help="print the result as JSON")

    pred = sub.add_parser("predict", help="the register/shared-memory model's prediction for one config")
    _add_problem(pred, shape=False)
    _add_config(pred)
    pred.add_argument("--json", action="store_true", help="print the prediction as JSON")

    cal = sub.add_parser("calibrate", help="compile sampled configs, fit the model and print its accuracy")
    _add_problem(cal, shape=False)
    cal.add_argument("--samples", type=_positive, default=40, metavar="K", help="configs to compile (default 40)")
    cal.add_argument("--seed", type=int, default=0, help="sampling seed")
    _add_db(cal, writes=True)

    reg = sub.add_parser("regress", help="re-gate and re-time stored winners and FLA beside them; exit 1 on a "
                                         "regression or a winner that fell behind FLA")
    reg.add_argument("--variant", action="append", metavar="V", help="limit to these variants (repeatable)")
    _add_db(reg)
    reg.add_argument("--replay", action="store_true",
                     help="judge the latest recorded measurement of each winner against the earlier ones; "
                          "re-runs nothing, needs no GPU")
    reg.add_argument("--fla-only", action="store_true",
                     help="time FLA's op where no baseline was measured on this stack with the installed FLA "
                          "autotuned at that shape, and judge the winners' recorded history against it; "
                          "re-times no winner")
    reg.add_argument("--gpu", type=int, default=0, metavar="ID", help="CUDA device index (default 0)")

    dash = sub.add_parser("dashboard", help="write the static regression dashboard")
    _add_db(dash)
    dash.add_argument("--out", required=True, metavar="DIR", help="output folder")
    dash.add_argument("--vs-fla", metavar="PATH",
                      help="FLA comparison written by benchmarks/vs_fla.py (default: benchmarks/vs_fla.json)")
    return parser


def name_value(item: str) -> tuple[str, str]:
    """``NAME=VALUE`` -> (name, value), an argparse ``type`` (``--fix``)."""
    name, sep, value = item.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {item!r}")
    return name.strip(), value.strip()


def shape(text: str) -> str:
    """``BxTxH`` checked and normalised, an argparse ``type`` (``--also-at``)."""
    from .problem import parse_shape

    try:
        return "x".join(map(str, parse_shape(text)))
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``--set`` items -> {name: value}, with the CLI's one-line error."""
    out = {}
    for item in items:
        try:
            name, value = name_value(item)
        except argparse.ArgumentTypeError:
            raise UserError(f"--set expects NAME=VALUE, got {item!r}") from None
        out[name] = value
    return out


def problem_from(args):
    from .problem import Problem

    variants.get(args.variant)
    kw = {k: getattr(args, k) for k in ("batch", "seqlen", "heads") if hasattr(args, k)}
    return Problem(args.variant, args.dk, args.dv or args.dk, args.dtype, **kw)


def candidate_from(args, problem):
    """The Candidate of the config the arguments describe (the default with ``--set``s), checked."""
    from . import space
    from .candidate import Candidate

    return Candidate.from_config(problem, space.load(problem.variant).complete(problem, parse_overrides(args.set)))


def _cmd_render(args) -> int:
    problem = problem_from(args)
    print(candidate_from(args, problem).source, end="")
    return 0


def _cmd_compile(args) -> int:
    from .compile import compile_candidate

    problem = problem_from(args)
    report = compile_candidate(candidate_from(args, problem))
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.summary())
    return 0 if report.ok else 1


def _cmd_gate(args) -> int:
    from . import gate, stack

    problem = problem_from(args)
    candidate = candidate_from(args, problem)  # bad input is told first
    if not stack.has_gpu():
        raise UserError("no CUDA device: `tune gate` runs the kernel on the GPU; "
                        "`tune compile` compiles it and reports its resources without one")
    result = gate.run_gate(candidate, timeout_s=args.timeout, device=args.gpu)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(f"{problem.variant} dk={problem.dk} dv={problem.dv} {problem.dtype}: {result.status} "
              f"({result.seconds:.1f} s) {result.message}")
        for regime, err in result.errors.items():
            print(f"  {regime:<14} o {err['o']:.2e}  final_state {err['final_state']:.2e}  (T={err['seqlen']})")
    return 0 if result.status == "pass" else 1


def _cmd_predict(args) -> int:
    problem = problem_from(args)
    pred = candidate_from(args, problem).prediction
    print(json.dumps(pred.as_dict(), indent=2) if args.json else pred.summary())
    return 0


def _cmd_calibrate(args) -> int:
    problem = problem_from(args)
    from . import calibration
    from .paths import written_db

    return calibration.calibrate_main(problem, samples=args.samples, seed=args.seed, db=written_db(args.db))


def _cmd_run(args) -> int:
    problem = problem_from(args)
    from . import console, search
    from .paths import written_db

    args.db = written_db(args.db)
    if args.gpus is not None:
        from .search import workers

        return tune_on_gpus(problem, args, workers.select_gpus(args.gpus))
    summary = search.tune(problem, **_tune_options(args), gpu=args.gpu or 0, seed=args.seed,
                          observer=console.Progress())
    console.print_summary(summary)
    return 0


def _tune_options(args) -> dict:
    """The options of ``tune run`` that every worker of a study shares."""
    return dict(trials=args.trials, timeout=args.timeout, db=args.db, storage=args.storage, jobs=args.jobs,
                register_budget=args.register_budget, fixed=dict(args.fix), also_at=tuple(args.also_at))


def tune_on_gpus(problem, args, devices: list[int]) -> int:
    """``tune run --gpus``: one worker process per device of ``devices``, all on one study (created
    here first), each logging to ``<db>.gpu<i>.log``; the study's summary at the end, over all
    workers. Exit code: 0 when every worker succeeded, else the first failing worker's."""
    import functools
    import signal
    import threading

    from . import console, search, space, stack
    from .gate import gate_and_time
    from .search import workers
    from .store import Store

    # --fix packed=true: kernels of packed sequences, timed on packed inputs (search.tune does the same).
    problem, held = search.packed_problem(problem, space.load(problem.variant).fix(dict(args.fix)))
    store = Store(args.storage or args.db)
    if threading.current_thread() is threading.main_thread():
        # Started as a background job, the process inherits SIGINT ignored: take it back, so that
        # an interrupt still reaches the workers (run_on_gpus passes it on).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    name, also = search.open_studies(problem, store, held, tuple(args.also_at), devices[0])
    # FLA's op timed here, once, before the workers (each would find it measured and go on).
    search.time_missing_baselines([problem, *(p for p, _ in also)], store, stack.current(devices[0]),
                                  gate_and_time if stack.has_gpu() else None, devices[0], search.Observer().note)
    gpu = stack.current(devices[0]).gpu
    work = functools.partial(_tune_worker, problem, _tune_options(args), args.seed)
    try:
        codes = workers.run_on_gpus(devices, work, search.log_base(store), lambda pid, device, log: print(
            f"tune: worker {pid} on GPU {device} ({gpu}), log {log}", flush=True))
    finally:
        console.print_summary(search.summarise(problem, store, name, held, gated=True, also_at=also))
    failed = [(device, code) for device, code in zip(devices, codes) if code != 0]
    for device, code in failed:
        print(f"tune: the worker on GPU {device} exited with {code}; see its log", file=sys.stderr)
    return failed[0][1] if failed else 0


def _tune_worker(problem, options: dict, seed: int | None, index: int) -> int:
    """One worker of ``tune run --gpus`` (in its own process, seeing one device as device 0)."""
    from . import console, search

    try:
        summary = search.tune(problem, **options, gpu=0, seed=None if seed is None else seed + index,
                              observer=console.Progress())
    except UserError as e:
        print(f"tune: error: {e}", file=sys.stderr)
        return 2
    console.print_summary(summary)
    return 0


def _cmd_regress(args) -> int:
    from . import regress

    for v in args.variant or ():
        variants.get(v)
    if args.replay and args.fla_only:
        print("tune regress: error: --replay runs nothing and --fla-only times FLA: choose one", file=sys.stderr)
        return 2
    return regress.regress_main(args.db, args.variant, replay_only=args.replay, fla_only=args.fla_only,
                                device=args.gpu)


def _cmd_dashboard(args) -> int:
    from . import dashboard

    return dashboard.dashboard_main(args.db, args.out, vs_fla=args.vs_fla)


COMMANDS = {
    "run": _cmd_run, "render": _cmd_render, "compile": _cmd_compile, "gate": _cmd_gate, "predict": _cmd_predict,
    "calibrate": _cmd_calibrate, "regress": _cmd_regress, "dashboard": _cmd_dashboard,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, "run")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return COMMANDS[args.command](args)
    except UserError as e:
        print(f"tune: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
