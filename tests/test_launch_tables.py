"""The launch-table mechanism (dsv4core/kernels/triton/launch.py): a plugin's table reaches the
shared kernels only while that plugin's op runs; tuning overrides win; callable entries see the
call; target-only keywords are filtered by what a Triton target accepts."""
from __future__ import annotations

import types

import pytest

import torch

from dsv4core.hal import Backend
from dsv4core.kernels.triton import registry
from dsv4core.kernels.triton.launch import AMD_ONLY, TUNING_KEYS, LaunchTable, Tune, active, for_target


def test_tune_layers_override_table_default():
    t = Tune("dsv4core.kernels.triton.attention", ("BK", "BH"))
    assert t.get("BK", 64) == 64 and not t.sets_any() and t.options() == {}
    with active({"attention": {"launch": {"waves_per_eu": 2}}}):
        assert not t.sets_any()            # launch keywords alone set no parameter
    with active({"attention": {"BK": 32, "launch": {"waves_per_eu": 2}}, "norm": {"ROWS": 4}}):
        assert t.get("BK", 64) == 32 and t.get("BH", 16) == 16 and t.sets_any()
        assert t.options() == {"waves_per_eu": 2}
        t["BK"] = 128                      # a tuning script's override wins over the table
        assert t.get("BK", 64) == 128
        t.clear()
    assert t.get("BK", 64) == 64           # the table is gone after the block
    t["BH"] = 8
    assert t.sets_any()
    with pytest.raises(TypeError, match="no truth value: use TUNE.sets_any"):
        bool(t)                            # "non-empty" would read the overrides only


def test_tune_refuses_unknown_keys():
    """A retired or misspelt key must not silently run the defaults under its name."""
    t = Tune("dsv4core.kernels.triton.attention", ("BK",))
    for set_it in (lambda: t.__setitem__("pv", "dup"), lambda: t.update({"BK": 32, "DV": 128}),
                   lambda: t.update(pipe=2), lambda: t.setdefault("bk", 32)):
        with pytest.raises(ValueError, match=r"launch parameters of attention \(TUNE\): unknown key"):
            set_it()
        assert dict(t) == {}               # nothing set by a refused update
    t.update({"BK": 32, "launch": {"num_ctas": 1}})
    assert t.get("BK") == 32


def test_every_kernel_module_declares_what_it_reads():
    """Each module's TUNE keys cover the keys its source reads (TUNE.get / tune.get("..."))."""
    import importlib
    import re
    from pathlib import Path

    import dsv4core.kernels.triton as pkg

    for path in sorted(Path(pkg.__file__).parent.glob("*.py")):
        src = path.read_text()
        if "TUNE = Tune(" not in src or path.stem == "launch":
            continue
        mod = importlib.import_module(f"dsv4core.kernels.triton.{path.stem}")
        assert mod.TUNE.keys == set(TUNING_KEYS[path.stem]) | {"launch"}, path.stem   # what the tables are checked with
        read = set(re.findall(r'(?:TUNE|tune)\.get\("(\w+)"', src))
        assert read <= mod.TUNE.keys, (path.stem, sorted(read - mod.TUNE.keys))
        # and no declared key is stale: each is named in the module (keys read in loops included)
        # (with the sources of the sibling modules it imports: wo_a launches linear's kernel)
        siblings = re.findall(r"^from \.(\w+) import", src, re.M) + [
            m.strip() for names in re.findall(r"^from \. import ([\w, ]+)", src, re.M) for m in names.split(",")]
        used = src + "".join((path.parent / f"{m}.py").read_text() for m in siblings
                             if m != "launch")      # launch.py names every module's keys
        stale = [k for k in mod.TUNE.keys - {"launch"} if f'"{k}"' not in used]
        assert not stale, (path.stem, stale)


def test_registry_refuses_a_table_entry_with_unknown_keys():
    from dsv4core.kernels.triton import norm

    b = Backend("t-badtable", device_types=("cpu",), priority=1)
    registry.register_ops(b, "cpu", ops=("rms_norm",), launch={"norm": {"ROWS": 2, "rows": 4}})
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="launch parameters of norm .*unknown key.*rows"):
        b.impls["rms_norm"].fn(x, torch.ones(8), 1e-6)
    assert norm.TUNE.keys >= {"ROWS", "num_warps", "launch"}


