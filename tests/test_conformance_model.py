"""The model-level check can fail in every dtype it reports: bfloat16 judged against the
reference's own bf16 error, an FP8 tiny model so the FP8 paths run, fallbacks counted per op."""

from __future__ import annotations

import pytest
import torch

from dsv4core.conformance import FAILED, PASSED
from dsv4core.conformance.model_check import BF16_K, check_model

from _model_hf import _one_thread  # noqa: F401 (autouse: one torch thread)
from conformance_backends import ALT_IMPLS, QUANT_BROKEN, make_alt_backend, make_backend


def _runs(m):
    if m["status"] == "unavailable":
        pytest.skip(m["reason"])
    return {r["dtype"]: r for r in m["runs"]}


def rms_norm_bf16_accumulation(x, weight, eps):
    """Correct in float32; with bf16 activations the sum of squares is accumulated in bf16 (the
    outside test's planted bug, which the old bf16 model check printed as 'passed')."""
    if x.dtype != torch.bfloat16:
        return ALT_IMPLS["rms_norm"](x, weight, eps)
    acc = torch.zeros(x.shape[:-1], dtype=torch.bfloat16)
    for j in range(x.shape[-1]):
        acc = acc + x[..., j] * x[..., j]
    y = x.float() / torch.sqrt(acc.float()[..., None] / x.shape[-1] + eps)
    return (y if weight is None else y * weight.float()).to(x.dtype)


def test_legal_backend_passes_every_run_with_the_bf16_bound_stated():
    m = check_model(make_alt_backend(), "tiny", ("float32", "bfloat16"), steps=8)
    runs = _runs(m)
    assert set(runs) == {"float32", "bfloat16", "bfloat16-official", "float32-fp8"}
    assert m["status"] == PASSED, m
    off = runs["bfloat16-official"]
    assert off["model"] == "tiny-official" and off["numerics"] == "official"
    # what the official model computes: FP8 projections, packed FP4 experts, FP8 KV rows, FP4 keys
    # (read off the judged model's parameters and cache); the float32 reference stores float32 rows
    assert off["weights"] == "fp8+fp4" and off["kv_dtype"] == "fp8" and off["reference_kv_dtype"] == "float32"
    assert off["kv_formats"] == {"rows": "fp8", "indexer_keys": "fp4"}
    assert (runs["float32"]["weights"], runs["float32"]["kv_dtype"]) == ("float32", "float32")
    assert (runs["bfloat16"]["weights"], runs["bfloat16"]["kv_dtype"]) == ("bfloat16", "bfloat16")
    assert "kv_formats" not in runs["bfloat16"]
    for p in off["per_prompt"]:          # the official numerics assembled alike: ~1x the reference's
        assert p["error"] <= 1.2 * p["reference_error"], p
    bf = runs["bfloat16"]
    assert bf["bound_k"] == BF16_K and len(bf["per_prompt"]) == bf["prompts"] >= 3
    for p in bf["per_prompt"]:           # a legal backend sits at ~1x the reference's own error
        assert p["bound"] == BF16_K * p["reference_error"] and p["error"] <= 1.2 * p["reference_error"]
    assert not m["fallbacks"] and m["calls"]["linear"] > 0


def test_bf16_accumulating_norm_fails_the_bf16_run_only():
    m = check_model(make_backend("bf16norm", dict(ALT_IMPLS, rms_norm=rms_norm_bf16_accumulation)), "tiny",
                    ("float32", "bfloat16"), steps=8, fp8=False, official=False)
    runs = _runs(m)
    assert runs["float32"]["status"] == PASSED
    assert runs["bfloat16"]["status"] == FAILED and m["status"] == FAILED
    assert "the reference's own bf16 error" in runs["bfloat16"]["message"]


def test_official_run_reads_fp8_kv_rows_through_the_backend():
    """An attention that decodes FP8 KV rows without their UE8M0 scales is right on bf16 rows, so
    only a run whose state is stored as FP8 rows can catch it: the bfloat16-official run does."""
    op, fn = QUANT_BROKEN["kv-fp8-read-without-scales"]
    m = check_model(make_backend("fp8-read-no-scales", dict(ALT_IMPLS, **{op: fn})), "tiny", ("bfloat16-official",))
    runs = _runs(m)
    assert set(runs) == {"bfloat16-official"}
    off = runs["bfloat16-official"]
    assert off["kv_dtype"] == "fp8" and off["weights"] == "fp8+fp4"
    assert off["status"] == FAILED and m["status"] == FAILED, off
    assert "the reference's own bf16 error" in off["message"]
    assert m["calls"]["sparse_mqa_attention"] > 0 and not m["fallbacks"]


def linear_fp8_first_row_of_scales(x, weight, weight_scale=None, out_dtype=None, act_block=None):
    """Uses the first row of blocks' scales for every row of blocks."""
    if weight_scale is not None:
        weight_scale = weight_scale[:1].expand_as(weight_scale)
    return ALT_IMPLS["linear"](x, weight, weight_scale, out_dtype)


def test_fp8_tiny_model_runs_the_fp8_paths_and_catches_wrong_block_scales():
    """The tiny model's projections have one 128-wide input block (hidden size <= 128), so a bug
    that ignores the scales' column index cannot show in it (the op cases catch that one:
    linear-fp8-scale-per-row in the teeth tests); one that ignores the row index does."""
    m = check_model(make_backend("rowscale", dict(ALT_IMPLS, linear=linear_fp8_first_row_of_scales)), "tiny",
                    ("float32",), steps=8)
    runs = _runs(m)
    assert runs["float32"]["status"] == PASSED          # no FP8 weight in the plain tiny model
    assert runs["float32-fp8"]["status"] == FAILED, runs["float32-fp8"]
    assert m["calls"]["linear"] > 0 and not m["fallbacks"]


def test_fallbacks_are_counted_per_op_and_fail_require_all():
    from dsv4core.conformance import run

    def no_fp8(x, weight, weight_scale=None, out_dtype=None, act_block=None):
        return weight_scale is None

    be = make_backend("nofp8", ALT_IMPLS, supports={"linear": no_fp8})
    m = check_model(be, "tiny", ("float32",), steps=4)
    runs = _runs(m)
    assert m["status"] == PASSED
    assert not runs["float32"]["fallbacks"] and runs["float32-fp8"]["fallbacks"]["linear"] > 0
    assert m["fallbacks"] == runs["float32-fp8"]["fallbacks"]
    report = run(be, ops="rms_norm", dtypes="float32")
    report.model = m
    assert report.exit_code() == 0 and report.exit_code(require_all=True) == 1
    assert any("model check" in g and "linear" in g for g in report.gaps())
