"""The Triton kernels of the HAL 1.1 pool ops (cache_store, compress_windows, indexer_scores_rows)
beyond their conformance cases (tests/interpret/test_triton_kernels.py runs those for every kernel):

* run by the Triton interpreter on shapes the cases do not reach (tile edges: a partial last block
  of keys, slots and channels, heads padded to the dot's minimum, several channel chunks), on
  strided views, against fp64 formulas with error bounds derived below;
* cache_store writes the destination rows and nothing else, judged on the whole buffer the pool
  is a view of, with fp32 -> bf16 round-to-nearest-even ties;
* the launchers are capturable: run on meta tensors (which hold no data, so any host read of
  device data, any data-dependent shape raises) with the kernel launches recorded, not run.

Interpreter checks run in one subprocess (TRITON_INTERPRET must be set before triton is imported).
"""
from __future__ import annotations


import pytest
import torch
from launch_recorder import Recorder
from _interp import interpreted_report

pytest.importorskip("triton")

#: unit roundoff of fp32 (round to nearest): every fp32 operation errs by at most U relatively
U = 2.0 ** -24

_SCRIPT = r"""
import json, struct, sys
import torch
from dsv4core.kernels.triton import cache, compress, indexer

g = torch.Generator().manual_seed(0)
out = {}

def strided(t):                         # same values, a non-contiguous view with a storage offset
    buf = torch.zeros((*t.shape[:-1], 2 * t.shape[-1] + 3), dtype=t.dtype)
    v = buf[..., 3::2]
    v.copy_(t)
    return v

# ---- cache_store: the whole buffer behind a strided pool view, -1 skips, RNE ties
for pool_dt, rows_dt in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float32)):
    D = 33
    big = torch.randn(40, 70, generator=g).to(pool_dt)
    pool = big[4:36, 3:3 + D]                                  # rows 32 of a larger buffer, row stride 70
    rows = torch.randn(9, D, generator=g) * 3
    # fp32 values exactly halfway between two bf16 values (low 16 bits 0x8000), odd and even bf16 lsb
    ties = [struct.unpack("<f", struct.pack("<I", b))[0] for b in (0x3F808000, 0x3F818000, 0xBF808000, 0x40498000)]
    rows[0, :4] = torch.tensor(ties)
    rows = strided(rows.to(rows_dt))
    idx_buf = torch.tensor([5, 0, -1, 0, 31, 0, 17, 0, -1, 0, 0, 0, 9, 0, -1, 0, 2, 0], dtype=torch.int32)
    index = idx_buf[::2]                                       # non-contiguous int32 destinations
    want = big.clone()
    keep = index >= 0
    want[4:36, 3:3 + D][index[keep].long()] = rows[keep].to(pool_dt)
    ret = cache.cache_store(pool, index, rows)
    same = torch.equal(big.view(torch.uint8), want.view(torch.uint8))
    diff = (big.float() != want.float()).nonzero().tolist()[:5]
    out[f"cache_store/{pool_dt}/{rows_dt}"] = dict(returned_none=ret is None, bitwise=bool(same), first_diffs=diff)

# ---- compress_windows: err vs fp64 and a per-(entry, channel) bound's ingredients
def windows_case(name, E, S, DP, overlap, mask):
    CW = 2 * DP if overlap else DP
    kv = torch.randn(E, S, CW, generator=g) * 4
    sc = torch.randn(E, S, CW, generator=g) * 2
    mask(sc)
    got = compress.compress_windows(strided(kv), strided(sc), overlap)
    k64, s64 = kv.double(), sc.double()
    if overlap:
        m = S // 2
        k64 = torch.cat((k64[:, :m, :DP], k64[:, m:, DP:]), 1)
        s64 = torch.cat((s64[:, :m, :DP], s64[:, m:, DP:]), 1)
    live = s64 > float("-inf")
    mx = torch.where(live, s64, float("-inf")).amax(1)
    safe = torch.where(torch.isfinite(mx), mx, 0.0)
    p = torch.where(live, torch.exp(s64 - safe[:, None]), 0.0)
    den = p.sum(1)
    exact = torch.where(den > 0, (p * k64).sum(1) / den.clamp_min(1e-300), 0.0)
    spread = torch.where(live, safe[:, None] - s64, 0.0).amax(1)           # max over slots of mx - s
    vmax = torch.where(live, k64.abs(), 0.0).amax(1)
    out[name] = dict(err=(got.double() - exact).abs().tolist(), spread=spread.tolist(), vmax=vmax.tolist(),
                     S=S, dead=(den == 0).tolist(), got_dead=got[den == 0].tolist(), shape=list(got.shape))

def first_window_and_dead_channel(sc):
    DP = sc.shape[2] // 2
    sc[0, :3] = float("-inf")                        # entry 0: no previous window
    sc[1, :3, 5] = float("-inf")                     # entry 1, channel 5: A and B slots all masked
    sc[1, 3:, 5 + DP] = float("-inf")
    sc[2, 1:5, 7:9] = float("-inf")

def hca_mask(sc):
    sc[1, :, 3] = float("-inf")                      # one channel of entry 1 fully masked
    sc[2, :4] = float("-inf")

windows_case("compress_windows/csa-S6-DP20", 3, 6, 20, True, first_window_and_dead_channel)
windows_case("compress_windows/hca-S5-DP600", 4, 5, 600, False, hca_mask)   # two channel blocks, the last partial

# ---- indexer_scores_rows: err vs fp64 and the bound's magnitude sum_h |w_h| sum_d |q_hd k_d|
for dt in (torch.float32, torch.bfloat16):
    T, nI, dI, N, L = 3, 5, 80, 50, 37
    q = strided(torch.randn(T, nI, dI, generator=g).to(dt))
    kbuf = torch.randn(N + 2, dI + 9, generator=g).to(dt)
    k = kbuf[2:, 3:3 + dI]                                     # a key pool inside a larger buffer
    w = strided(torch.randn(T, nI, generator=g) * nI ** -0.5)
    rows = torch.randint(0, N, (T, L), generator=g).to(torch.int32)
    rows[0, ::3] = -1
    rows[2] = -1                                               # a query with no keys
    got = indexer.indexer_scores_rows(q, k, w, rows, 0.3)
    q64, k64, w64 = q.double(), k.double(), w.double()
    kr = k64[rows.long().clamp_min(0)]                          # [T, L, dI]
    dots = torch.einsum("thd,tld->thl", q64, kr)
    exact = 0.3 * torch.einsum("th,thl->tl", w64, dots.clamp_min(0))
    mag = 0.3 * torch.einsum("th,thl->tl", w64.abs(), torch.einsum("thd,tld->thl", q64.abs(), kr.abs()))
    valid = rows >= 0
    out[f"indexer_scores_rows/{dt}"] = dict(
        err=torch.where(valid, (got.double() - exact).abs(), 0.0).tolist(), mag=mag.tolist(), n=dI + nI + 2,
        masked_ok=bool((got[~valid] == float("-inf")).all()), valid_finite=bool(torch.isfinite(got[valid]).all()),
        shape=list(got.shape))

# ---- paged pools (HAL 1.4): blocks whose stride is not a multiple of the row stride, other bytes between
from dsv4core.hal import rowformats
from dsv4core.kernels.triton import attention
def paged(buf, B, J, W, rs, bs, off):
    return torch.as_strided(buf, (B, J, W), (bs, rs, 1), off)
for fmt, W, D in ((None, 64, 64), ("fp8", rowformats.row_bytes("fp8", 128), 128)):
    dt = torch.bfloat16 if fmt is None else torch.uint8
    B, J, rs = 5, 3, W + 2
    bs = J * rs + 7                                            # 7: not a multiple of the row stride
    buf = (torch.randn(11 + B * bs, generator=g).to(dt) if fmt is None
           else torch.randint(0, 256, (11 + B * bs,), generator=g, dtype=torch.uint8))
    pool = paged(buf, B, J, W, rs, bs, 11)
    rows = torch.randn(6, D, generator=g) * 3
    index = torch.tensor([14, -1, 0, 4, 8, 13], dtype=torch.int64)
    want = buf.clone()
    wv = paged(want, B, J, W, rs, bs, 11)
    keep = index >= 0
    vals = rows.to(dt) if fmt is None else rowformats.pack("fp8", rows)
    for i in keep.nonzero().flatten().tolist():
        wv[index[i] // J, index[i] % J] = vals[i]
    extra = {} if fmt is None else dict(row_format=fmt)
    cache.cache_store(pool, index, rows, paged=True, **extra)
    out[f"paged/cache_store/{fmt}"] = dict(bitwise=bool(torch.equal(buf.view(torch.uint8), want.view(torch.uint8))))
    # the reads: the same rows as a flat pool give the same bits (one kernel, one arithmetic order)
    flat = pool.reshape(B * J, W).contiguous()
    idx = torch.tensor([[14, 0, 3, -1, 7], [1, 2, -1, -1, 9]], dtype=torch.int32)
    if fmt is None:
        q = torch.randn(2, 4, D, generator=g).to(torch.bfloat16)
        sink = torch.randn(4, generator=g)
        a_p = attention.sparse_mqa_attention(q, pool, idx, sink, 0.1, kv_paged=True)
        a_f = attention.sparse_mqa_attention(q, flat, idx, sink, 0.1)
        qi = torch.randn(2, 4, D, generator=g).to(torch.bfloat16)
        wi = torch.randn(2, 4, generator=g)
        s_p = indexer.indexer_scores_rows(qi, pool, wi, idx, 0.3, k_paged=True)
        s_f = indexer.indexer_scores_rows(qi, flat, wi, idx, 0.3)
        out["paged/indexer/None"] = dict(bitwise=bool(torch.equal(s_p, s_f)))
    else:
        q = torch.randn(2, 4, D, generator=g).to(torch.bfloat16)
        sink = torch.randn(4, generator=g)
        a_p = attention.sparse_mqa_attention(q, pool, idx, sink, 0.1, kv_format="fp8", kv_paged=True)
        a_f = attention.sparse_mqa_attention(q, flat, idx, sink, 0.1, kv_format="fp8")
    out[f"paged/attention/{fmt}"] = dict(bitwise=bool(torch.equal(a_p.view(torch.uint8), a_f.view(torch.uint8))))

json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return interpreted_report(_SCRIPT, tmp_path_factory.mktemp("pool_kernels"), "out")


@pytest.mark.parametrize("dtypes", ["torch.bfloat16/torch.float32", "torch.float32/torch.bfloat16",
                                    "torch.float32/torch.float32"])
def test_cache_store_writes_only_the_destination_rows_bitwise(results, dtypes):
    r = results[f"cache_store/{dtypes}"]
    assert r["returned_none"]
    # the whole buffer the pool is a view of: destination rows hold rows[i] rounded once (RNE,
    # the ties included), skipped rows (-1), other pool rows and the bytes outside the view keep theirs
    assert r["bitwise"], r["first_diffs"]


@pytest.mark.parametrize("what", ["cache_store/None", "cache_store/fp8", "attention/None", "attention/fp8",
                                  "indexer/None"])
def test_paged_pools_write_only_their_rows_and_read_as_flat_rows(results, what):
    # cache_store: the whole buffer behind a paged pool (block stride not a multiple of the row
    # stride) holds the destination rows and keeps every other byte; the reads of a paged pool are
    # bitwise those of the same rows as a flat pool (the kernels differ only in the row address)
    assert results[f"paged/{what}"]["bitwise"]


@pytest.mark.parametrize("case", ["csa-S6-DP20", "hca-S5-DP600"])
def test_compress_windows_edges_within_derived_bound(results, case):
    r = results[f"compress_windows/{case}"]
    # Bound per (entry, channel), from fp32 rounding with unit roundoff U: each weight
    # p_i = exp(s_i - mx) errs relatively by <= (|s_i - mx| + 2) U (the subtraction's rounding,
    # amplified by exp, plus exp's own <= 1 ulp); perturbing the weights of a weighted average by a
    # relative delta moves it by <= 2 delta max|v|; the S-term sums of p*v and p and the products
    # and division add <= (2S + 2) U max|v|. Total: (2 (spread + 2) + 2S + 2) U max|v|, where
    # spread = max_i (mx - s_i) over the live slots.
    S = r["S"]
    for e, (errs, spreads, vmaxes) in enumerate(zip(r["err"], r["spread"], r["vmax"])):
        for ch, (err, spread, vmax) in enumerate(zip(errs, spreads, vmaxes)):
            bound = (2 * (spread + 2) + 2 * S + 2) * U * vmax
            assert err <= bound, f"entry {e} channel {ch}: |err| {err:.3g} > bound {bound:.3g}"
    assert any(any(d) for d in r["dead"]), "the case has no fully masked channel"
    assert all(v == 0.0 for v in r["got_dead"]), r["got_dead"]          # all-masked channels pool to 0


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_indexer_scores_rows_edges_within_derived_bound(results, dtype):
    r = results[f"indexer_scores_rows/{dtype}"]
    assert r["shape"] == [3, 37] and r["masked_ok"] and r["valid_finite"]
    # Standard forward-error bound of n-term fp32 sums (gamma_n = n U / (1 - n U)): the dI-term dot
    # (bf16 and fp32 inputs are exact in fp32), ReLU (1-Lipschitz), the weight products and the
    # nI-term sum, the scale: |err| <= gamma_{dI + nI + 2} * scale * sum_h |w_h| sum_d |q_hd k_d|.
    n = r["n"]
    gamma = n * U / (1 - n * U)
    for t, (errs, mags) in enumerate(zip(r["err"], r["mag"])):
        for w, (err, mag) in enumerate(zip(errs, mags)):
            assert err <= gamma * mag, f"query {t} slot {w}: |err| {err:.3g} > bound {gamma * mag:.3g}"


# ---- capture safety: the launchers on meta tensors, kernel launches recorded --------------------

def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("op", ["cache_store", "compress_windows", "indexer_scores_rows"])
def test_launchers_read_no_device_data(monkeypatch, op):
    """Meta tensors have shapes and no data: ``.item()``, ``bool()``, ``.tolist()``, ``nonzero`` and
    masked indexing raise on them, so a launcher that reads device data back to the host (which a
    device graph cannot record) or sizes anything from data fails here. The launch must be made
    with a grid of plain ints and the caller's own tensors (no staging copy of the pool)."""
    from dsv4core.kernels.triton import cache, compress, indexer

    rec = Recorder()
    if op == "cache_store":
        monkeypatch.setattr(cache, "_cache_store_kernel", rec)
        pool, index, rows = _meta(64, 48, dtype=torch.bfloat16), _meta(7, dtype=torch.int64), _meta(7, 48)
        assert cache.cache_store(pool, index, rows) is None
        (grid, args, _), = rec.launches
        assert args[0] is pool and args[1] is index and args[2] is rows
    elif op == "compress_windows":
        monkeypatch.setattr(compress, "_compress_windows_kernel", rec)
        kv, score = _meta(5, 8, 64), _meta(5, 8, 64)
        out = compress.compress_windows(kv, score, True)
        assert out.shape == (5, 32) and out.dtype == torch.float32
        (grid, args, _), = rec.launches
        assert args[0] is kv and args[1] is score
    else:
        monkeypatch.setattr(indexer, "_indexer_scores_rows_kernel", rec)
        q, k, w, rows = _meta(6, 4, 64, dtype=torch.bfloat16), _meta(40, 64, dtype=torch.bfloat16), _meta(6, 4), \
            _meta(6, 24, dtype=torch.int32)
        out = indexer.indexer_scores_rows(q, k, w, rows, 0.125)
        assert out.shape == (6, 24) and out.dtype == torch.float32
        (grid, args, _), = rec.launches
        assert all(a is b for a, b in zip(args[:4], (q, k, w, rows)))