def test_registry_wrapper_activates_the_backends_table(monkeypatch):
    seen = []
    tune = Tune("norm", ("ROWS",))

    def rms_norm(x, weight, eps):
        seen.append((tune.get("ROWS", 1), tune.options()))
        return x

    monkeypatch.setitem(registry._mods, "norm", types.SimpleNamespace(TUNE=tune))
    monkeypatch.setitem(registry.KERNELS, "rms_norm", rms_norm)   # what @implements would record
    calls = []

    def entry(*args, **kwargs):              # a callable entry sees the op's arguments
        calls.append(args[0].dtype)
        return {"ROWS": 8 if args[0].dtype == torch.float32 else 2, "launch": {"num_ctas": 1}}

    resolved = []

    def table():                              # resolved once, at the first call
        resolved.append(1)
        return {"norm": entry}

    b = Backend(name="t", device_types=("cpu",))
    registry.register_ops(b, "cpu", ops={"rms_norm"}, launch=table)
    assert not resolved
    x = torch.zeros(2, 4)
    b.impls["rms_norm"].fn(x, None, 1e-6)
    b.impls["rms_norm"].fn(x.bfloat16(), None, 1e-6)
    assert seen == [(8, {"num_ctas": 1}), (2, {"num_ctas": 1})] and len(resolved) == 1
    assert calls == [torch.float32, torch.bfloat16]
    assert tune.get("ROWS", 1) == 1                            # nothing leaks out of the call
    assert b.impls["rms_norm"].supports(x, None, 1e-6)
    assert not b.impls["rms_norm"].supports(x.to(torch.int32), None, 1e-6)


def test_extra_supports_predicates_decline():
    b = Backend(name="t", device_types=("cpu",))
    registry.register_ops(b, "cpu", ops={"rms_norm"}, supports={"rms_norm": lambda *a, **k: a[0].shape[-1] <= 4})
    assert b.impls["rms_norm"].supports(torch.zeros(2, 4), None, 1e-6)
    assert not b.impls["rms_norm"].supports(torch.zeros(2, 8), None, 1e-6)


def test_for_target_drops_unaccepted_keywords():
    table = {"attention": {"BK": 16, "launch": {"waves_per_eu": 2, "num_ctas": 1}},
             "moe": lambda *a, **k: {"BN": 32, "launch": {"matrix_instr_nonkdim": 16}}}
    cuda_like = {"num_warps", "num_stages", "num_ctas"}
    out = for_target(table, cuda_like)
    assert out["attention"] == {"BK": 16, "launch": {"num_ctas": 1}}
    assert out["moe"]() == {"BN": 32, "launch": {}}
    assert table["attention"]["launch"] == {"waves_per_eu": 2, "num_ctas": 1}     # not modified
    assert {"waves_per_eu", "matrix_instr_nonkdim", "kpack"} <= set(AMD_ONLY)


def test_amd_options_are_what_triton_amd_accepts_and_cuda_rejects():
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from dsv4core.kernels.triton.launch import accepted_options

    amd = accepted_options(GPUTarget("hip", "gfx942", 64))
    cuda = accepted_options(GPUTarget("cuda", 90, 32))
    assert {"waves_per_eu", "matrix_instr_nonkdim", "kpack"} <= amd
    assert not ({"waves_per_eu", "matrix_instr_nonkdim", "kpack"} & cuda)


def test_the_sweep_rows_use_known_keys():
    """benchmarks/tune_triton.py's rows set TUNE keys the kernel modules read (a refused key would
    stop the GPU sweep at that row)."""
    from _scripts import load_script

    mod = load_script("tune_triton", "tune_triton_rows")
    for rows in mod.SETS.values():
        for label, kmod, _, variants in rows:
            for v in variants:
                kmod.TUNE.check(v, f"sweep {label}")


