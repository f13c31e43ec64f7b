"""The weight formats (FP8 e4m3 128x128 block scales, packed FP4 e2m1 with UE8M0 scales) live in
:mod:`dsv4core.hal.quant` (the HAL's ops dequantise them too; imports run downward). This module
re-exports them under their historical checkpoint name."""

from dsv4core.hal.quant import *  # noqa: F401,F403
from dsv4core.hal.quant import _e8m0_bytes_to_float32, _expand, _fp4_codes, _lut, _pow2_scale_for  # noqa: F401
