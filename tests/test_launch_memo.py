"""The kernel modules' memoised launch plans (``Tune.memo``): a launch planned once per key is the
launch planned afresh, call by call, while the TUNE overrides, the active launch table's entry,
the device helpers (``target_programs``, ``rne``, ``interp``, ``accurate``: aot.device_branch
replaces them) and the shapes change. Nothing runs: every kernel of a module is replaced by a
launch recorder, and the launches (grid, non-tensor arguments, keywords) are compared exactly."""
from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

from launch_recorder import Recorder  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from dsv4core.conformance.cases import iter_cases  # noqa: E402
from dsv4core.hal import catalogue  # noqa: E402
from dsv4core.kernels.triton import OPS, predicates, registry  # noqa: E402
from dsv4core.kernels.triton.launch import active  # noqa: E402

#: per module: its memoised ops and TUNE overrides that change their launches
MODULES = {
    "rope": (("rope", "q_norm_rope", "kv_norm_rope"), {"HB": 2, "num_warps": 2, "rowpos_below": 1}),
    "norm": (("rms_norm",), {"ROWS": 1, "num_warps": 2}),
    "mhc": (("hc_pre", "hc_head", "hc_post"), {"BT": 32, "BK": 64, "target": 2, "epi_chunks": 2,
                                               "epi_num_warps": 2, "post_BLOCK": 128, "post_num_warps": 2}),
    "attention": (("sparse_mqa_attention",), {"BH": 32, "BK": 32, "S": 2, "cBLOCK": 1024, "num_warps": 8}),
    "cache": (("cache_store",), {"BD": 32, "BR": 2, "num_warps": 2}),
    "compress": (("compress_pool", "compress_windows"), {"BD": 16, "windows_BD": 16, "num_warps": 2,
                                                         "windows_num_warps": 2}),
    "topk": (("indexer_topk",), {"BLOCK": 16, "TB": 16, "num_warps": 2}),
    "indexer": (("indexer_scores_rows", "indexer_rotate_quant"), {"BD": 32, "BL": 16, "num_warps": 2, "BR": 16,
                                                                  "BN": 32, "rq_warps": 2}),
}

#: the device helpers a module may hold, answered as a small GPU would (8 programs: not the
#: interpreter's count, so that the split plans differ)
HELPERS = {"target_programs": lambda device, cpu=16: 8, "rne": lambda out: False,
           "rne_for": lambda device, dtype: False, "interp": lambda t: False, "accurate": lambda t: True}


def _cases(op):
    spec = catalogue()[op]
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for case in iter_cases(spec, "small", dtype, "cpu", 0):
            if predicates.SUPPORTS[op](**case.kwargs):
                out.append(case)
    return out


def _launches(recorders):
    return [(name, grid, [a for a in args if not isinstance(a, torch.Tensor)], kw)
            for name, rec in recorders.items() for grid, args, kw in rec.launches]


@pytest.mark.parametrize("modname", sorted(MODULES))
def test_memoised_launches_are_the_launches_planned_afresh(modname, monkeypatch):
    ops, overrides = MODULES[modname]
    assert all(OPS[op] == modname for op in ops)
    mod = importlib.import_module(f"dsv4core.kernels.triton.{modname}")
    recorders = {n: Recorder() for n, v in vars(mod).items() if isinstance(v, JITFunction) and n.endswith("_kernel")}
    for n, rec in recorders.items():
        monkeypatch.setattr(mod, n, rec)
    calls = [(registry.kernel(op), case.kwargs) for op in ops for case in _cases(op)]
    assert calls
    helpers = {n: f for n, f in HELPERS.items() if hasattr(mod, n)}
    table = {modname: {k: v for k, v in list(overrides.items())[:2]}}

    def states():
        """The parameter states, in turn (each yielded while in effect)."""
        yield "defaults"
        mod.TUNE.update(overrides)
        yield "overrides"
        with active(table):
            yield "overrides over the table"
            mod.TUNE.clear()
            yield "the table"
        for n, f in helpers.items():          # one at a time: each must be in the keys
            real = getattr(mod, n)
            setattr(mod, n, f)
            try:
                yield f"as on a GPU: {n}"
            finally:
                setattr(mod, n, real)
        for n, f in helpers.items():
            monkeypatch.setattr(mod, n, f)
        yield "as on a GPU"
        mod.TUNE.update(overrides)
        yield "as on a GPU, overrides"
        mod.TUNE.clear()
        monkeypatch.undo()
        for n, rec in recorders.items():
            monkeypatch.setattr(mod, n, rec)
        yield "defaults again"

    def run(fresh):
        """Per state, per call, the launches (memoised: the call made twice, the second reads the memo)."""
        got = {}
        mod.TUNE.clear()
        mod.TUNE._memo.clear()
        for state in states():
            got[state] = []
            for fn, kwargs in calls:
                for _ in range(1 if fresh else 2):
                    if fresh:
                        mod.TUNE._memo.clear()
                    for rec in recorders.values():
                        rec.launches.clear()
                    fn(**kwargs)
                    got[state].append(_launches(recorders))
        return got

    try:
        memoised, afresh = run(False), run(True)
    finally:
        mod.TUNE.clear()
        mod.TUNE._memo.clear()
    assert list(memoised) == list(afresh)
    for state, launches in afresh.items():
        assert memoised[state][0::2] == launches and memoised[state][1::2] == launches, state
    # the states really differ (the overrides and the table's entry reach the launches)
    assert afresh["overrides"] != afresh["defaults"] and afresh["the table"] != afresh["defaults"]
    assert afresh["defaults again"] == afresh["defaults"]
    assert not helpers or afresh["as on a GPU"] != afresh["defaults"]
