"""Per-op benchmark of a backend against the reference and ``torch.compile`` of the reference.

    dsv4core bench --backend cuda --shapes flash --tokens 1,64,4096 --json out.json
    python -m dsv4core.bench --backend cuda ...            (same thing, as a script)

For each op and token count: median device time (on CUDA: CUDA events around each call, warm-up first, L2
flushed before every timed call, i.e. cold-L2 numbers comparable with PERF-ANCHORS.md), the bytes
the op must move and its FLOPs (each input read once, each output written once), achieved GB/s and
TFLOP/s, % of the copy bandwidth and of the bf16 matmul rate **measured in the same run**, and the
speedup over the reference backend and over ``torch.compile`` of the reference.

Peers (``--compare``, default ``auto``: every other available backend serving the device, e.g. the
cuda plugin's ``cuda-flashinfer`` beside ``cuda``): each op a peer implements and accepts is timed
the same way in the same run, and the row gets its time and ``peer µs / our µs``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch

DEFAULT_OPS = ("rms_norm", "hc_pre", "hc_post", "hc_head", "rope", "q_norm_rope", "kv_norm_rope",
               "sparse_mqa_attention", "compress_pool", "compress_pool_hca", "linear", "linear_fp8", "linear_fp8_official",
               "linear_lm_head", "wo_a", "wo_a_fp8", "moe_route", "moe_experts", "moe_experts_fp8", "moe_experts_fp4",
               "moe_experts_fp4_official", "moe_experts_shared")


# ---------------------------------------------------------------------------------------------- cases
@dataclass
class BenchCase:
    op: str            # HAL op name
    label: str         # row label (op, or op variant)
    kwargs: dict
    bytes: float
    flops: float
    note: str = ""
    graphable: bool = True     # False: the op syncs with the host (cannot be captured in a CUDA graph)


def _dims(shapes):
    from dsv4core.hal.ops._cases import dims

    return dims(shapes)


def _fp8(w):
    from dsv4core.hal.quant import quantize_fp8_block

    return quantize_fp8_block(w, torch.float32, pow2=True)


def _inv_freq(d_r=64, theta=10000.0, device="cpu"):
    return (theta ** (-torch.arange(0, d_r, 2, dtype=torch.float64) / d_r)).to(torch.float32).to(device)


def make_case(label: str, shapes: str, T: int, device, dtype=torch.bfloat16, gen=None) -> BenchCase:
    D = _dims(shapes)
    H, n, h, d, d_r = D["H"], D["n"], D["heads"], D["d"], D["d_r"]
    es = torch.tensor([], dtype=dtype).element_size()

    def rn(*shape, dt=dtype, s=1.0):
        return (torch.randn(*shape, device=device, dtype=torch.float32) * s).to(dt)

    pos = torch.randint(0, 60000, (T,), device=device)
    if label == "rms_norm":
        return BenchCase("rms_norm", label, dict(x=rn(T, H), weight=rn(H), eps=1e-6), 2 * T * H * es + H * es,
                         4 * T * H, "x [T,H]")
    if label in ("hc_pre", "hc_head"):
        M = (2 + n) * n if label == "hc_pre" else n
        x = rn(T, n, H)
        fn = rn(M, n * H, dt=torch.float32, s=0.02)
        if label == "hc_pre":
            kw = dict(x=x, fn=fn, scale=torch.tensor([0.6, 0.8, 1.1], device=device), base=rn(M, dt=torch.float32),
                      rms_eps=1e-6, hc_eps=1e-6, iters=20, post_mult=2.0)
            out_b = T * H * es + T * (n + n * n) * 4
        else:
            kw = dict(x=x, fn=fn, scale=torch.tensor([0.7], device=device), base=rn(M, dt=torch.float32),
                      rms_eps=1e-6, hc_eps=1e-6)
            out_b = T * H * es
        return BenchCase(label, label, kw, T * n * H * es + M * n * H * 4 + out_b,
                         2 * T * M * n * H + 4 * T * n * H, "x [T,n,H], fn fp32 read once")
    if label == "hc_post":
        comb = torch.softmax(rn(T, n, n, dt=torch.float32), -1)
        kw = dict(o=rn(T, H), residual=rn(T, n, H), post=rn(T, n, dt=torch.float32), comb=comb)
        return BenchCase("hc_post", label, kw, (T * H + 2 * T * n * H) * es + T * (n + n * n) * 4,
                         2 * T * n * H * (n + 1), "o [T,H] + residual [T,n,H] -> [T,n,H]")
    if label == "rope":
        kw = dict(x=rn(T, h, d), positions=pos, inv_freq=_inv_freq(d_r, device=device), inverse=True)
        return BenchCase("rope", label, kw, 2 * T * h * d * es, 6 * T * h * d_r, "inverse, attention output [T,h,d]")
    if label == "q_norm_rope":
        kw = dict(q=rn(T, h, d), positions=pos, inv_freq=_inv_freq(d_r, device=device), eps=1e-6)
        return BenchCase("q_norm_rope", label, kw, 2 * T * h * d * es, T * h * (4 * d + 6 * d_r), "q [T,h,d]")
    if label == "kv_norm_rope":
        kw = dict(kv=rn(T, d), weight=rn(d), positions=pos, inv_freq=_inv_freq(d_r, device=device), eps=1e-6)
        return BenchCase("kv_norm_rope", label, kw, 2 * T * d * es + d * es, T * (4 * d + 6 * d_r), "kv [T,d]")
    if label == "sparse_mqa_attention":
        K = D["window"] + D["topk"]
        Np = 1 << 17
        kv = rn(Np, d)
        base_off = torch.randint(0, Np, (T, 1), device=device)
        idx = ((base_off + torch.arange(K, device=device)[None, :] * 7919) % Np).to(torch.int32)
        kw = dict(q=rn(T, h, d), kv=kv, indices=idx, sink=rn(h, dt=torch.float32), scale=d ** -0.5)
        return BenchCase("sparse_mqa_attention", label, kw, T * K * d * es + 2 * T * h * d * es + T * K * 4,
                         T * K * 2 * h * 2 * d, f"{h} heads, K={K} rows/query (window {D['window']} + top-{D['topk']})")
    if label in ("compress_pool", "compress_pool_hca"):
        if label == "compress_pool":
            m, cc = 4, 2
        else:
            m, cc = 128, 1
        Wn = max(1, T // m)
        kw = dict(kv=rn(Wn, m, cc * d), score=rn(Wn, m, cc * d), ape=rn(m, cc * d, dt=torch.float32),
                  overlap=cc == 2)
        if cc == 2:
            kw.update(prev_kv=rn(m, d), prev_score=rn(m, d))
        return BenchCase("compress_pool", label, kw, 2 * Wn * m * cc * d * es + Wn * d * es + m * cc * d * 4,
                         Wn * m * cc * d * 5, f"{'CSA m=4 overlap' if cc == 2 else 'HCA m=128'}, Wn=T/m")
    if label in ("linear", "linear_fp8", "linear_fp8_official", "linear_lm_head"):
        # wq_b (q_lora -> heads * d), the largest attention projection; lm_head: vocab x H, fp32 out.
        # linear_fp8_official: the published checkpoints' FP8 (UE8M0 scales) under the official W8A8
        N, K = (129280, H) if label == "linear_lm_head" else (h * d, D["q_lora"])
        out_dt = torch.float32 if label == "linear_lm_head" else dtype
        w = rn(N, K, s=K ** -0.5)
        if label == "linear_fp8":
            w, sc = _fp8(w)
            wb = N * K + sc.numel() * 4
        elif label == "linear_fp8_official":
            from dsv4core.hal.quant import quantize_fp8_block

            w, sc = quantize_fp8_block(w, torch.float8_e8m0fnu, pow2=True)
            wb = N * K + sc.numel()
        else:
            sc, wb = None, N * K * es
        kw = dict(x=rn(T, K), weight=w, weight_scale=sc, out_dtype=out_dt)
        if label == "linear_fp8_official":
            kw["act_block"] = 128
        what = {"linear_fp8": "fp8 e4m3, fp32 128x128 scales",
                "linear_fp8_official": "fp8 e4m3, ue8m0 128x128 scales, official activations (act_block 128)"
                }.get(label, "bf16")
        return BenchCase("linear", label, kw, wb + T * K * es + T * N * torch.tensor([], dtype=out_dt).element_size(),
                         2 * T * N * K, f"{what} [{N},{K}]" + (", fp32 out" if label == "linear_lm_head" else ""))
    if label in ("wo_a", "wo_a_fp8"):
        G, R = D["G"], D["R"]
        Din = h * d // G
        w = rn(G, R, Din, s=0.02)
        if label == "wo_a_fp8":
            w, sc = _fp8(w)
            wb = G * R * Din + sc.numel() * 4
        else:
            sc, wb = None, G * R * Din * es
        kw = dict(o=rn(T, G, Din), weight=w, weight_scale=sc)
        return BenchCase("wo_a", label, kw, wb + T * G * (Din + R) * es, 2 * T * G * R * Din,
                         f"{'fp8' if sc is not None else 'bf16'} [T,{G},{Din}] x [{G},{R},{Din}]")
    if label == "moe_route":
        E, k = D["E"], D["k"]
        kw = dict(logits=rn(T, E, dt=torch.float32, s=2.0), topk=k, scaling=1.5,
                  correction_bias=rn(E, dt=torch.float32, s=0.1))
        return BenchCase("moe_route", label, kw, T * E * 4 + E * 4 + T * k * 8, T * E * (10 + 2 * k),
                         f"sqrtsoftplus top-{k} of {E} with a selection bias")
    if label == "moe_experts_shared":   # the shared expert: one expert, every token, weight 1
        I = D["I"]
        kw = dict(x=rn(T, H), ids=torch.zeros(T, 1, dtype=torch.int32, device=device),
                  weights=torch.ones(T, 1, device=device), w13=rn(1, 2 * I, H, s=H ** -0.5),
                  w2=rn(1, H, I, s=I ** -0.5), swiglu_limit=10.0)
        return BenchCase("moe_experts", label, kw, 3 * I * H * es + 2 * T * H * es, T * 6 * H * I,
                         f"bf16; the shared expert (one expert, k=1), I={I}")
    if label in ("moe_experts", "moe_experts_fp8", "moe_experts_fp4", "moe_experts_fp4_official"):
        E, k, I = D["E"], D["k"], D["I"]
        Eu = min(E, 32)   # experts actually allocated (memory); ids drawn over them
        w13 = rn(Eu, 2 * I, H, s=H ** -0.5)
        w2 = rn(Eu, H, I, s=I ** -0.5)
        s13 = s2 = None
        per_expert = 3 * I * H * es
        if label == "moe_experts_fp8":
            (w13, s13), (w2, s2) = _fp8(w13), _fp8(w2)
            per_expert = 3 * I * H + (s13[0].numel() + s2[0].numel()) * 4
        elif label in ("moe_experts_fp4", "moe_experts_fp4_official"):
            from dsv4core.hal.quant import quantize_fp4

            (w13, s13), (w2, s2) = quantize_fp4(w13), quantize_fp4(w2)
            per_expert = 3 * I * H // 2 + 3 * I * H // 32
        # the routing from its own seeded generator: a case touches the same experts in every run and
        # sweep (the bytes it moves, and so its time, depend on how many distinct experts it reads)
        g = torch.Generator().manual_seed(1_000_003 * T + 101 * k + Eu)
        ids = (torch.stack([torch.randperm(Eu, generator=g)[:k] for _ in range(T)]) if T <= 64 else
               torch.randint(0, Eu, (T, k), generator=g)).to(device)
        kw = dict(x=rn(T, H), ids=ids, weights=torch.rand(T, k, device=device), w13=w13, w2=w2, swiglu_limit=10.0,
                  w13_scale=s13, w2_scale=s2)
        if label == "moe_experts_fp4_official":   # the official expert math: activations fake-quantised per 128
            kw["act_block"] = 128
        touched = int(torch.unique(ids).numel())   # experts actually read (ids repeat across tokens)
        fmt = {"moe_experts": "bf16", "moe_experts_fp8": "fp8 128x128", "moe_experts_fp4": "fp4 e2m1 + ue8m0/32",
               "moe_experts_fp4_official": "fp4 e2m1 + ue8m0/32, official activations (act_block 128)"}[label]
        return BenchCase("moe_experts", label, kw, touched * per_expert + 2 * T * H * es,
                         T * k * 6 * H * I, f"{fmt}; {Eu} experts allocated, k={k}, I={I}; bytes = experts touched")
    raise KeyError(f"no bench case for {label!r}")


# --------------------------------------------------------------------------------------------- timing
class Timer:
    """``flush``: how L2 is made cold before each timed call. "write" (the default; the older
    committed results): zero a 256 MiB buffer, which leaves L2 full of dirty lines (~50 MB on an
    H200) that the timed call pays to write back while it reads (about 12 µs at 4.3 TB/s: most
    of the gap between a 64 MiB weight stream and the copy rate). "read": read the buffer
    instead, which leaves clean lines, as in a decode step whose kernels write little."""

    def __init__(self, device, flush_mb=256, flush="write"):
        if flush not in ("write", "read"):
            raise ValueError(f"Timer: flush={flush!r}; expected 'write' or 'read'")
        self.flush_mode = flush
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.flush = torch.empty(flush_mb << 20, dtype=torch.uint8, device=device) if self.cuda else None
        self.last_graphed = False
        self._keep = None

    def time(self, fn, warmup=3, reps=20, max_seconds=2.0, graph=True, host=None):
        """Median seconds per call of ``fn()``. On GPUs: device time with a cold L2 (a 256 MiB buffer is
        written before every timed call), the call replayed from a CUDA graph when it can be captured
        (so host launch overhead is excluded, as in the peers' kineto numbers), else launched eagerly.

        ``host`` (default: True for an eager call, False for a graph replay): wait for the L2 flush to
        finish before the timed call, so that the host work of launching it is inside the measured
        interval; otherwise up to the flush's duration (~60 µs) of launch overhead hides behind it."""
        for _ in range(warmup):
            fn()
        self.sync()
        call, self.last_graphed = fn, False
        if self.cuda and graph:
            try:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream(self.device).wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                g.replay()
                self.sync()
                call, self.last_graphed = g.replay, True
                self._keep = g
            except Exception:  # noqa: BLE001 - not capturable (host syncs...): time it eagerly
                self.sync()
        if host is None:
            host = not self.last_graphed
        times = []
        t_start = time.perf_counter()
        for _ in range(reps):
            if self.cuda:
                if self.flush_mode == "read":
                    self.flush.view(torch.int64).sum()
                else:
                    self.flush.zero_()
                if host:
                    self.sync()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                call()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) / 1e3)
            else:
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            if time.perf_counter() - t_start > max_seconds and len(times) >= 3:
                break
        self._keep = None
        return statistics.median(times)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)


