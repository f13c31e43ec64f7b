"""`DeepseekV4ForCausalLM`: dsv4core's model behind vLLM's model contract (docs/vllm.md).

    __init__(*, vllm_config, prefix="")      the dsv4core model (empty weights, a HAL backend
                                             chosen as `build_model` does) and one cache module
                                             per cache part, registered under its layer name
    embed_input_ids(input_ids)               the token embeddings
    forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None)
                                             the final hidden states [T, hidden]
    compute_logits(hidden_states)            float32 logits
    load_weights(weights) -> set[str]        (name, tensor) pairs by dsv4core's (= transformers')
                                             parameter names

The cache modules declare the specs of `specs.py`; vLLM allocates them and binds each module a
block tensor; every step vLLM's builders hand each module its group's block table and slot
mapping, from which `metadata.build_step` makes the step. The modules' backend asks for vLLM's
block-outermost `BLHNC` layout and any kernel block size (vLLM then packs every group's pages
into one physical block and never splits a block); the numerics are the checkpoint's
(`checkpoint_numerics`). Importing this module needs no vLLM;
building the class does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from dsv4core.model.api import build_model
from dsv4core.model.config import DSV4Config

from .layout import cache_parts
from .metadata import build_step
from .pools import EnginePools
from .specs import kv_cache_specs


@dataclass
class GroupMetadata:
    """What a cache module gets each step (one object per cache group): the group's block table
    and slot mapping, the batch's query start locations and sequence lengths."""

    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


