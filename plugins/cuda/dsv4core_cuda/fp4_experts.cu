// Grouped GEMM of packed FP4 (e2m1, one UE8M0 scale per 32 columns) expert weights against bf16
// activations, fp32 sums: the gate / up and down GEMMs of moe_experts at decode-sized batches.
//
//   out[r, n] = sum_k a[row(r), k] * W[e(r), n, k]      for every kept sorted pair row r
//
// W[e, n, k] = e2m1(code) * 2^(scale byte - 127), exact in bf16, and a's values (the official
// activations: FP8 values) exact in bf16, so every product is exact and only the fp32 summation
// order differs from the reference.
//
// Layout of the work (sm80+ mma.sync m16n8k16, bf16 operands, fp32 accumulators):
// * the weight rows are the MMA's M (16 rows a tile), the pair rows its N (8 a group, NG groups
//   a tile of BM = 8 NG rows, the same tiles as the Triton kernels' routing: tcum / starts);
// * a block is 4 warps over one 16-row tile, each warp a quarter of K; their sums are added in
//   warp order through shared memory (no atomics: the result does not depend on scheduling);
// * each lane reads its weights straight from global memory as 16-byte vectors in the
//   checkpoint's own layout: for a 128-column step, lane (g, t) reads 32 codes (one scale group)
//   of row g and of row g + 8. An MMA's 16 k positions need not be 16 adjacent columns: the
//   columns a lane holds are assigned to its fragment slots so that each bf16x2 register decodes
//   nibbles i and i + 4 of one 32-bit word with one shift (no shuffles), and the activation
//   fragment is permuted the same way (two byte permutes a register);
// * decode by bit placement: the 3 magnitude bits go to bf16 bits 6..8 and the sign to bit 15,
//   which is the code's value times 2^-126 (code 1, 0.5, becomes the subnormal 2^-127), then one
//   bf16x2 multiply by 2^(s - 1) (two, by 2^126 and 2^(s - 127), for s > 128; s = 255 is NaN).
//
// NG (compile-time) is the number of 8-row pair groups a tile holds; STAGES the depth of each
// warp's weight ring.

#ifndef NG
#define NG 2
#endif

typedef unsigned int u32;
typedef unsigned char u8;

__device__ __forceinline__ uint4 ldg16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

#ifndef STAGES
#define STAGES 4
#endif

__device__ __forceinline__ void cp16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}

__device__ __forceinline__ void cp4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;"
                 :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void wait_all_but() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// step st's 16-byte weight vectors of rows g and g + 8 and the 4 scale bytes of each row's step
// (one a lane of the quad) into this lane's ring slots
__device__ __forceinline__ void fetch(uint4 (&rw)[2][32], u32 (&rs)[2][32], const u8* w0, const u8* w1,
                                      const u8* s0, const u8* s1, int st, int lane) {
    cp16(&rw[0][lane], w0 + (st << 6));
    cp16(&rw[1][lane], w1 + (st << 6));
    cp4(&rs[0][lane], s0 + (st << 2));
    cp4(&rs[1][lane], s1 + (st << 2));
}

// this lane's 32 activation columns of step k0 (zeros for a pair column past the tile's pairs)
__device__ __forceinline__ void load_x(const unsigned short* row, int k0, u32 x[16]) {
    if (row != nullptr) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint4 c = ldg16(row + k0 + 8 * i);
            x[4 * i] = c.x; x[4 * i + 1] = c.y; x[4 * i + 2] = c.z; x[4 * i + 3] = c.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) x[i] = 0u;
    }
}

__device__ __forceinline__ u32 bmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// nibbles p and p + 4 of w (p = 0..3) as a bf16x2 of their values times 2^-126
__device__ __forceinline__ u32 place(u32 w, int p) {
    u32 m = p == 0 ? w << 6 : p == 1 ? w << 2 : p == 2 ? w >> 2 : w >> 6;
    u32 t = m & 0x03C003C0u;           // magnitude at bits 6..8 / 22..24, sign at 9 / 25
    u32 s = t & 0x02000200u;
    return t + s * 63u;                // the sign moved from bit 9 / 25 to bit 15 / 31
}

// the bf16x2 multiplier(s) of scale byte s: v * m1 * m2 is the weight (m2 = 1.0 for s <= 128)
__device__ __forceinline__ void multipliers(u32 s, u32& m1, u32& m2) {
    if (s <= 128u) {
        u32 b = (s + 126u) << 7;       // 2^(s - 1) = 2^126 * 2^(s - 127)
        m1 = b | (b << 16);
        m2 = 0x3F803F80u;              // 1.0
    } else {
        m1 = 0x7E807E80u;              // 2^126
        u32 b = (s << 7) | (s == 255u ? 0x40u : 0u);   // 2^(s - 127); byte 255: NaN
        m2 = b | (b << 16);
    }
}

__device__ __forceinline__ void decode16(uint4 v, u32 s, u32 out[16]) {
    u32 m1, m2;
    multipliers(s, m1, m2);
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    if (s <= 128u) {   // one multiply (every weight below 2 in magnitude has such a scale)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int p = 0; p < 4; ++p) out[4 * i + p] = bmul2(place(w[i], p), m1);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int p = 0; p < 4; ++p) out[4 * i + p] = bmul2(bmul2(place(w[i], p), m1), m2);
        }
    }
}