def measure_ceilings(device, timer: Timer) -> dict:
    """Copy bandwidth (read + write counted), the bf16 matmul rate and, on a CUDA device with FP8
    tensor cores, the dense FP8 rate (``torch._scaled_mm``, e4m3 x e4m3 -> bf16, unit scales) on
    this device, now; ``fp8_mm_TFLOPs`` is None where torch has no FP8 matmul for the device
    (``fp8_mm_note`` says why)."""
    dev = torch.device(device)
    out = {}
    n = (1 << 30) if dev.type == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    a.random_(0, 255)
    t = timer.time(lambda: b.copy_(a), warmup=3, reps=10, graph=False, host=False)
    out["copy_GBps"] = 2 * n / t / 1e9
    del a, b
    m = 8192 if dev.type == "cuda" else 1024
    x = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    t = timer.time(lambda: x @ y, warmup=3, reps=10, graph=False, host=False)
    out["bf16_mm_TFLOPs"] = 2 * m ** 3 / t / 1e12
    out["fp8_mm_TFLOPs"], out["fp8_mm_note"] = None, "not a CUDA device"
    if dev.type == "cuda":
        try:
            xf = x.to(torch.float8_e4m3fn)
            yf = y.t().contiguous().to(torch.float8_e4m3fn).t()   # column-major: what _scaled_mm takes
            one = torch.ones((), device=dev)
            t = timer.time(lambda: torch._scaled_mm(xf, yf, one, one, out_dtype=torch.bfloat16),
                           warmup=3, reps=10, graph=False, host=False)
            out["fp8_mm_TFLOPs"], out["fp8_mm_note"] = 2 * m ** 3 / t / 1e12, "torch._scaled_mm e4m3, 8192^3"
        except (RuntimeError, TypeError, AttributeError) as e:   # no FP8 tensor cores / kernel for the device
            out["fp8_mm_note"] = f"torch._scaled_mm: {type(e).__name__}: {str(e)[:120]}"
    return out