def _call_args():
    """Sample arguments for callable table entries: activations bf16 / fp32 at T = 1 / 64, with bf16,
    FP8 (+ scale) and fp32 weights (the entries look at the activation and one-byte tensors)."""
    fp8 = torch.float8_e4m3fn
    out = []
    for dt in (torch.bfloat16, torch.float32):
        for T in (1, 64):
            out.append((torch.zeros(T, 8, dtype=dt), torch.zeros(8, 8, dtype=fp8), torch.ones(1, 1)))
            out.append((torch.zeros(T, 8, dtype=dt), torch.zeros(8, 8, dtype=dt)))
            out.append((torch.zeros(T, 4, 8, dtype=dt), torch.zeros(24, 32)))
    return out


def test_every_plugin_table_sets_only_declared_keys(monkeypatch):
    """Each entry of the rocm / xpu / cuda launch tables (every arch, every callable entry on sample
    arguments) names a kernel module with launch parameters and sets only its keys: a bad key in a
    table no CPU test runs would otherwise surface at that op's first call on the device."""
    import importlib
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "plugins"
    for sub in ("rocm", "xpu", "cuda"):
        monkeypatch.syspath_prepend(str(root / sub))
    rocm = importlib.import_module("dsv4core_rocm.launch")
    xpu = importlib.import_module("dsv4core_xpu.launch")
    cuda = importlib.import_module("dsv4core_cuda.launch")
    tables = {f"rocm {a}": t for a, t in rocm.TABLES.items()}
    tables.update({f"xpu {t}": xpu.TABLES[t] for t in xpu.TABLES})
    tables.update({f"cuda {a}": t for a, t in cuda.TABLES.items()})
    checked = 0
    for name, table in tables.items():
        for modname, entry in table.items():
            mod = importlib.import_module(f"dsv4core.kernels.triton.{modname}")
            assert hasattr(mod, "TUNE"), (name, modname)
            for got in ([entry(*a) for a in _call_args()] if callable(entry) else [entry]):
                assert got is None or isinstance(got, dict), (name, modname, got)
                mod.TUNE.check(got or {}, name)
                checked += 1
    assert checked > 100
    assert "dsv4core_rocm.launch" in sys.modules


def test_registry_refuses_entries_it_cannot_apply(monkeypatch):
    b = Backend("t-route", device_types=("cpu",), priority=1)
    registry.register_ops(b, "cpu", ops=("moe_route",), launch={"route": {"num_warps": 2}})
    with pytest.raises(ValueError, match="an entry for 'route' .*without launch parameters"):
        b.impls["moe_route"].fn(torch.zeros(1, 4), 2, 1.0)
    b = Backend("t-badcall", device_types=("cpu",), priority=1)
    registry.register_ops(b, "cpu", ops=("rms_norm",), launch={"norm": lambda *a, **k: ("ROWS", 2)})
    with pytest.raises(TypeError, match="the entry for 'norm' returned tuple for op rms_norm"):
        b.impls["rms_norm"].fn(torch.randn(2, 8), torch.ones(8), 1e-6)


def test_launch_table_refuses_unknown_modules_and_keys_when_built():
    """A misspelt key fails where the table is built, naming plugin, target, module, key, known keys."""
    with pytest.raises(ValueError, match=r"launch parameters of attention \(plugin p, target t1\): unknown key\(s\) "
                                         r"bk; expected some of BH, BK, "):
        LaunchTable("p", {"t1": {"attention": {"bk": 32}}})
    with pytest.raises(ValueError, match=r"plugin p, target t1\): 'atention' is not a kernel module .*known: attention, "):
        LaunchTable("p", {"t1": {"atention": {"BK": 32}}})
    with pytest.raises(ValueError, match="fallback target 'x' has no entries"):
        LaunchTable("p", {"t1": {}}, fallback="x")
    with pytest.raises(TypeError, match="'launch' must be a dict"):
        LaunchTable("p", {"t1": {"norm": {"launch": 2}}})
    t = LaunchTable("p", {"t1": {"norm": lambda *a, **k: {"ROWS": 2, "rows": 4}}})
    b = Backend("t-badkey", device_types=("cpu",), priority=1)      # a callable's result: checked where it is called
    registry.register_ops(b, "cpu", ops=("rms_norm",), launch=t.resolve("t1"))
    with pytest.raises(ValueError, match=r"launch parameters of norm \(the launch table's entry, op rms_norm\): "
                                         r"unknown key\(s\) rows"):
        b.impls["rms_norm"].fn(torch.randn(2, 8), torch.ones(8), 1e-6)
    with pytest.raises(TypeError, match="register_ops takes one target's entries"):
        registry.register_ops(Backend("t-whole", device_types=("cpu",)), "cpu", launch=t)


