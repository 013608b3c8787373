"""Packed sequences and grouped value heads in kda's pre_seq and chunked kernels (the config's ``packed``):
what only kda has. The tests kda shares with gdn (compiling, masked token accesses, packed set by the caller,
the chunked glue, and every GPU test) are in test_packed.py, parametrized over the variant.

CPU: the per-chunk decay GL is written per chunk slot under its sequence's guard and read at the slot of
the sequence's first chunk; the pre_seq split takes packed;
the pre_seq glue reads no tensor's values on the host and launches on the packed rows, GL per chunk slot;
the chunked glue launches on the packed rows, g per value head and channel.
"""
from __future__ import annotations

import re

import pytest
import torch
from packed_checks import CONFIGS, counted_index, launched
from template_checks import rendered_config

from tuner import space
from tuner.inputs import PACKED_LENGTHS
from tuner.problem import Problem

PACKED, PACKED_ALL, PACKED_CHUNKED, PACKED_ROLES = (CONFIGS["kda"][name]
                                                   for name in ("default", "all", "chunked", "roles"))


# ---- CPU: what is rendered and compiled ----

@pytest.mark.parametrize("overrides", [PACKED, PACKED_ALL, PACKED_ROLES], ids=["default", "all", "roles"])
def test_gl_is_written_per_chunk_slot_and_read_at_the_slot_of_the_sequences_first_chunk(overrides):
    source = rendered_config("kda", 128, **overrides).source
    # GL is written per chunk slot, only for a chunk of a sequence (a padding slot has length 0), and
    # read at the slot of the sequence's first chunk plus the chunk.
    slot = "cc * 2 + cb" if overrides.get("prepare_chunks", 1) == 2 else "slot"
    assert re.findall(r"\n\s*(.*)\n\s+GL\[(.*)\] = ", source) == [("if c * C < seqlen:", f"{slot}, hv, d")]
    sequential = source[source.index("def sequential"):source.index("def programs")]
    read = "gl_s[s, d] = GL[first + c, hv, d]" if overrides.get("sequential_roles") else "T.copy(GL[first + c, hv, :], gl_s)"
    assert read in sequential and "ChunkStarts" in sequential
    assert "h = " not in sequential  # its operands are all per value head


def test_the_pre_seq_split_takes_packed_too():
    kda, problem = space.load("kda"), Problem("kda", 128, 128)
    default = kda.default(problem, {"packed": True})
    assert kda.normalise({**default, "split": "pre_seq"})["packed"] is True


# ---- CPU: the host glue ----

def test_the_pre_seq_glue_reads_no_value_on_the_host_and_keeps_gl_per_chunk_slot(monkeypatch, tmp_path):
    lengths = PACKED_LENGTHS
    kernels, x, cu_seqlens, o, ht = launched("kda", PACKED_ALL, lengths, 2, 4, monkeypatch, tmp_path, torch.int32)
    T = sum(lengths)
    assert o.shape == (1, T, 4, 64) and ht.shape == (len(lengths), 4, 64, 64)
    q, k, g, beta, qg, kw, kg, gl, ab, aqk, bounds, chunks = kernels.calls["prepare"]
    assert q.shape == (T, 2, 64) and g.shape == (T, 4, 64) and beta.shape == (T, 4)
    assert qg.shape == kw.shape == kg.shape == (T, 4, 64) and ab.shape == (T, 4, 64)
    assert bounds.dtype == torch.int64 and torch.equal(bounds, cu_seqlens.long())
    index = [tuple(row) for row in chunks.tolist()]
    assert index == counted_index(lengths, 64, 2)
    assert gl.shape == (len(index), 4, 64)
    sequential = kernels.calls["sequential"]
    assert all(sequential[i] is t for i, t in ((0, qg), (1, kw), (2, kg), (4, gl), (10, bounds)))
    assert torch.equal(sequential[7], x["initial_state"])
    # Sequence n's chunk c is slot starts[n] + c: where the sequential kernel reads the GL prepare wrote.
    starts = sequential[11]
    assert starts.dtype == torch.int32 and starts.tolist() == [0, 1, 2, 3, 5]
    assert all(index[starts[n] + c] == (n, c) for n, c in index if n >= 0)


def test_the_chunked_glue_launches_on_the_packed_rows_g_per_value_head_and_channel(monkeypatch, tmp_path):
    # Its host reads, chunk index and each sequence's first chunk: test_packed.py's chunked glue test.
    lengths = (0, 130, 1, 64, 65)
    kernels = launched("kda", PACKED_CHUNKED, lengths, 1, 2, monkeypatch, tmp_path)[0]
    q, k, v, g, beta, gc, aqk, w, u, bounds, chunks = kernels.calls["chunk_intra"]
    T = sum(lengths)
    assert q.shape == k.shape == (T, 1, 64) and g.shape == gc.shape == (T, 2, 64) and aqk.shape == (T, 2, 64)
    assert w.shape == (T, 2, 64)
    chunk_o = kernels.calls["chunk_o"]
    assert chunk_o[1] is gc and chunk_o[2] is aqk and chunk_o[-2] is chunks