def test_predicates_decline_what_the_kernels_do_not_run():
    from dsv4core.hal import Backend
    from dsv4core.kernels.triton.registry import register_ops

    b = Backend(name="t", device_types=("cpu",))
    register_ops(b, "cpu", ops={"cache_store", "compress_windows", "indexer_scores_rows"})
    store, win, idx = (b.impls[o].supports for o in ("cache_store", "compress_windows", "indexer_scores_rows"))
    pool, index = torch.zeros(8, 4), torch.zeros(3, dtype=torch.int64)
    assert store(pool, index, torch.zeros(3, 4))
    assert not store(pool.double(), index, torch.zeros(3, 4))                  # fp64: the reference
    assert not store(pool, index.float(), torch.zeros(3, 4))                   # float indices
    assert not store(pool, index, torch.zeros(3, 5))                           # width mismatch
    assert win(torch.zeros(2, 8, 6), torch.zeros(2, 8, 6), True)
    assert not win(torch.zeros(2, 8, 6).bfloat16(), torch.zeros(2, 8, 6), False)  # fp32 only (the spec)
    assert not win(torch.zeros(2, 7, 6), torch.zeros(2, 7, 6), True)          # odd slot count with overlap
    q, k, w, rows = torch.zeros(2, 4, 16), torch.zeros(9, 16), torch.zeros(2, 4), torch.zeros(2, 5, dtype=torch.int32)
    assert idx(q, k, w, rows, 0.1)
    assert not idx(q, k.bfloat16(), w, rows, 0.1)                              # k's dtype must be q's
    assert not idx(torch.zeros(2, 200, 16), k, torch.zeros(2, 200), rows, 0.1)  # > 128 heads
    assert store(None, None, None) is False                                   # predicates never raise