# ------------------------------------------------------------------------------------------- backends
def get_backend(name: str):
    """The Backend object called ``name`` (discovered via entry points; the in-tree Triton backends are
    also built directly when the package metadata does not list them, e.g. a bare checkout)."""
    from dsv4core.hal import discover

    st = discover().get(name)
    if st is not None and st.backend is not None:
        if not st.available:
            raise RuntimeError(f"backend {name!r} is not available: {st.reason}")
        return st.backend
    got = []
    if name == "cuda":
        try:
            import dsv4core_cuda as mod
        except ImportError:
            import importlib.util
            import pathlib

            p = pathlib.Path(__file__).resolve().parent.parent / "plugins" / "cuda" / "dsv4core_cuda" / "__init__.py"
            spec = importlib.util.spec_from_file_location("dsv4core_cuda", p)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        mod.dsv4core_register_backends(register=got.append)
    elif name == "triton-interpret":
        from dsv4core.kernels.triton import interpret_plugin as mod

        mod.dsv4core_register_backends(register=got.append)
    if not got:
        raise RuntimeError(f"unknown backend {name!r}")
    ok, why = got[0].available()
    if not ok:
        raise RuntimeError(f"backend {name!r} is not available: {why}")
    return got[0]


def peer_backends(backend: str, device, compare="auto") -> dict:
    """name -> Backend of the peers to time beside ``backend``: ``"none"``, ``"auto"`` (every other
    available, non-reference backend serving ``device``'s type, by priority) or a comma list."""
    from dsv4core.hal import discover

    if not compare or compare == "none":
        return {}
    dev_type = torch.device(device).type
    if compare == "auto":
        sts = sorted(discover().values(), key=lambda st: (-st.priority, st.name))
        return {st.name: st.backend for st in sts
                if st.name not in (backend, "reference") and st.available and st.backend is not None
                and st.backend.serves(dev_type) and st.backend.impls}
    return {name: get_backend(name) for name in (n.strip() for n in compare.split(",")) if name and name != backend}


