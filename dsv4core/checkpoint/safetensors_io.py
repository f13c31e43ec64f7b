"""Safetensors header parsing and validation (no tensor data is read)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError

#: safetensors dtype string -> (torch dtype or None, bytes per element; FP4 pairs count as 1 byte)
ST_DTYPES: dict[str, tuple[torch.dtype | None, float]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
    "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
    "U16": (getattr(torch, "uint16", None), 2), "U32": (getattr(torch, "uint32", None), 4),
    "U64": (getattr(torch, "uint64", None), 8),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (getattr(torch, "float8_e8m0fnu", None), 1),
    "F4": (getattr(torch, "float4_e2m1fn_x2", None), 0.5),
}

_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return ST_DTYPES.get(self.dtype, (None, 0))[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _int_list(v) -> bool:
    """A JSON list of integers (bools and floats are not integers here)."""
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header: returns (tensors, metadata).

    Raises :class:`CheckpointError` naming the file (and the tensor, where one is at fault) for a
    missing file, a truncated file, a corrupt header, bad offsets, or a size that does not match
    the dtype and shape.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError("file does not exist", file=path)
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"truncated safetensors file ({size} bytes, no header)", file=path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"corrupt or truncated safetensors header (header length {n}, file size {size})",
                                  file=path)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"corrupt safetensors header ({type(e).__name__}: {str(e)[:200]})", file=path) from None
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError(f"corrupt safetensors header: __metadata__ must map str to str; got "
                              f"{str(meta)[:100]}", file=path)
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    spans = []
    for name, d in header.items():
        if not (isinstance(d, dict) and isinstance(d.get("dtype"), str) and _int_list(d.get("shape"))
                and _int_list(d.get("data_offsets")) and len(d["data_offsets"]) == 2):
            raise CheckpointError(f"corrupt header entry {str(d)[:200]} (expected dtype: str, shape: [int], "
                                  f"data_offsets: [begin, end] ints)", tensor=name, file=path)
        dt, shape, (b, e) = d["dtype"], tuple(d["shape"]), d["data_offsets"]
        if dt not in ST_DTYPES:
            raise CheckpointError(f"unknown safetensors dtype {dt!r}", tensor=name, file=path)
        if any(s < 0 for s in shape):
            raise CheckpointError(f"corrupt header: negative dimension in shape {list(shape)}", tensor=name, file=path)
        itemsize = ST_DTYPES[dt][1]
        want = math.ceil(math.prod(shape) * itemsize)
        if e - b != want or b < 0 or e < b:
            raise CheckpointError(f"corrupt header: data span {b}..{e} is {e - b} bytes but dtype {dt} "
                                  f"shape {list(shape)} needs {want}", tensor=name, file=path)
        if e > data_len:
            raise CheckpointError(f"truncated file: tensor data ends at byte {e} of the data section but the "
                                  f"file holds only {data_len} data bytes", tensor=name, file=path)
        spans.append((b, e, name))
        out[name] = TensorInfo(name, path, dt, shape, e - b)
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"corrupt header: data overlaps tensor {n0!r}", tensor=n1, file=path)
    return out, meta
