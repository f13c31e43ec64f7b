"""DeepSeek-V4 checkpoints: transformers and official formats, streamed into HF-named modules.

    from dsv4core.checkpoint import open_checkpoint
    ckpt = open_checkpoint(path)          # format detection, headers only
    ckpt.format, ckpt.config_dict, ckpt.files, ckpt.tensor_names()
    ckpt.load_into(module, device="cuda")  # module built on meta (or on the device)
    with load_progress(lambda done, total, shard: ...):   # progress of the loads inside the block
        load_model(path)
    save(model, "out/", format="transformers" | "official")   # write a loaded model
"""

from .errors import CheckpointError
from .loader import FORMATS, INDEX_NAME, Checkpoint, load_progress, open_checkpoint
from .names import hf_scale_name, hf_to_official, is_mtp, official_to_hf
from dsv4core.hal.quant import (
    FP4_E2M1_TABLE,
    dequantize,
    dequantize_fp4,
    dequantize_fp8,
    quantize_fp4,
    quantize_fp8_block,
    unpack_fp4,
)
from .safetensors_io import TensorInfo, read_header
from .save import save

__all__ = [
    "Checkpoint", "CheckpointError", "FORMATS", "INDEX_NAME", "TensorInfo", "load_progress", "open_checkpoint",
    "read_header",
    "official_to_hf", "hf_to_official", "hf_scale_name", "is_mtp",
    "FP4_E2M1_TABLE", "dequantize", "dequantize_fp8", "dequantize_fp4", "unpack_fp4",
    "quantize_fp8_block", "quantize_fp4", "save",
]