def _rel_err(got, want) -> float:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    errs = [float((g.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30))
            for g, w in zip(got, want) if w.numel()]
    return max(errs) if errs else 0.0


def _time_peers(peers: dict, case: BenchCase, t_ours: float, want, timer: Timer, reps: int, log) -> dict:
    out = {}
    for name, pb in peers.items():
        impl = pb.impls.get(case.op)
        if impl is None:
            continue
        kw = case.kwargs
        try:
            if impl.supports is not None and not impl.supports(**kw):
                out[name] = dict(status="declined", detail=impl.why_not(**kw) if impl.why_not else "")
                continue
            t = timer.time(lambda: impl.fn(**kw), reps=reps, graph=case.graphable)
            out[name] = dict(status="ok", us=t * 1e6, graphed=timer.last_graphed, peer_over_ours=t / t_ours,
                             max_rel_err_vs_ref=_rel_err(impl.fn(**kw), want))
        except Exception as e:  # noqa: BLE001 - a peer's failure is recorded, never fatal
            out[name] = dict(status="error", detail=f"{type(e).__name__}: {str(e)[:300]}")
        r = out[name]
        log(f"    vs {name}: " + (f"{r['us']:.1f} us = {r['peer_over_ours']:.2f} x ours, err {r['max_rel_err_vs_ref']:.1e}"
                                  if r["status"] == "ok" else f"{r['status']} {r.get('detail', '')}"))
    return out