@pytest.mark.parametrize("op", ["cache_store", "indexer_scores_rows"])
def test_paged_launchers_read_no_device_data(monkeypatch, op):
    """The paged pools (HAL 1.4) on meta tensors: the row offsets are computed on the device (no
    host read), the kernel gets the pool itself (no copy) and U-element rows (8 here: the strides'
    power-of-two alignment). (sparse_mqa_attention's launcher asks the device for its program
    count, which a meta tensor has not; its paged offsets are the same function.)"""
    from dsv4core.kernels.triton import cache, indexer

    rec = Recorder()
    buf = _meta(16 + 5 * (4 * 72 + 8), dtype=torch.bfloat16)
    pool = torch.as_strided(buf, (5, 4, 64), (4 * 72 + 8, 72, 1), 16)     # block stride 296: not 72 k
    if op == "cache_store":
        monkeypatch.setattr(cache, "_cache_store_kernel", rec)
        assert cache.cache_store(pool, _meta(7, dtype=torch.int64), _meta(7, 64), paged=True) is None
        (grid, args, _), = rec.launches
        assert args[0] is pool and args[1].dtype == torch.int64 and args[6] == 8
    else:
        monkeypatch.setattr(indexer, "_indexer_scores_rows_kernel", rec)
        q, w, rows = _meta(6, 4, 64, dtype=torch.bfloat16), _meta(6, 4), _meta(6, 24, dtype=torch.int32)
        out = indexer.indexer_scores_rows(q, pool, w, rows, 0.125, k_paged=True)
        assert out.shape == (6, 24)
        (grid, args, _), = rec.launches
        assert args[1] is pool and args[3].shape == (6, 24) and args[3].dtype == torch.int64