__device__ __forceinline__ void mma(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

extern "C" __global__ void __launch_bounds__(128)
fp4_expert_gemm(const u8* __restrict__ w,        // [E, R, K / 2]: byte j = columns 2j (low nibble), 2j + 1
                const u8* __restrict__ scale,    // [E, R, K / 32] UE8M0
                const unsigned short* __restrict__ a,   // bf16 [*, K]
                const int* __restrict__ rows,    // sorted pair row -> row of a (use_rows), else the row itself
                float* __restrict__ out,         // [P, R] fp32
                const int* __restrict__ tcum,    // [E] cumulative tile counts
                const int* __restrict__ starts,  // [E + 1] first sorted row of each expert
                int E, int R, int K, int use_rows) {
    const int BM = 8 * NG;
    // this block's (expert, pair tile): the first e with tcum[e] > j
    const int j = blockIdx.x;
    if (j >= tcum[E - 1]) return;
    int lo = 0, hi = E;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (tcum[mid] > j) hi = mid; else lo = mid + 1;
    }
    const int e = lo;
    const int t0 = e > 0 ? tcum[e - 1] : 0;
    const int r0 = starts[e] + (j - t0) * BM;
    const int cnt = min(BM, starts[e + 1] - r0);
    const int groups = (cnt + 7) >> 3;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int R0 = blockIdx.y * 16;
    const long long half = K >> 1, ngroups = K >> 5;
    const u8* w0 = w + ((long long)e * R + R0 + g) * half + 16 * t;
    const u8* w1 = w0 + 8 * half;
    const u8* s0 = scale + ((long long)e * R + R0 + g) * ngroups;   // the row's scale bytes
    const u8* s1 = s0 + 8 * ngroups;
    // the activation row of each of this lane's pair columns (column g of each group)
    const unsigned short* arow[NG];
#pragma unroll
    for (int q = 0; q < NG; ++q) {
        int pr = r0 + 8 * q + g;
        bool ok = 8 * q + g < cnt;
        int src = ok ? (use_rows ? rows[pr] : pr) : 0;
        arow[q] = ok ? a + (long long)src * K + 32 * t : nullptr;
    }

    float acc[NG][4];
#pragma unroll
    for (int q = 0; q < NG; ++q)
        acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.f;

    const int steps = K >> 7;
    const int per = (steps + 3) >> 2;
    const int st_lo = warp * per, st_hi = min(steps, st_lo + per);
    // the warp's weight vectors and scale words stream through a STAGES-deep ring of shared memory
    // (cp.async: each lane copies and later reads only its own slots, so no barrier is needed)
    __shared__ uint4 ring_w[4][STAGES][2][32];
    __shared__ u32 ring_s[4][STAGES][2][32];
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (st_lo + i < st_hi) fetch(ring_w[warp][i], ring_s[warp][i], w0, w1, s0, s1, st_lo + i, lane);
        commit();
    }
    for (int st = st_lo; st < st_hi; ++st) {
        const int k0 = st << 7;
        const int slot = (st - st_lo) % STAGES;
        {
            const int nxt = st + STAGES - 1, ns = (nxt - st_lo) % STAGES;
            if (nxt < st_hi) fetch(ring_w[warp][ns], ring_s[warp][ns], w0, w1, s0, s1, nxt, lane);
            commit();
        }
        // the first group's activations are requested before waiting for the weights
        u32 x0[16];
        load_x(arow[0], k0, x0);
        wait_all_but<STAGES - 1>();
        const uint4 v0 = ring_w[warp][slot][0][lane], v1 = ring_w[warp][slot][1][lane];
        const u32 sc0 = (ring_s[warp][slot][0][lane] >> (8 * t)) & 0xFFu;
        const u32 sc1 = (ring_s[warp][slot][1][lane] >> (8 * t)) & 0xFFu;
        u32 A0[16], A1[16];
        decode16(v0, sc0, A0);
        decode16(v1, sc1, A1);
#pragma unroll
        for (int q = 0; q < NG; ++q) {
            if (q >= groups) break;
            u32 x[16];
            if (q == 0) {
#pragma unroll
                for (int i = 0; i < 16; ++i) x[i] = x0[i];
            } else {
                load_x(arow[q], k0, x);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                // word i: columns 8i .. 8i + 7 of this lane's 32; x[4i + c] holds columns 2c, 2c + 1
                const u32 q0 = x[4 * i], q1 = x[4 * i + 1], q2 = x[4 * i + 2], q3 = x[4 * i + 3];
                // MMA 2i: slots (2t, 2t + 1) <- columns (0, 4), slots (2t + 8, 2t + 9) <- columns (1, 5)
                mma(acc[q], A0[4 * i], A1[4 * i], A0[4 * i + 1], A1[4 * i + 1],
                    __byte_perm(q0, q2, 0x5410), __byte_perm(q0, q2, 0x7632));
                // MMA 2i + 1: columns (2, 6) and (3, 7)
                mma(acc[q], A0[4 * i + 2], A1[4 * i + 2], A0[4 * i + 3], A1[4 * i + 3],
                    __byte_perm(q1, q3, 0x5410), __byte_perm(q1, q3, 0x7632));
            }
        }
    }

    __shared__ float red[4][NG][4][32];
#pragma unroll
    for (int q = 0; q < NG; ++q) {
#pragma unroll
        for (int c = 0; c < 4; ++c) red[warp][q][c][lane] = acc[q][c];
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int q = 0; q < NG; ++q) {
        if (q >= groups) break;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float v = red[0][q][c][lane];
            v += red[1][q][c][lane];
            v += red[2][q][c][lane];
            v += red[3][q][c][lane];
            const int col = 8 * q + 2 * t + (c & 1);   // pair column within the tile
            const int row = R0 + g + (c >= 2 ? 8 : 0);
            if (col < cnt) out[(long long)(r0 + col) * R + row] = v;
        }
    }
}