# ------------------------------------------------------------------------------------------------ run
def run_bench(backend: str, ops=DEFAULT_OPS, shapes="flash", tokens=(1, 64, 4096), device=None,
              compile_ref=True, reps=20, log=print, partial_json=None, compare="auto", flush="write",
              progress=None) -> dict:
    """Time `ops` x `tokens` (rows, see `markdown`); `log(line)` gets each row as it is measured,
    `progress(i, n, op, T)` is called before case i of n."""
    from dsv4core.hal import catalogue

    b = get_backend(backend)
    if device is None:   # the backend's first concrete device type; the reference serves any ("*"): cpu
        device = next((t for t in b.device_types if t not in ("*", "meta")), "cpu")
    timer = Timer(device, flush=flush)
    ceil = measure_ceilings(device, timer)
    log(f"# device {device}: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s, "
        f"FP8 matmul {'%.0f TFLOP/s' % ceil['fp8_mm_TFLOPs'] if ceil.get('fp8_mm_TFLOPs') else ceil.get('fp8_mm_note', 'not measured')}")
    peers = peer_backends(backend, device, compare)
    if peers:
        log(f"# timed beside {backend}: {', '.join(peers)} (peer µs / our µs per row)")
    specs = catalogue()
    rows = []
    compiled = {}
    n_cases, i_case = len(ops) * len(tokens), 0
    for label in ops:
        for T in tokens:
            i_case += 1
            if progress is not None:
                progress(i_case, n_cases, label, T)
            try:
                case = make_case(label, shapes, T, device)
            except KeyError as e:
                log(f"skip {label}: {e}")
                break
            impl = b.impls.get(case.op)
            row = dict(op=label, T=T, shapes=shapes, note=case.note, bytes=case.bytes, flops=case.flops)
            if impl is None:
                row["status"] = "not implemented"
                rows.append(row)
                continue
            if impl.supports is not None and not impl.supports(**case.kwargs):
                row["status"] = "declined"
                rows.append(row)
                continue
            kw = case.kwargs
            try:
                t = timer.time(lambda: impl.fn(**kw), reps=reps, graph=case.graphable)
                graphed = timer.last_graphed
                t_eager = timer.time(lambda: impl.fn(**kw), warmup=1, reps=max(3, reps // 2), graph=False)
            except Exception as e:  # noqa: BLE001
                row.update(status="error", detail=f"{type(e).__name__}: {e}")
                rows.append(row)
                log(f"{label} T={T}: {row['detail']}")
                continue
            ref = specs[case.op].reference
            t_ref = timer.time(lambda: ref(**kw), warmup=1, reps=max(3, reps // 4), max_seconds=1.0, graph=False)
            row.update(status="ok", us=t * 1e6, graphed=graphed, eager_us=t_eager * 1e6, ref_us=t_ref * 1e6,
                       speedup_ref=t_ref / t_eager,
                       GBps=case.bytes / t / 1e9, TFLOPs=case.flops / t / 1e12,
                       pct_copy=100 * case.bytes / t / 1e9 / ceil["copy_GBps"],
                       pct_mm=100 * case.flops / t / 1e12 / ceil["bf16_mm_TFLOPs"],
                       pct_fp8_mm=(100 * case.flops / t / 1e12 / ceil["fp8_mm_TFLOPs"]) if ceil.get("fp8_mm_TFLOPs") else None,
                       roofline_us=1e6 * max(case.bytes / (ceil["copy_GBps"] * 1e9),
                                             case.flops / (ceil["bf16_mm_TFLOPs"] * 1e12)))
            # accuracy spot check against the reference (bf16 outputs: expect ~1e-2 or better)
            want = ref(**kw)
            row["max_rel_err_vs_ref"] = _rel_err(impl.fn(**kw), want)
            if compile_ref:
                try:
                    if case.op not in compiled:
                        compiled[case.op] = torch.compile(ref, dynamic=True)
                    cf = compiled[case.op]
                    t0 = time.perf_counter()
                    cf(**kw)
                    timer.sync()
                    row["compile_s"] = time.perf_counter() - t0
                    t_c = timer.time(lambda: cf(**kw), reps=reps, graph=False)
                    row.update(compiled_us=t_c * 1e6, speedup_compiled=t_c / t_eager)
                except Exception as e:  # noqa: BLE001
                    row["compiled_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            log(_fmt_row(row))
            if peers:
                row["peers"] = _time_peers(peers, case, t, want, timer, reps, log)
            if partial_json:  # keep what was measured if the run is cut short
                with open(partial_json, "w") as f:
                    json.dump(dict(backend=backend, shapes=shapes, ceilings=ceil, rows=rows), f, indent=1)
            del kw, case
    return dict(backend=backend, device=device, shapes=shapes, flush=flush, tokens=list(tokens), ceilings=ceil,
                torch=torch.__version__, device_name=(torch.cuda.get_device_name(device)
                                                      if torch.device(device).type == "cuda" else "cpu"),
                rows=rows)


def _f(v, fmt):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _fmt_row(r):
    if r.get("status") != "ok":
        return f"{r['op']:22s} T={r['T']:<5d} {r.get('status')} {r.get('detail', '')}"
    return (f"{r['op']:22s} T={r['T']:<5d} {r['us']:9.1f} us  {r['GBps']:7.0f} GB/s ({r['pct_copy']:5.1f}% copy)  "
            f"{r['TFLOPs']:7.2f} TF/s ({r['pct_mm']:5.1f}% mm)  ref {r['ref_us']:9.1f} us x{r['speedup_ref']:.1f}  "
            f"compiled {_f(r.get('compiled_us'), '.1f')} us x{_f(r.get('speedup_compiled'), '.2f')}  "
            f"err {r['max_rel_err_vs_ref']:.1e}")


def markdown(result: dict) -> str:
    c = result["ceilings"]
    if torch.device(result.get("device") or "cpu").type == "cuda":
        timing = (f"cold L2 (256 MiB {'read' if result.get('flush') == 'read' else 'written'} before each "
                  f"call), median of CUDA-event times. `µs` = device time of a CUDA-graph replay of the call "
                  f"(eager where the op cannot be captured); `eager µs`, `reference µs` and `compiled ref µs` "
                  f"= the call launched from Python, host overhead included, and the × columns compare those "
                  f"eager times (like for like)")
    else:
        timing = ("median of host wall-clock times of each call launched from Python (no L2 flush, no "
                  "device graphs: `µs` and `eager µs` are two runs of the same eager timing)")
    lines = [f"Backend `{result['backend']}` on {result['device_name']} (torch {result['torch']}), shapes "
             f"`{result['shapes']}`, bf16 activations; {timing}. GB/s, TFLOP/s and % use `µs`. Ceilings measured "
             f"in the same run: copy **{c['copy_GBps'] / 1e3:.2f} TB/s**, bf16 matmul **{c['bf16_mm_TFLOPs']:.0f} "
             f"TFLOP/s**.", "",
             "| op | T | µs | eager µs | roofline µs | GB/s | % copy | TFLOP/s | % mm | reference µs | × ref | compiled ref µs | × compiled | max rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    peer_rows = []
    for r in result["rows"]:
        for name, p in (r.get("peers") or {}).items():
            peer_rows.append(f"| {r['op']} | {r['T']} | {name} | " + (
                f"{r['us']:.1f} | {p['us']:.1f} | {p['peer_over_ours']:.2f} | {p['max_rel_err_vs_ref']:.1e} |"
                if p["status"] == "ok" else f"{r['us']:.1f} | {p['status']} | | |"))
        if r.get("status") != "ok":
            lines.append(f"| {r['op']} | {r['T']} | {r.get('status')} | | | | | | | | | | | |")
            continue
        lines.append(f"| {r['op']} | {r['T']} | {r['us']:.1f} | {r['eager_us']:.1f} | {r['roofline_us']:.1f} | {r['GBps']:.0f} | "
                     f"{r['pct_copy']:.0f} | {r['TFLOPs']:.1f} | {r['pct_mm']:.1f} | {r['ref_us']:.1f} | "
                     f"{r['speedup_ref']:.1f} | {_f(r.get('compiled_us'), '.1f')} | "
                     f"{_f(r.get('speedup_compiled'), '.2f')} | {r['max_rel_err_vs_ref']:.1e} |")
    if peer_rows:
        same = ("same cold-L2 graph-replay timing" if torch.device(result.get("device") or "cpu").type == "cuda"
                else "same host wall-clock timing")
        lines += ["", f"Peers timed in the same run ({same}; ratio = peer µs / "
                      f"`{result['backend']}` µs, above 1 = ours faster):", "",
                  "| op | T | peer | ours µs | peer µs | peer / ours | peer max rel err |", "|---|---|---|---|---|---|---|",
                  *peer_rows]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", required=True, help="backend to time (e.g. cuda)")
    p.add_argument("--ops", default=",".join(DEFAULT_OPS),
                   help="comma list of ops (compress_pool = CSA variant, compress_pool_hca = HCA variant)")
    p.add_argument("--shapes", default="flash", choices=("flash", "pro", "small"),
                   help="the op dimensions: DSV4-Flash, DSV4-Pro, or the small test shapes (default: flash)")
    p.add_argument("--tokens", default="1,64,4096", help="comma list of token counts")
    p.add_argument("--json", default=None, help="write the full results as JSON here")
    p.add_argument("--markdown", default=None, help="write a markdown table here")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    p.add_argument("--reps", type=int, default=20,
                   help="timed calls per op and token count, after the warm-up; the median is reported (default: 20)")
    p.add_argument("--device", default=None, help="torch device (default: the backend's first device type)")
    p.add_argument("--compare", default="auto",
                   help="peers timed beside the backend: auto (every other available backend serving the "
                        "device, e.g. cuda-flashinfer beside cuda), none, or a comma list of backend names")
    p.add_argument("--progress", action="store_true",
                   help="progress lines on stderr also when it is not a terminal (a log: one line every 10 s); "
                        "on a terminal a status line is shown by default")
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    p.add_argument("--flush", default="write", choices=("write", "read"),
                   help="how L2 is made cold before each timed call: write (zero 256 MiB; leaves ~50 MB of "
                        "dirty lines that the timed call pays to write back) or read (sum it: clean lines)")


def run_args(args) -> int:
    if args.device is not None:
        from dsv4core.commands._util import check_device

        check_device(args.device)
    ops = [o for o in args.ops.split(",") if o]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    from dsv4core._progress import StatusLine

    status = StatusLine(not args.no_progress, lines=args.progress, every=10.0)

    def progress(i, n, op, T):
        status.update(f"bench: case {i}/{n}: {op} T={T} ({status.elapsed():.0f} s)", final=i == n)

    try:     # the rows as they are measured go to stderr; stdout gets the table once, at the end
        res = run_bench(args.backend, ops, args.shapes, tokens, device=args.device, compile_ref=not args.no_compile,
                        reps=args.reps, partial_json=(args.json + ".partial") if args.json else None,
                        compare=args.compare, flush=args.flush, log=status.log, progress=progress)
    finally:
        status.close()
    md = markdown(res)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    return 0 if all(r.get("status") in ("ok", "declined", "not implemented") for r in res["rows"]) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4core.bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
