"""benchmarks/prepare_timeline.py's stamps, checked on the CPU: every statement of the real pre_seq
precompute kernel's body but its buffer declarations is bracketed by an SM clock stamp, in order, the
stamped kernel still compiles for sm_90a with a clean ptxas report, and forward passes the stamp
buffer. The timeline itself needs the GPU."""
import re

import pytest

from template_checks import assert_compiles_clean, benchmark_module, rendered_config
from tuner.candidate import Candidate

# name -> (variant, config); kda's with the head index fastest in the precompute grid (prepare_grid).
CONFIGS = {"kda": ("kda", {"split": "pre_seq", "score_rows": "sub_chunk", "prepare_grid": "heads_first"}),
           "gdn": ("gdn", {"split": "pre_seq", "solve": "merged", "prepare_loads": "async"}),
           "gla": ("gla", {"split": "pre_seq"})}
# The precompute block's indices, in either grid order.
BLOCK = re.compile(r"as \((?:c, bh|bh, c), bb\):")


@pytest.fixture(scope="module")
def prepare_timeline():
    return benchmark_module("prepare_timeline")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def rendered(request):
    variant, config = CONFIGS[request.param]
    return rendered_config(variant, 128, **config)


def test_every_statement_but_the_declarations_is_stamped_in_order(prepare_timeline, rendered):
    source, labels = prepare_timeline.instrument(rendered.source)
    plain = rendered.source
    body = plain[BLOCK.search(plain).start():plain.index("return prepare")].splitlines()[1:]
    indent = re.match(r"\s*", body[0]).group(0)
    # The body's top-level statements, in order, less the declarations.
    expected = [line.strip() for line in body if line.startswith(indent) and line[len(indent)] not in " #)]}"
                and not line.strip().startswith(("else", "elif")) and " = T.alloc_" not in line]
    assert labels == expected and len(labels) > 5
    lines = source.splitlines()
    stamps = [i for i, line in enumerate(lines) if "STAMPS[0, c, " in line]
    assert len(stamps) == len(labels) + 1
    for point, (stamp, label) in enumerate(zip(stamps, labels)):
        assert f"STAMPS[0, c, {point}]" in lines[stamp]
        following = next(line.strip() for line in lines[stamp + 1:] if not line.strip().startswith("#"))
        assert following == label
    # Thread 0 of each block of the first head and batch writes them; forward passes the buffer.
    assert lines[stamps[0] - 1].strip() == "if bh == 0 and bb == 0 and tx == 0:"
    assert "tx = T.get_thread_binding()" in source and "STAMPS.zero_()" in source
    assert re.search(r'kernels\["prepare"\]\(.*, STAMPS\)', source)


def test_a_changed_kernel_is_refused_not_misread(prepare_timeline, rendered):
    with pytest.raises(SystemExit, match="expected one precompute block"):
        prepare_timeline.instrument(BLOCK.sub("as (c, bb, bh):", rendered.source))
    with pytest.raises(SystemExit, match="signature or its call changed"):
        prepare_timeline.instrument(rendered.source.replace('kernels["prepare"](', 'kernels["prepare"] (', 1))


def test_the_stamped_kernel_compiles_clean_for_hopper(prepare_timeline, rendered, tmp_path):
    source, _ = prepare_timeline.instrument(rendered.source)
    report = assert_compiles_clean(Candidate(rendered.problem, rendered.config, source), ["prepare", "sequential"], tmp_path)
    assert any(k.name == "prepare" and k.registers for k in report.kernels)
