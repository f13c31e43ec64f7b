"""moe_experts' split-K rule: how many K parts the gate / up (``Su``) and down (``Sd``) GEMMs of
one call take by default (TUNE "split"), and the row-tile arithmetic it and the CUDA plugin's sm90
tile function (plugins/cuda/dsv4core_cuda/launch.py) share.
Host-side only; moe.py reads it (``_splits`` applies TUNE's "Su" / "Sd" over it)."""
from __future__ import annotations

from ._util import cdiv


def row_tiles(P: int, E: int, BM: int) -> int:
    """Row tiles with work (about): one an expert while experts outnumber BM-row blocks."""
    return max(min(E, P), cdiv(P, BM))


def few_programs(tiles: int, I: int, programs: int) -> bool:
    """Whether the gate / up grid of 64-column N blocks fills under half the target programs (the
    shared expert: one expert for every token)."""
    return tiles * cdiv(I, 64) < programs // 2


#: the most split-K parts a launch takes (TUNE "Su" over H for the gate / up GEMM, "Sd" over I for
#: the down GEMM; the default: TUNE "split"). Parts are summed in a fixed order, so the result
#: does not depend on scheduling; they give decode batches (few row tiles) more programs than N
#: blocks do. The parts cost fp32 buffers of pairs x Su x 2 I and pairs x Sd x H: meant for decode.
MAX_SPLIT = 16
#: the decode batches (pairs = tokens x top-k) where FP4 "scaled" gate / up weights split K in two
#: by default: H200, Flash shapes, Su 2 against none at T = 1 / 2 / 4 / 8 / 16 (6-96 pairs):
#: 105 / 164 / 273 / 387 / 420 µs against 116-117 / 217-220 / 290-293 / 392-398 / 438-443
#: (benchmarks/results/h200/2026-12-02_62140f5/tune/moe_experts-split-k-rule-flash.json); at T = 32 (192 pairs) a tie, 625 against 623-633
#: (benchmarks/results/h200/2026-12-02_62140f5/tune/moe_experts-split-k-flash.json)
SPLIT_FP4_PAIRS = 96
#: TUNE "split", the default (Su, Sd) where "Su" / "Sd" are not set: "none" (the portable default:
#: no split K; the parts cost fp32 buffers and a reduction launch, and whether the extra programs
#: pay depends on the device's SM count and its decode chain) or "h200" (`_split_rule`, measured on
#: an H200 at Flash shapes; the CUDA plugin's sm90 table sets it)
SPLIT_RULES = ("none", "h200")


def _split_rule(P: int, E: int, H: int, I: int, cfg: tuple, programs: int, ieee: bool, scaled_up: bool) -> tuple:
    """(Su, Sd) of TUNE split "h200", 1 = no split. Two measured cases (H200, Flash shapes, the split-k and split-k-rule sweeps
    of benchmarks/tune_triton.py);
    everything else (bf16 or FP8 routed experts: within +-3 %, the noise; prefill) stays unsplit:
      * FP4 "scaled" gate / up weights at decode (<= SPLIT_FP4_PAIRS pairs): Su 2;
      * a grid that cannot fill the device even with 64-column N blocks (`few_programs`:
        the shared expert, one expert for every token) while the rows take the small-T tiles
        (BM <= 64): Su 2 and Sd 4, each kept while the split grid fits the target programs
        (36.0 / 48.5 / 49.8 -> 30.4 / 40.5 / 42.1 µs at T = 1 / 8 / 64; Su 4 + Sd 2 / 4 and Su 2 +
        Sd 2 are 0.6-2.5 µs slower, Sd 4 / 8 alone 1.0-6.0 µs; at T = 256, BM 128, every split loses: 73.7
        against 77-98).
    A part keeps at least 4 K steps. Not under the IEEE path (fp32 / the interpreter): untimed. Timed
    at Flash shapes only: at Pro's (H 7168) the same rule gives the shared expert Sd 2 (Sd 4 would
    exceed the target programs), not timed."""
    if ieee:
        return 1, 1
    BM, BNu, BNd, BK = cfg[:4]
    tiles = row_tiles(P, E, BM)
    Su = Sd = 1
    if few_programs(tiles, I, programs) and BM <= 64:
        Su = 2 if tiles * cdiv(I, BNu) * 2 <= programs else 1
        Sd = next((s for s in (4, 2) if tiles * cdiv(H, BNd) * s <= programs), 1)
    elif scaled_up and P <= SPLIT_FP4_PAIRS:
        Su = 2
    # at least 4 K steps a part (gate / up: K = H; down: K = I; a step is BK * KSUB columns, as in
    # _k_range: 128 with FP8 weights)
    step = BK * cfg[6]
    while Su > 1 and cdiv(H, step) < 4 * Su:
        Su //= 2
    while Sd > 1 and cdiv(I, step) < 4 * Sd:
        Sd //= 2
    return Su, Sd
