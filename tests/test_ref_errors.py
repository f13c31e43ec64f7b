"""Bad inputs raise dsv4core.hal.OpInputError (a ValueError) naming the op and the argument,
through bind(..., policy="strict") and through the validating entry point dsv4core.hal.call."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _fp64ref import ops  # noqa: E402,F401

F = torch.float32
BF = torch.bfloat16
I64 = torch.int64


def z(*shape, dtype=F):
    return torch.zeros(*shape, dtype=dtype)


INV = torch.ones(32)  # d_r = 64
BAD_CASES = [
    # (op, bad argument, args)
    ("rms_norm", "weight", (z(3, 16), z(17), 1e-6)),                          # D mismatch
    ("rms_norm", "x", (z(3, 16, dtype=I64), None, 1e-6)),                      # integer activations
    ("hc_pre", "x", (z(3, 64), z(24, 64), z(3), z(24), 1e-6, 1e-6, 20)),       # rank 2, needs [T,n,H]
    ("hc_pre", "fn", (z(3, 4, 16), z(23, 64), z(3), z(24), 1e-6, 1e-6, 20)),   # (2+n)n rows
    ("hc_post", "comb", (z(3, 16), z(3, 4, 16), z(3, 4), z(3, 4, 5))),
    # H differs between o and residual: either argument may be the one named
    ("hc_post", "(o|residual)", (z(3, 16), z(3, 4, 15), z(3, 4), z(3, 4, 4))),
    ("hc_head", "fn", (z(3, 4, 16), z(4, 65), z(1), z(4), 1e-6, 1e-6)),
    ("rope", "positions", (z(3, 128), z(3), INV)),                              # float positions
    ("rope", "positions", (z(3, 128), torch.zeros(4, dtype=I64), INV)),        # T mismatch
    ("q_norm_rope", "q", (z(3, 512), torch.zeros(3, dtype=I64), INV, 1e-6)),   # rank 2, needs [T,h,d]
    ("kv_norm_rope", "weight", (z(3, 512), z(256), torch.zeros(3, dtype=I64), INV, 1e-6)),
    ("sparse_mqa_attention", "indices", (z(2, 4, 16), z(8, 16), z(2, 3), z(4), 0.25)),  # float indices
    ("sparse_mqa_attention", "kv", (z(2, 4, 16), z(8, 15), torch.zeros(2, 3, dtype=torch.int32), z(4), 0.25)),
    ("sparse_mqa_attention", "sink", (z(2, 4, 16), z(8, 16), torch.zeros(2, 3, dtype=torch.int32), z(5), 0.25)),
    ("sparse_mqa_attention", "q", (z(2, 16), z(8, 16), torch.zeros(2, 3, dtype=torch.int32), z(4), 0.25)),
    ("compress_pool", "ape", (z(2, 4, 16), z(2, 4, 16), z(4, 17), False)),
    ("compress_pool", "score", (z(2, 4, 16), z(2, 3, 16), z(4, 16), False)),
    ("indexer_scores", "k", (z(2, 4, 8), z(5, 9), z(2, 4), torch.zeros(2, dtype=I64), torch.ones(2, dtype=I64), 1.0)),
    ("indexer_scores", "weights", (z(2, 4, 8), z(5, 8), z(2, 3), torch.zeros(2, dtype=I64), torch.ones(2, dtype=I64), 1.0)),
    ("indexer_topk", "scores", (z(6), torch.ones(6, dtype=I64), 2)),
    ("indexer_topk", "k_lengths", (z(2, 6), torch.ones(3, dtype=I64), 2)),
    ("linear", "weight", (z(3, 64), z(32, 65))),                                # K mismatch
    ("linear", "weight_scale", (z(3, 256), z(128, 256).to(torch.float8_e4m3fn), z(1, 3))),
    ("wo_a", "weight", (z(2, 8, 256), z(4, 128, 256))),                        # G mismatch
    ("moe_route", "logits", (z(16), 4, 1.0)),                                  # rank 1
    ("moe_route", "correction_bias", (z(3, 16), 4, 1.0, z(15))),
    # I differs between w13 (2I rows) and w2 (I cols): either may be named
    ("moe_experts", "(w13|w2)", (z(2, 16), torch.zeros(2, 2, dtype=I64), z(2, 2), z(4, 16, 16), z(4, 16, 9), 10.0)),
    ("moe_experts", "ids", (z(2, 16), z(2, 2), z(2, 2), z(4, 16, 16), z(4, 16, 8), 10.0)),  # float ids
    ("reduce_scatter", "dim", (z(2, 4), 5)),                                   # no such dim
]


def _pattern(op, arg):
    # the message must name the op and the argument (any wording around them)
    return rf"(?s)\b{re.escape(op)}\b.*'{arg}'"


@pytest.mark.parametrize("op,arg,args", BAD_CASES, ids=[f"{c[0]}-{c[1].strip('()').replace('|', '_')}-{i}" for i, c in enumerate(BAD_CASES)])
def test_bad_input_via_call(op, arg, args):
    from dsv4core.hal import OpInputError, call

    with pytest.raises(OpInputError, match=_pattern(op, arg)) as ei:
        call(op, *args)
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("op,arg,args", BAD_CASES, ids=[f"{c[0]}-{c[1].strip('()').replace('|', '_')}-{i}" for i, c in enumerate(BAD_CASES)])
def test_bad_input_via_strict_binding(ops, op, arg, args):
    from dsv4core.hal import OpInputError

    with pytest.raises(OpInputError, match=_pattern(op, arg)):
        getattr(ops, op)(*args)


def test_op_input_error_is_value_error():
    from dsv4core.hal import OpInputError

    assert issubclass(OpInputError, ValueError)


def test_call_runs_the_op():
    # the validating entry point returns the same numbers as the bound reference op
    from dsv4core.hal import call

    x = torch.randn(3, 16)
    w = torch.randn(16)
    want = (x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double())
    torch.testing.assert_close(call("rms_norm", x, w, 1e-6).double(), want, rtol=2e-6, atol=0)