def test_launch_table_selects_targets():
    entry = {"ROWS": 2, "launch": {"waves_per_eu": 2, "num_ctas": 1}}
    t = LaunchTable("p", {"a1": {"norm": entry}, "other": {}}, fallback="other")
    assert t.resolve("a1") == {"norm": entry} and t.resolve("a9") == {} and list(t) == ["a1", "other"]
    assert t.resolve("a1", {"num_ctas"}) == {"norm": {"ROWS": 2, "launch": {"num_ctas": 1}}}
    sel = LaunchTable("p", {"big": {"norm": {"ROWS": 8}}, "small": {"norm": {"ROWS": 1}}},
                      select=lambda n: "big" if n >= 100 else "small")
    assert sel.resolve(100)["norm"]["ROWS"] == 8 and sel.resolve(99)["norm"]["ROWS"] == 1
    with pytest.raises(KeyError, match="no entries for 'a9'; targets: big, small"):
        LaunchTable("p", {"big": {}, "small": {}}).resolve("a9")
    assert set(TUNING_KEYS) == {"attention", "cache", "compress", "indexer", "linear", "mhc", "moe", "norm", "rope",
                                "topk", "wo_a"}


def test_a_callable_entry_may_return_nothing_through_for_target():
    """A callable entry returning None ("no parameters for this call") stays None when the table
    is restricted to a target's launch options."""
    from dsv4core.kernels.triton.launch import for_target

    t = for_target({"norm": lambda *a, **k: None, "rope": lambda *a, **k: {"launch": {"waves_per_eu": 2, "x": 1}}},
                   {"x"})
    assert t["norm"]() is None and t["rope"]() == {"launch": {"x": 1}}


