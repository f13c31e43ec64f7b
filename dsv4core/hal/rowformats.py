"""Storage formats of state-pool rows: the FP8 KV row and the FP4 indexer key (HAL 1.3).

A pool stored in one of these formats is a ``uint8`` tensor ``[rows, row_bytes(fmt, d)]``; the
addressing (flat row indices, block tables) is the same as for a pool of plain ``[rows, d]``
rows. ``cache_store(..., row_format=fmt)`` writes the format, ``sparse_mqa_attention(...,
kv_format="fp8")`` and ``indexer_scores_rows(..., k_format="fp4")`` read it.

``"fp8"`` - DeepSeek-V4's KV row (window rows and compressed entries), d = n + 64:

    bytes [0, n)            the n non-rope channels as e4m3, in groups of 64 channels
    bytes [n, n + 128)      the 64 rope channels as bfloat16 (little-endian), not quantised
    bytes [n + 128, ...)    one UE8M0 scale byte per group (2^(b - 127)), then zero padding to a
                            multiple of 8 scale bytes

  At d = 512 that is 448 + 128 + 7 + 1 = 584 bytes (bf16 rows: 1,024). Group g of a row holds
  ``q = e4m3(clamp(x / s, -448, 448))`` with ``s = act_scale(max|x_g|)``: the official FP8 rule of
  ``hal.quant`` (amax clamped to >= 1e-4, s = 2^ceil(log2(amax / 448))). The rope channels are
  rounded once to bfloat16.

``"fp4"`` - the indexer's keys, d a multiple of 32:

    bytes [0, d / 2)        e2m1 codes, two a byte, element 2j in the low nibble
    bytes [d / 2, d / 2 + d / 32)   one UE8M0 scale byte per group of 32 values

  At d = 128 that is 64 + 4 = 68 bytes (bf16 keys: 256). The rule is ``fake_quant(x, "fp4", 32)``'s
  (amax clamped to >= 6 * 2^-126, s = 2^ceil(log2(amax / 6)), nearest e2m1 value, ties to even).

Both stores are lossless for the values the official numerics produce: those are already
``fake_quant`` outputs (``kv_norm_rope(..., nope_quant_block=64)``, ``indexer_rotate_quant``), and
the rule is the identity on its own outputs, so ``unpack(pack(x)) == x`` bit for bit. For any other
values the store quantises with the rule (lossy); a NaN or Inf makes its group's scale byte 255,
which reads back as NaN for the whole group. Engines page these rows differently (FlashMLA's
page puts a block's data rows first and its scale rows after them); a pool here is row-major, and
``split_page`` / ``join_page`` convert one block of rows between the two layouts.
"""

from __future__ import annotations

import torch

from .errors import OpInputError
from .quant import FP4_MAX, FP8_MAX, _fp4_codes, _lut, act_scale

#: rope channels of an "fp8" KV row (DeepSeek-V4's qk_rope_head_dim), stored as bfloat16
ROPE_DIM = 64
#: channels per UE8M0 scale: the non-rope part of a KV row, and an FP4 key
KV_GROUP = 64
KEY_GROUP = 32
#: the formats a pool row can have, with what they store
FORMATS = {"fp8": "KV row: e4m3 non-rope channels per 64 + UE8M0 scales, bf16 rope channels",
           "fp4": "indexer key: e2m1 per 32 + UE8M0 scales"}


def format_problem(fmt: str, d: int) -> str:
    """Why rows of ``d`` values cannot be stored in format ``fmt`` ("" when they can)."""
    if fmt not in FORMATS:
        return f"unknown row format {fmt!r} (expected one of {', '.join(map(repr, FORMATS))})"
    if fmt == "fp8":
        if d <= ROPE_DIM or (d - ROPE_DIM) % KV_GROUP:
            return (f"an 'fp8' KV row has {ROPE_DIM} rope channels and a multiple of {KV_GROUP} others; "
                    f"d = {d} is not {ROPE_DIM} + a positive multiple of {KV_GROUP}")
        return ""
    if d <= 0 or d % KEY_GROUP:
        return f"an 'fp4' key has a multiple of {KEY_GROUP} values; d = {d} is not"
    return ""


def check_row_format(op: str, arg: str, fmt, d: int, allowed) -> None:
    """An op's input check of a row-format argument: one of ``allowed`` and able to hold ``d`` values."""
    if fmt not in allowed:
        raise OpInputError(op, arg, f"None or one of {', '.join(map(repr, allowed))}", repr(fmt))
    why = format_problem(fmt, d)
    if why:
        raise OpInputError(op, arg, f"a format that can hold rows of {d} values", why)


