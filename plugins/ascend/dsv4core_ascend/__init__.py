"""dsv4core backend "ascend": Huawei Ascend NPUs through torch_npu (+ CANN), device type ``npu``.

Which vendor call serves which op (VENDORS.md B.2 / E.2; :mod:`.ops` has the glue and limits):

| op            | call                                                             | declined (reference serves) when |
|---------------|------------------------------------------------------------------|----------------------------------|
| rms_norm      | ``torch_npu.npu_rms_norm`` (ones for the unweighted form; in fp32 when the weight's dtype differs) | x not fp16/bf16/fp32 |
| rope, q_norm_rope, kv_norm_rope | ``npu_rms_norm`` (fp32) + ``torch_npu.npu_rotary_mul(..., rotary_mode="interleave")`` on the rope slice, fp32 | heads >= 1000; d_r >= 896 |
| hc_pre        | ``torch.ops._C_ascend.npu_hc_pre_v2`` (vllm-ascend custom ops), opt-in: ``DSV4CORE_ASCEND_HF32_HC_PRE=1`` | not bf16; n != 4; H not 4096/7168; post_mult != 2; not opted in (its HF32 product is outside the HAL bound, see docs/conformance.md) |
| hc_post       | ``torch.ops._C_ascend.npu_hc_post``                              | not bf16; n != 4 |
| wo_a          | ``torch_npu.npu_transpose_batchmatmul``, weight transposed once to [G, D, R] | fp8 weights; not bf16 |
| moe_route     | ``torch.ops._C_ascend.moe_gating_top_k_hash`` (sqrtsoftplus = norm_type 2; hash routing via input_ids + tid2eid) | more than 2048 experts |
| moe_experts   | ``torch_npu.npu_grouped_matmul`` -> ``npu_clipped_swiglu(alpha=1, bias=0, interleaved=False)`` -> ``npu_grouped_matmul`` | not bf16 |
| sparse_mqa_attention | ``torch_npu.npu_sparse_flash_attention`` (adapted: K = V, zero rope tensors, -1 entries moved to the row tail, sinks), opt-in: ``DSV4CORE_ASCEND_SPARSE_FA=1`` | not bf16; d != 512; h not a power of two <= 128; T = 0; not opted in (the DSV4 mapping is read from the docs, not run on an NPU) |
| everything else (compress_pool, compress_windows, indexer_*, cache_store, linear, hc_head) | not implemented here: the reference serves them | — |

Declined by design, where a vendor op exists but does not match the HAL op (README.md):
``npu_lightning_indexer`` / ``npu_quant_lightning_indexer`` fuse ``indexer_scores`` and
``indexer_topk`` (they return the selected indices, not the scores) and their score formula (ReLU
and weight placement) is not documented precisely enough to check against the HAL's;
``torch.ops._C_ascend.compressor`` fuses the kv / gate projections, pooling, norm, rope and the
state-cache write, which are several HAL ops; ``npu_sparse_attn_sharedkv`` takes paged caches plus
a window with fixed shapes (64 heads, window 128, top-k 512). These need coarser HAL ops first.
vllm-ascend's ops live in ``torch.ops._C_ascend`` once its library is loaded: import vllm-ascend's
extension, or set ``DSV4CORE_ASCEND_OPS_LIB=/path/to/libvllm_ascend_C.so`` (loaded at the first
call). Collectives: the HAL's torch.distributed path with the "hccl" process-group backend.

Status: NOT VALIDATED ON HARDWARE. The glue is tested on CPU against an emulation of these APIs;
nothing ran on an NPU. ``[ascend]`` needs a CPU build of torch plus CANN (README).

Cheap to import: torch_npu is imported by the availability probe, never at plugin import.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from dsv4core.hal import HAL_API_VERSION, Backend, hookimpl
from dsv4core.hal.validation import recorded

__version__ = "0.1.0"
DISTRIBUTED_BACKEND = "hccl"


def _available():
    if importlib.util.find_spec("torch_npu") is None:
        return False, ("torch_npu is not installed (Ascend needs torch_npu matching the torch version, a CPU "
                       "build of torch and the CANN toolkit; see README 'Install')")
    try:
        import torch_npu  # noqa: F401  - registers torch.npu
    except ImportError as e:   # e.g. "libhccl.so: cannot open shared object file" without CANN
        return False, f"import torch_npu failed: {e} (is CANN installed and set_env.sh sourced?)"
    except Exception as e:  # noqa: BLE001 - e.g. "Two accelerators cannot be used at the same time"
        return False, f"import torch_npu raised {type(e).__name__}: {e}"
    import torch

    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return False, f"torch_npu {getattr(torch_npu, '__version__', '?')} sees no NPU (torch.npu.is_available() is False)"
    return True, ""


def make_backend(device_type: str = "npu", available=None, hf32_hc_pre: bool | None = None,
                 sparse_fa: bool | None = None) -> Backend:
    """The ascend Backend (``device_type`` / ``available``: for tests on CPU tensors under an
    emulated torch_npu; the opt-in ops, default from their environment variables:
    ``hf32_hc_pre`` DSV4CORE_ASCEND_HF32_HC_PRE == "1", ``sparse_fa`` DSV4CORE_ASCEND_SPARSE_FA == "1")."""
    from . import ops

    b = Backend(name="ascend", version=__version__, device_types=(device_type,), api_version=HAL_API_VERSION,
                priority=100, available=available or _available,
                description="torch_npu / vllm-ascend ops for norms, rope, mHC, wo_a and MoE (Ascend NPU); "
                            "reference for the rest",
                validated=recorded(Path(__file__).parent / "validation", "ascend"))
    ops.register(b, device_type, {"hc_pre": hf32_hc_pre, "sparse_mqa_attention": sparse_fa})
    return b


@hookimpl
def dsv4core_register_backends(register):
    register(make_backend())