def test_cuda_sm90_entries_hold_the_h200_tiles(monkeypatch):
    """The H200-measured attention and mhc tiles are the CUDA plugin's sm90 entries (the kernels'
    defaults are the portable 16 x 16 / non-prefill tiles): prefill mixes only for hc_pre at T >= 2048 on a
    device with >= 200 KiB of shared memory a block; FP8 rows (keyword or positional) 32 rows x 1 stage."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "plugins" / "cuda"))
    cuda = importlib.import_module("dsv4core_cuda.launch")
    mhc, att = cuda.TABLES.resolve((9, 0))["mhc"], cuda.TABLES.resolve((8, 6))["attention"]
    big = {"BT": 128, "BK": 64, "num_warps": 8, "num_stages": 4}
    x, fn_pre, fn_head = torch.empty(2048, 4, 8), torch.empty(24, 32), torch.empty(4, 32)
    for smem, want in ((232448, big), (101376, None)):
        monkeypatch.setattr(cuda, "shared_bytes", lambda dev, smem=smem: smem)
        assert mhc(x, fn_pre, None, None, 1e-6, 1e-6, 20) == want
        assert mhc(x=x, fn=fn_pre) == want
        assert mhc(x[:2047], fn_pre) is None and mhc(x, fn_head) is None
        assert mhc(torch.empty(2048, 8), x, torch.empty(2048, 4), torch.empty(2048, 4, 4)) is None   # hc_post
    monkeypatch.undo()
    assert cuda.shared_bytes(torch.device("cpu")) == 0
    q1, q128, kv = torch.empty(1, 64, 512, dtype=torch.bfloat16), torch.empty(128, 64, 512, dtype=torch.bfloat16), None
    assert att(q1, kv, None, None, 1.0) == {"BH": 16, "BK": 64, "num_stages": 2, "pipe": 1}
    assert att(q128, kv, None, None, 1.0) == {"BH": 32, "BK": 32, "num_stages": 2, "pipe": 0}
    assert att(q1, kv, None, None, 1.0, "fp8") == att(q=q1, kv=kv, kv_format="fp8") == \
        {"BH": 16, "BK": 32, "num_stages": 1, "pipe": 1}
    assert att(q1.float(), kv, None, None, 1.0)["BK"] == 16


def test_tune_memo_follows_the_parameters_in_effect():
    """A memoised launch configuration is rebuilt whenever an override or the active table's entry
    changes (compared by value, value types included), and never kept for unhashable ones."""
    t = Tune("dsv4core.kernels.triton.norm", ("ROWS", "num_warps"))
    built = []

    def cfg():
        built.append(1)
        return {"ROWS": t.get("ROWS", 1), "options": t.options()}

    assert t.memo("k", cfg) == {"ROWS": 1, "options": {}} and t.memo("k", cfg) is t.memo("k", cfg)
    assert len(built) == 1
    assert t.memo("other", cfg) and len(built) == 2                       # another key
    t["ROWS"] = 4
    assert t.memo("k", cfg)["ROWS"] == 4
    with active({"norm": {"ROWS": 2}}):
        assert t.memo("k", cfg)["ROWS"] == 4                               # the override still wins
        t.clear()
        assert t.memo("k", cfg)["ROWS"] == 2
    with active({"norm": {"ROWS": 2}}):                                    # an equal entry: reused
        n = len(built)
        assert t.memo("k", cfg)["ROWS"] == 2 and len(built) == n
    with active({"norm": {"ROWS": True}}):                                 # True == 1 == 1.0, not the same
        assert t.memo("k", cfg)["ROWS"] is True
    with active({"norm": {"ROWS": 1}}):
        assert type(t.memo("k", cfg)["ROWS"]) is int
    with active({"norm": {"launch": {"waves_per_eu": 2}}}):
        assert t.memo("k", cfg)["options"] == {"waves_per_eu": 2}
    assert t.memo("k", cfg) == {"ROWS": 1, "options": {}}                  # the table gone
    with active({"norm": {"ROWS": [2]}}):                                  # unhashable: built each call
        n = len(built)
        t.memo("k", cfg), t.memo("k", cfg)
        assert len(built) == n + 2

    def bad():
        raise ValueError("bad TUNE")
    for _ in range(2):                                                     # a failure is not remembered
        with pytest.raises(ValueError, match="bad TUNE"):
            t.memo("bad", bad)


def test_np2_is_tritons_next_power_of_2():
    pytest.importorskip("triton")
    import triton

    from dsv4core.kernels.triton._util import np2

    for n in [*range(-3, 4100), 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 1, 2 ** 40 + 5]:
        assert np2(n) == triton.next_power_of_2(max(n, 1)), n
    assert np2(4096.0) == 4096 and type(np2(7)) is int


def test_linear_launch_follows_overrides_and_the_table_call_by_call(monkeypatch):
    """linear's per-call configuration is memoised (Tune.memo): a later call still launches what a
    TUNE override, the active table's entry or the shapes ask for."""
    pytest.importorskip("triton")
    from launch_recorder import Recorder

    from dsv4core.kernels.triton import linear

    rec = Recorder()
    monkeypatch.setattr(linear, "_gemm_kernel", rec)
    monkeypatch.setattr(linear, "_reduce_kernel", Recorder())
    monkeypatch.setattr(linear, "interp", lambda t: False)   # the GPU's tiles (nothing runs)
    linear.TUNE.clear()
    x, w = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(512, 256, dtype=torch.bfloat16)

    def launched(x=x):
        linear.linear(x, w)
        kw = rec.launches[-1][2]
        return kw["BM"], kw["BN"], kw["BK"], kw["num_warps"]

    try:
        assert launched() == (16, 64, 64, 4)                       # linear_tiles(1): the portable default
        linear.TUNE["BN"] = 32
        assert launched() == (16, 32, 64, 4)
        with active({"linear": {"BK": 128, "num_warps": 8}}):
            assert launched() == (16, 32, 128, 8)
            linear.TUNE.clear()
            assert launched() == (16, 64, 128, 8)
        assert launched() == (16, 64, 64, 4)
        assert launched(torch.zeros(40, 256, dtype=torch.bfloat16)) == (64, 64, 64, 4)    # M <= 64
        assert launched() == (16, 64, 64, 4)
        # a table's tile function (TUNE "tiles") replaces the kernel's, per call
        with active({"linear": {"tiles": lambda M, q, big: ("dot", 32, 128, 128, 8, 3)}}):
            assert launched() == (32, 128, 128, 8)
        assert launched() == (16, 64, 64, 4)
    finally:
        linear.TUNE.clear()


