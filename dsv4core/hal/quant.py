"""FP8 (e4m3, 128x128 block scales) and FP4 (e2m1, 1x32 UE8M0 scales) formats.

Dequantisation is always done in float32 and cast once to the requested dtype:

* FP8: ``W[i, j] = float(Wq[i, j]) * S[i // 128, j // 128]``; the scale grid is
  ``[ceil(N/128), ceil(K/128)]`` (over the last two dims; leading dims are batch dims).
* FP4: bytes ``[N, K/2]`` hold two e2m1 codes, element ``2k`` in the low nibble and ``2k+1`` in the
  high nibble; ``W[i, j] = TABLE[code] * S[i, j // 32]`` with ``S`` UE8M0 (``2**(byte-127)``).

Scales may be ``float8_e8m0fnu``, raw ``uint8`` UE8M0 bytes, or float32 multipliers. Both
products are exact in float32 (an e4m3 / e2m1 value times a power of two; for float32 scales one
rounding at most), so the dequantised value only rounds once, in the final cast.

The quantisers (``quantize_fp8_block``, ``quantize_fp4``) are the inverse used to write official
checkpoints (tests, tools); they round to nearest (ties to even) in the target format.
"""

from __future__ import annotations

import math

import torch

FP8_BLOCK = 128
FP4_GROUP = 32
FP8_MAX = 448.0
FP4_MAX = 6.0

#: e2m1 code -> value (bit 3 = sign, bits 0-2 = magnitude index)
FP4_E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_FP4_DTYPE = getattr(torch, "float4_e2m1fn_x2", None)
#: the FP8 weight dtype (e4m3, 128x128 block-scaled)
FP8_E4M3 = torch.float8_e4m3fn
#: the UE8M0 scale dtype (None on a torch without it: scales are then raw uint8 bytes)
E8M0 = getattr(torch, "float8_e8m0fnu", None)
#: a UE8M0 byte b encodes 2**(b - E8M0_BIAS) (255 is NaN)
E8M0_BIAS = 127

#: byte dtypes that hold packed FP4 e2m1 pairs in checkpoints (two codes a byte)
FP4_BYTE_DTYPES = (torch.int8, torch.uint8)
#: dtypes that can hold packed FP4 e2m1 pairs
FP4_PACKED_DTYPES = FP4_BYTE_DTYPES + tuple(d for d in (_FP4_DTYPE,) if d is not None)
#: 8-bit float weight dtypes (block-scaled)
FP8_DTYPES = tuple(d for d in (FP8_E4M3, getattr(torch, "float8_e5m2", None)) if d is not None)
#: dtypes a scale tensor may have
SCALE_DTYPES = tuple(d for d in (E8M0, torch.uint8, torch.float32, torch.bfloat16, torch.float16) if d is not None)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def is_fp4_packed(dtype: torch.dtype) -> bool:
    return dtype in FP4_PACKED_DTYPES


_LUT_CACHE: dict = {}


def _lut(kind: str, device: torch.device) -> torch.Tensor:
    """Cached 256-entry tables: "e8m0" byte -> 2**(b-127) (255 -> NaN); "fp4" byte -> (low, high)."""
    key = (kind, device)
    t = _LUT_CACHE.get(key)
    if t is None:
        byte = torch.arange(256, dtype=torch.int32)
        if kind == "e8m0":
            # built from the float32 bit pattern: exact; 2^-127 is a float32 subnormal
            bits = torch.where(byte == 0, torch.full_like(byte, 1 << 22), byte << 23)
            t = torch.where(byte == 255, torch.tensor(float("nan")), bits.view(torch.float32))
        else:
            table = torch.tensor(FP4_E2M1_TABLE, dtype=torch.float32)
            t = torch.stack([table[byte & 0xF], table[byte >> 4]], dim=-1)
        t = t.to(device)
        _LUT_CACHE[key] = t
    return t