def _check(fmt: str, d: int) -> None:
    why = format_problem(fmt, d)
    if why:
        raise ValueError(why)


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def row_bytes(fmt: str, d: int) -> int:
    """Bytes of one row of ``d`` values in format ``fmt`` (584 for "fp8" at d = 512, 68 for "fp4" at 128)."""
    _check(fmt, d)
    if fmt == "fp8":
        n = d - ROPE_DIM
        return n + 2 * ROPE_DIM + _pad8(n // KV_GROUP)
    return d // 2 + d // KEY_GROUP


def _scale_bytes(s: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales (normal numbers) -> their UE8M0 bytes (the biased exponent)."""
    return ((s.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _scales(b: torch.Tensor) -> torch.Tensor:
    return _lut("e8m0", b.device)[b.long()]


def pack(fmt: str, rows: torch.Tensor) -> torch.Tensor:
    """``rows [..., d]`` -> ``uint8 [..., row_bytes(fmt, d)]`` (the rule in the module docstring)."""
    d = rows.shape[-1]
    _check(fmt, d)
    x = rows.to(torch.float32)
    if fmt == "fp8":
        n = d - ROPE_DIM
        g = x[..., :n].unflatten(-1, (n // KV_GROUP, KV_GROUP))
        s = act_scale(g.abs().amax(-1), "fp8")
        q = (g / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2).view(torch.uint8)
        rope = rows[..., n:].to(torch.bfloat16).contiguous().view(torch.uint8)
        sb = _scale_bytes(s)
        pad = sb.new_zeros((*sb.shape[:-1], _pad8(sb.shape[-1]) - sb.shape[-1]))
        return torch.cat((q, rope, sb, pad), -1)
    g = x.unflatten(-1, (d // KEY_GROUP, KEY_GROUP))
    s = act_scale(g.abs().amax(-1), "fp4")
    codes = _fp4_codes((g / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    return torch.cat((codes[..., 0::2] | (codes[..., 1::2] << 4), _scale_bytes(s)), -1)


def unpack(fmt: str, data: torch.Tensor, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``uint8 [..., row_bytes(fmt, d)]`` -> the stored values ``[..., d]`` in ``dtype`` (float32 math, one cast)."""
    _check(fmt, d)
    if data.dtype != torch.uint8 or data.shape[-1] != row_bytes(fmt, d):
        raise ValueError(f"unpack: {fmt!r} rows of {d} values are uint8 [..., {row_bytes(fmt, d)}]; "
                         f"got {data.dtype} {tuple(data.shape)}")
    if fmt == "fp8":
        n = d - ROPE_DIM
        G = n // KV_GROUP
        q = data[..., :n].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        s = _scales(data[..., n + 2 * ROPE_DIM:n + 2 * ROPE_DIM + G])
        nope = (q.unflatten(-1, (G, KV_GROUP)) * s.unsqueeze(-1)).flatten(-2)
        rope = data[..., n:n + 2 * ROPE_DIM].contiguous().view(torch.bfloat16).to(torch.float32)
        return torch.cat((nope, rope), -1).to(dtype)
    half = d // 2
    pairs = _lut("fp4", data.device)[data[..., :half].long()]          # [..., d/2, 2]: (low, high)
    s = _scales(data[..., half:])
    v = pairs.flatten(-2).unflatten(-1, (d // KEY_GROUP, KEY_GROUP)) * s.unsqueeze(-1)
    return v.flatten(-2).to(dtype)


def split_page(block: torch.Tensor, fmt: str, d: int) -> torch.Tensor:
    """One block of ``N`` "fp8" rows, ``uint8 [N, row_bytes]``, in the paged layout of FlashMLA's
    DeepSeek-V4 cache: ``N`` data rows (non-rope + rope bytes), then ``N`` rows of scale bytes
    (flat ``uint8 [N * row_bytes]``). ``join_page`` is its inverse."""
    if fmt != "fp8":
        raise ValueError(f"split_page: only the 'fp8' KV row has a paged layout, got {fmt!r}")
    W = row_bytes(fmt, d)
    if block.dtype != torch.uint8 or block.dim() != 2 or block.shape[1] != W:
        raise ValueError(f"split_page: a block of 'fp8' rows of d = {d} is uint8 [N, {W}]; "
                         f"got {block.dtype} {tuple(block.shape)}")
    data_bytes = d + ROPE_DIM
    return torch.cat((block[:, :data_bytes].reshape(-1), block[:, data_bytes:].reshape(-1)))


def join_page(page: torch.Tensor, fmt: str, d: int) -> torch.Tensor:
    """The inverse of ``split_page``: a flat page of ``N`` rows -> ``uint8 [N, row_bytes]``."""
    if fmt != "fp8":
        raise ValueError(f"join_page: only the 'fp8' KV row has a paged layout, got {fmt!r}")
    W = row_bytes(fmt, d)
    if page.numel() % W:
        raise ValueError(f"join_page: an 'fp8' page of d = {d} rows holds a multiple of {W} bytes; "
                         f"got {page.numel()} ({fmt!r})")
    N, data_bytes = page.numel() // W, d + ROPE_DIM
    return torch.cat((page[:N * data_bytes].view(N, data_bytes), page[N * data_bytes:].view(N, W - data_bytes)), 1)