def test_gemm_and_moe_tiles_live_in_the_plugin_tables(monkeypatch):
    """linear's, wo_a's and moe's H200 tiles are the CUDA plugin's sm90 tile functions (TUNE "tiles"),
    the kernels' defaults the portable ones; rocm and xpu state the tiles they ran as the former
    defaults (wo_a on rocm: every tile key set)."""
    import importlib
    from pathlib import Path

    pytest.importorskip("triton")
    from dsv4core.kernels.triton import linear, moe, wo_a

    root = Path(__file__).resolve().parents[1] / "plugins"
    for p in ("cuda", "rocm", "xpu"):
        monkeypatch.syspath_prepend(str(root / p))
    cuda, rocm, xpu = (importlib.import_module(f"dsv4core_{p}.launch") for p in ("cuda", "rocm", "xpu"))
    sm90 = cuda.TABLES.resolve((9, 0))
    lt, mt = sm90["linear"]["tiles"], sm90["moe"]["tiles"]
    assert [lt(M, s, b) for M, s, b in ((1, False, False), (64, True, False), (1024, True, True), (1024, True, False))] == \
        [("dot", 16, 64, 128, 4, 3), ("dot", 64, 128, 64, 4, 3), ("swap", 128, 128, 64, 8, 3), ("dot", 128, 128, 64, 8, 3)]
    o, w = torch.empty(1, 8, 4096, dtype=torch.bfloat16), torch.empty(8, 1024, 4096, dtype=torch.bfloat16)
    wt = sm90["wo_a"](o, w)["tiles"]
    assert [wt(T, s) for T, s in ((1, True), (1, False), (64, False), (65, True))] == \
        [("dot", 16, 32, 128, 4, 4), ("dot", 16, 32, 256, 4, 4), ("dot", 64, 32, 128, 4, 4), ("dot", 128, 128, 128, 8, 3)]
    # Flash routed experts at T = 1 (6 pairs, 256 experts) and the shared expert (one expert), 264 programs
    assert mt(6, 256, 4096, 2048, 264, False, False, True, False) == (16, 64, 64, 128, 4, 4)
    assert mt(64, 1, 4096, 2048, 264, False, True, False, False) == (64, 32, 64, 128, 4, 3)
    assert mt(4096 * 6, 8, 4096, 2048, 264, False, True, False, True)[:3] == (128, 128, 256)
    # the kernels' portable defaults
    assert linear.linear_tiles(1, True) == ("dot", 16, 64, 64, 4, 2)
    assert linear.linear_tiles(4096, True, True) == ("dot", 64, 64, 64, 4, 2)
    assert moe._tiles(6, 256, 4096, 2048, 264, False, False, True, True) == (16, 64, 64, 64, 4, 2)
    assert moe._tiles(4096 * 6, 8, 4096, 2048, 264, False, True, False, True) == (64, 64, 64, 64, 4, 2)
    # rocm / xpu: their former default tiles, stated (no >= 200 KiB branch: no such device)
    for arch in ("gfx942", "gfx950", "other"):
        ent = rocm.TABLES.resolve(arch)
        lin = ent["linear"] if isinstance(ent["linear"], dict) else ent["linear"](torch.empty(1, 64), torch.empty(64, 64))
        assert lin["tiles"](1024, True, True) == ("dot", 128, 128, 64, 8, 3)
        mo = ent["moe"](torch.empty(1, 64, dtype=torch.bfloat16))
        assert mo["tiles"](6, 256, 4096, 2048, 264, False, False, False, False)[::4] == (16, 4)
        assert set(ent["wo_a"](torch.empty(1, 8, 64, dtype=torch.bfloat16))) >= {"BM", "BN", "BK", "num_warps", "num_stages"}
    for slm in (0, 256 * 1024):
        ent = xpu.TABLES.resolve(slm)
        assert ent["linear"]["tiles"](1, False) == ("dot", 16, 64, 128, 4, 3)
        assert ent["wo_a"]["tiles"](1, False) == ("dot", 16, 32, 256, 4, 4)
        assert ent["moe"](torch.empty(1, 64))["tiles"](4096 * 6, 8, 4096, 2048, 264, False, True, False, True)[::4] == (128, 8)