@lru_cache(maxsize=1)
def vllm_classes():
    """(cache module class, attention backend class), subclasses of vLLM's, built on first use."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, MultipleOf

    class Builder(AttentionMetadataBuilder):
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

        def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> GroupMetadata:
            m = common_attn_metadata
            return GroupMetadata(m.block_table_tensor, m.slot_mapping, m.query_start_loc, m.seq_lens)

    class Backend(AttentionBackend):
        @staticmethod
        def get_name() -> str:
            return "DSV4CORE_CACHE"

        @staticmethod
        def get_impl_cls():
            raise NotImplementedError("dsv4core's cache modules compute nothing themselves (the model does)")

        @staticmethod
        def get_builder_cls():
            return Builder

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            return [MultipleOf(1)]

        @classmethod
        def supported_kv_cache_layouts(cls):
            # block-outermost: vLLM then packs the pages of every group into one physical block
            # (pages of different sizes side by side), the layout the pools view (docs/vllm.md)
            from vllm.v1.kv_cache_layout import KVCacheLayout

            return (KVCacheLayout.BLHNC,)

    class CacheModule(nn.Module, AttentionLayerBase):
        """One cache part of one layer: declares its spec, holds the block tensor vLLM binds."""

        def __init__(self, spec, prefix: str, vllm_config) -> None:
            super().__init__()
            self.spec, self.prefix, self.kv_cache = spec, prefix, None
            ctx = vllm_config.compilation_config.static_forward_context
            if prefix in ctx:
                raise ValueError(f"duplicate layer name: {prefix}")
            ctx[prefix] = self

        def get_kv_cache_spec(self, vllm_config):
            return self.spec

        def get_attn_backend(self):
            return Backend

        def forward(self):
            raise NotImplementedError("a cache module only holds memory")

    return CacheModule, Backend


#: the config key naming the numerics (`dsv4core.model.numerics`) of an unquantized checkpoint that
#: computes with the official ones (`checkpoint.write_checkpoint` writes it; vLLM's `hf_overrides`
#: can set it)
NUMERICS_KEY = "dsv4core_numerics"


def checkpoint_numerics(hf_dict: dict) -> str:
    """The numerics the model computes with: the config's `NUMERICS_KEY` when given, else as
    dsv4core's `load_model` picks for the checkpoint ("official" for FP8 / FP4-quantized configs,
    "exact" otherwise; the "auto" rule of `numerics.resolve`)."""
    from dsv4core.model import numerics as num

    n = hf_dict.get(NUMERICS_KEY) or "auto"
    num.check(n)
    return num.resolve(n, None, hf_dict) if n == "auto" else n


def _kv_dtype(cache_dtype: str) -> str | None:
    if cache_dtype in (None, "auto"):
        return None
    if cache_dtype == "fp8":     # dsv4core's FP8 KV rows and FP4 indexer keys (`hal.rowformats`), paged views
        return "fp8"
    raise NotImplementedError(f"kv_cache_dtype={cache_dtype!r}: 'auto' (rows in the model dtype) and 'fp8' "
                              f"(dsv4core's FP8 KV rows, FP4 indexer keys) are mapped (docs/vllm.md)")


class DeepseekV4ForCausalLM(nn.Module):
    """dsv4core's DSV4 as a vLLM model (module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        CacheModule, _ = vllm_classes()
        pc = getattr(vllm_config, "parallel_config", None)
        if pc is not None and (pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1
                               or getattr(pc, "enable_expert_parallel", False)):
            raise NotImplementedError("DeepseekV4ForCausalLM (dsv4core): tensor / pipeline / expert parallelism is "
                                      "not mapped (one rank)")
        mc = vllm_config.model_config
        hf = mc.hf_config
        hf_dict = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
        config = DSV4Config.from_dict(hf_dict)
        device = getattr(getattr(vllm_config, "device_config", None), "device", None)
        self.dsv4 = build_model(config, dtype=mc.dtype, device=device, seed=None, numerics=checkpoint_numerics(hf_dict))
        self.dsv4.use_graphs = False
        # fp8: key pages of whole KV rows, so vLLM's side-by-side packing keeps every layer's window and
        # entry pages whole KV rows apart (docs/vllm.md)
        self.parts = cache_parts(config, self.dsv4.act_dtype, _kv_dtype(vllm_config.cache_config.cache_dtype),
                                 align_key_pages=True)
        base = f"{prefix}." if prefix else ""
        specs = kv_cache_specs(self.parts, base)
        self.cache_modules = nn.ModuleDict({p.key.replace(".", "_"): CacheModule(specs[base + p.key], base + p.key,
                                                                                  vllm_config) for p in self.parts})
        self._names = {p.key: base + p.key for p in self.parts}
        self._pools: EnginePools | None = None
        self._group_of: dict[str, str] | None = None

    # ------------------------------------------------------------------ the contract
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.dsv4._embed(input_ids)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        if intermediate_tensors is not None or inputs_embeds is not None:
            raise NotImplementedError("DeepseekV4ForCausalLM (dsv4core): pipeline parallelism and input embeddings "
                                      "are not mapped")
        meta = get_forward_context().attn_metadata
        if meta is None:          # vLLM's profiling / warm-up run: no request, no cache
            return torch.zeros(input_ids.shape[0], self.dsv4.config.hidden_size, dtype=self.dsv4.act_dtype,
                               device=input_ids.device)
        if not isinstance(meta, dict):
            raise NotImplementedError(f"DeepseekV4ForCausalLM (dsv4core): attention metadata of type "
                                      f"{type(meta).__name__} (micro-batching) is not mapped")
        per = {k: meta[n] for k, n in self._names.items()}
        groups = self._groups(per)
        tables = {groups[k]: m.block_table for k, m in per.items()}
        slots = {groups[k]: m.slot_mapping for k, m in per.items()}
        first = next(iter(per.values()))
        step = build_step(self.dsv4, self._pools, input_ids, positions, first.query_start_loc, first.seq_lens,
                          tables, slots)
        return self.dsv4.forward_step(step, head=False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dsv4.head_logits(hidden_states)

    def load_weights(self, weights) -> set[str]:
        """Copy (name, tensor) pairs into the parameters and buffers of the same name; raises
        KeyError naming the unknown ones (nothing copied then). Returns the names as this module
        names them (``dsv4.<name>``), which vLLM's loader checks against `named_parameters`."""
        own = dict(self.dsv4.state_dict(keep_vars=True))
        pairs = list(weights)
        unknown = sorted(n for n, _ in pairs if n not in own)
        if unknown:
            raise KeyError(f"load_weights: {len(unknown)} name(s) not in the dsv4core model, e.g. {unknown[:5]} "
                           f"(transformers-format names are mapped; the official format is not yet)")
        with torch.no_grad():
            for n, t in pairs:
                own[n].copy_(t)
        return {f"dsv4.{n}" for n, _ in pairs}

    # ------------------------------------------------------------------ pools
    def _groups(self, per: dict) -> dict[str, str]:
        """part key -> cache group name: parts whose modules got one metadata object share a group.
        The pools are built on the first step (vLLM has bound every block tensor by then)."""
        ids: dict[int, str] = {}
        groups = {k: ids.setdefault(id(m), f"g{len(ids)}") for k, m in per.items()}
        if self._pools is None or groups != self._group_of:
            tensors = {p.key: self.cache_modules[p.key.replace(".", "_")].kv_cache for p in self.parts}
            self._pools = EnginePools(self.dsv4.config, self.parts, tensors, groups)
            self._group_of = groups
        return groups