def _e8m0_bytes_to_float32(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte -> 2**(b-127) exactly (255 -> NaN)."""
    return _lut("e8m0", b.device)[b.long()]


def scale_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """Dequantisation multipliers as float32 (UE8M0 bytes -> 2**(b-127))."""
    if scale.dtype == torch.uint8:
        return _e8m0_bytes_to_float32(scale)
    if E8M0 is not None and scale.dtype == E8M0:
        return _e8m0_bytes_to_float32(scale.view(torch.uint8))
    return scale.to(torch.float32)


def _expand(scale: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    s = scale
    if br != 1:
        s = s.repeat_interleave(br, dim=-2)
    if bc != 1:
        s = s.repeat_interleave(bc, dim=-1)
    return s[..., :rows, :cols]


def fp8_scale_shape(shape: tuple[int, ...], block: int = FP8_BLOCK) -> tuple[int, ...]:
    *lead, n, k = shape
    return (*lead, math.ceil(n / block), math.ceil(k / block))


def fp4_unpacked_shape(packed_shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*packed_shape[:-1], packed_shape[-1] * 2)


def fp4_scale_shape(unpacked_shape: tuple[int, ...], group: int = FP4_GROUP) -> tuple[int, ...]:
    return (*unpacked_shape[:-1], math.ceil(unpacked_shape[-1] / group))


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                   block: int = FP8_BLOCK) -> torch.Tensor:
    """Block-scaled FP8 -> ``dtype`` (fp32 math). ``scale`` is ``[..., ceil(N/b), ceil(K/b)]``."""
    if weight.dim() < 2:
        raise ValueError(f"FP8 weight must have >= 2 dims, got shape {tuple(weight.shape)}")
    expect = fp8_scale_shape(tuple(weight.shape), block)
    if tuple(scale.shape) != expect:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
                         f"with {block}x{block} blocks (expected {expect})")
    rows, cols = weight.shape[-2:]
    s32 = scale_to_float32(scale)
    w32 = weight.to(torch.float32)
    if rows % block == 0 and cols % block == 0:  # broadcast per block (no expanded copy of the scales)
        lead = weight.shape[:-2]
        out = w32.view(*lead, rows // block, block, cols // block, block) * s32.view(
            *lead, rows // block, 1, cols // block, 1)
        return out.view(weight.shape).to(dtype)
    return (w32 * _expand(s32, rows, cols, block, block)).to(dtype)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` packed e2m1 (low nibble first) -> float32 ``[..., K]`` code values."""
    u8 = packed.contiguous().view(torch.uint8)
    pairs = _lut("fp4", packed.device)  # [256, 2]: (low nibble value, high nibble value)
    return pairs[u8.long()].reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                   group: int = FP4_GROUP) -> torch.Tensor:
    """Packed FP4 e2m1 ``[..., N, K/2]`` with UE8M0 scales ``[..., N, K/group]`` -> ``dtype``."""
    full = fp4_unpacked_shape(tuple(packed.shape))
    expect = fp4_scale_shape(full, group)
    if tuple(scale.shape) != expect:
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not match packed weight "
                         f"{tuple(packed.shape)} (unpacked {full}, one scale per {group}: expected {expect})")
    vals = unpack_fp4(packed)
    s = scale_to_float32(scale)
    if full[-1] % group == 0:  # broadcast per group (no expanded copy of the scales)
        out = vals.view(*full[:-1], full[-1] // group, group) * s.unsqueeze(-1)
        return out.view(full).to(dtype)
    s = s.repeat_interleave(group, dim=-1)[..., : full[-1]]
    return (vals * s).to(dtype)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dispatch on the weight dtype: FP8 block-scaled or packed FP4."""
    if is_fp8(weight.dtype):
        return dequantize_fp8(weight, scale, dtype)
    if is_fp4_packed(weight.dtype):
        return dequantize_fp4(weight, scale, dtype)
    raise ValueError(f"weight dtype {weight.dtype} is not a quantised format (expected FP8 e4m3 or packed FP4)")


# ----------------------------------------------------------------------------------------------
# quantisers (writers)
# ----------------------------------------------------------------------------------------------

def _pow2_scale_for(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax (UE8M0-representable); 1 for all-zero blocks."""
    amax = amax.to(torch.float32)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    e = torch.ceil(torch.log2(safe / qmax))
    s = torch.exp2(e)
    # guard against log2 rounding: make sure amax / s <= qmax
    s = torch.where(safe / s > qmax, s * 2, s)
    return torch.where(amax > 0, s, torch.ones_like(s)).clamp(min=2.0 ** -127, max=2.0 ** 127)


def encode_scale(s: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    if scale_dtype == torch.float32:
        return s.to(torch.float32)
    if scale_dtype in (E8M0, torch.uint8):
        b = (torch.round(torch.log2(s)) + E8M0_BIAS).clamp(0, 2 * E8M0_BIAS).to(torch.uint8)
        return b if scale_dtype == torch.uint8 else b.view(E8M0)
    raise ValueError(f"unsupported scale dtype {scale_dtype}")


def quantize_fp8_block(w: torch.Tensor, scale_dtype: torch.dtype | None = None, block: int = FP8_BLOCK,
                       pow2: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> (``float8_e4m3fn`` weight, scale ``[..., ceil(N/b), ceil(K/b)]``).

    With an e8m0 scale dtype the scale is a power of two (amax/s <= 448); with float32 scales it is
    ``amax / 448`` unless ``pow2=True``.
    """
    scale_dtype = E8M0 if scale_dtype is None else scale_dtype
    if pow2 is None:
        pow2 = scale_dtype != torch.float32
    w32 = w.detach().to(torch.float32)
    *lead, n, k = w32.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    pad = torch.zeros(*lead, nb * block, kb * block, dtype=torch.float32, device=w32.device)
    pad[..., :n, :k] = w32
    blocks = pad.reshape(*lead, nb, block, kb, block)
    amax = blocks.abs().amax(dim=(-1, -3))
    if pow2:
        s = _pow2_scale_for(amax, FP8_MAX)
    else:
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    s_enc = encode_scale(s, scale_dtype)
    s_used = scale_to_float32(s_enc)
    full = _expand(s_used, n, k, block, block)
    q = (w32 / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s_enc


_FP4_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already within [-6, 6]) to the nearest e2m1 code (ties to the even
    magnitude index, i.e. round-half-to-even on the 1-bit mantissa)."""
    a = x.abs()
    mids = _FP4_MIDS.to(x.device)
    idx = torch.bucketize(a, mids)  # a == mids[i] lands on index i (the lower neighbour)
    tie = (idx < 7) & (a == mids[idx.clamp(max=6)])
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)
    sign = torch.signbit(x)
    return (idx | (sign.to(idx.dtype) << 3)).to(torch.uint8)


def quantize_fp4(w: torch.Tensor, group: int = FP4_GROUP, scale_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` (K even, multiple of ``group``) -> (int8 ``[..., N, K/2]``, UE8M0 ``[..., N, K/group]``)."""
    scale_dtype = E8M0 if scale_dtype is None else scale_dtype
    w32 = w.detach().to(torch.float32)
    *lead, n, k = w32.shape
    if k % group or k % 2:
        raise ValueError(f"FP4 quantisation needs K divisible by {group}, got {k}")
    g = w32.reshape(*lead, n, k // group, group)
    s = _pow2_scale_for(g.abs().amax(dim=-1), FP4_MAX)
    s_enc = encode_scale(s, scale_dtype)
    s_used = scale_to_float32(s_enc)
    codes = _fp4_codes((g / s_used.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)).reshape(*lead, n, k)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, s_enc


# ----------------------------------------------------------------------------------------------
# the official activation quantisation rules (DeepSeek-V4's quantisation-aware inference)
# ----------------------------------------------------------------------------------------------
#
# Both rules work per row and per group of ``block`` consecutive values of the last dimension:
#
# * FP8 (``act_quant``): ``amax = max(max|x|, 1e-4)``; ``s = 2^ceil(log2(fl(amax * fl(1/448))))``
#   (a power of two; the product is rounded to float32 first, then ceil(log2) is read off its bits:
#   the exponent, plus one when any mantissa bit is set); ``q = e4m3(clamp(x / s, -448, 448))``,
#   rounded to nearest, ties to even. ``s`` is the dequantisation multiplier: ``x ~ q * s``.
# * FP4 (``fake_quant(x, "fp4")``): the same with ``amax`` clamped to >= 6 * 2^-126, ``1/6`` in place
#   of ``1/448`` and the e2m1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} (nearest, ties to the even code).
#
# ``x / s`` and ``q * s`` are exact (s is a power of two and the results stay normal), so the
# fake-quantised value ``q * s`` is exact in float32 and in bfloat16 (an e4m3 or e2m1 value has
# fewer mantissa bits than either): ``fake_quant`` is the identity on values it already produced.

#: the activation dtype of the official inference: its quantisation points act on values rounded
#: to it (a bfloat16 model computes exactly the official numbers; a float32 one rounds there too)
OFFICIAL_ACT_DTYPE = torch.bfloat16

#: amax clamps of the two rules (a group of zeros gets the smallest scale, not a division by zero)
ACT_AMAX_MIN = {"fp8": 1e-4, "fp4": 6.0 * 2.0 ** -126}
_QMAX = {"fp8": FP8_MAX, "fp4": FP4_MAX}


def _ceil_pow2(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(v)) for positive float32 ``v``, read off the bits (exact; no log2 rounding)."""
    bits = v.contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((e + 127) << 23).view(torch.float32)


def act_scale(amax: torch.Tensor, fmt: str = "fp8") -> torch.Tensor:
    """The power-of-two scale of the official rule for group maxima ``amax`` (float32)."""
    qmax_inv = torch.tensor(1.0 / _QMAX[fmt], dtype=torch.float32, device=amax.device)
    return _ceil_pow2(amax.to(torch.float32).clamp(min=ACT_AMAX_MIN[fmt]) * qmax_inv)


def _groups(x: torch.Tensor, block: int, who: str) -> torch.Tensor:
    if not isinstance(block, int) or block <= 0 or x.shape[-1] % block:
        raise ValueError(f"{who}: last dim {x.shape[-1]} of x {tuple(x.shape)} must be a multiple of block {block}")
    return x.to(torch.float32).unflatten(-1, (x.shape[-1] // block, block))


def _fp4_round(v: torch.Tensor) -> torch.Tensor:
    """float32 values in [-6, 6] -> the nearest e2m1 value (ties to the even code), sign kept."""
    codes = _fp4_codes(v.contiguous())
    table = torch.tensor(FP4_E2M1_TABLE, dtype=torch.float32, device=v.device)
    return table[codes.long()]


def act_quant(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The official FP8 activation quantisation: ``x [..., K]`` -> (``q`` float8_e4m3fn ``[..., K]``,
    ``scale`` float32 ``[..., K / block]``) with ``x ~ q * scale`` per group (rule above). The rule
    works on float32 values (float64 input is rounded to float32 first: the values the rule sees
    in a model or a conformance case are bf16 / fp32 ones, exact in float32)."""
    g = _groups(x, block, "act_quant")
    s = act_scale(g.abs().amax(-1), "fp8")
    q = (g / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s


def fake_quant(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """``dequant(quant(x))`` with the official rule for ``fmt`` ("fp8": e4m3, "fp4": e2m1) per group
    of ``block`` values of the last dim, returned in x's dtype (exact: no second rounding)."""
    if fmt not in _QMAX:
        raise ValueError(f"fake_quant: fmt must be 'fp8' or 'fp4', got {fmt!r}")
    g = _groups(x, block, "fake_quant")
    s = act_scale(g.abs().amax(-1), fmt).unsqueeze(-1)
    v = (g / s).clamp(-_QMAX[fmt], _QMAX[fmt])
    v = v.to(torch.float8_e4m3fn).to(torch.float32) if fmt == "fp8" else _fp4_round(v)
    return (v * s).flatten(-2).to(x.dtype)


_HADAMARD_CACHE: dict = {}


def hadamard_matrix(d: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The Sylvester-ordered Hadamard matrix of order ``d`` (a power of two), entries +-1:
    ``H[i, j] = (-1)^popcount(i & j)``."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"hadamard: the last dim must be a power of two, got {d}")
    key = (d, str(device), dtype)
    h = _HADAMARD_CACHE.get(key)
    if h is None:
        i = torch.arange(d)
        bits = torch.bitwise_and(i[:, None], i[None, :])
        parity = torch.zeros_like(bits)
        while bool(bits.any()):
            parity ^= bits & 1
            bits = bits >> 1
        h = _HADAMARD_CACHE[key] = (1 - 2 * parity).to(dtype=dtype, device=device)
    return h


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x @ H^T * d^-0.5`` over the last dim (``d`` a power of two, Sylvester order), the rotation
    the official indexer applies before its FP4 simulation; float32 math (float64 for float64 x),
    one cast to x's dtype."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    d = x.shape[-1]
    h = hadamard_matrix(d, x.device, ct)
    return ((x.to(ct) @ h.T) * d ** -0.5).to(x.dtype)
