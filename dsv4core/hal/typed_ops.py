"""The op table's attributes, typed: one method per HAL op with the op's signature, so that
editors and type checkers follow ``ops.rms_norm(...)`` to the op and its spec.

Generated from the op specs in ``dsv4core/hal/ops/`` by ``python -m dsv4core.hal.docs typed``.
Do not edit by hand (a test checks it is current). At run time the class is empty: a bound
:class:`~dsv4core.hal.OpTable` holds each op's bound callable as an instance attribute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class TypedOps:
    """One attribute per HAL op (see the module docstring)."""

    __slots__ = ()

    if TYPE_CHECKING:
        def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.norms.rms_norm`."""
            ...

        def hc_pre(
            self,
            x: torch.Tensor,
            fn: torch.Tensor,
            scale: torch.Tensor,
            base: torch.Tensor,
            rms_eps: float,
            hc_eps: float,
            iters: int,
            post_mult: float = 2.0,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """Spec and reference math: :func:`dsv4core.hal.ops.mhc.hc_pre`."""
            ...

        def hc_post(
            self,
            o: torch.Tensor,
            residual: torch.Tensor,
            post: torch.Tensor,
            comb: torch.Tensor,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.mhc.hc_post`."""
            ...

        def hc_head(
            self,
            x: torch.Tensor,
            fn: torch.Tensor,
            scale: torch.Tensor,
            base: torch.Tensor,
            rms_eps: float,
            hc_eps: float,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.mhc.hc_head`."""
            ...

        def rope(
            self,
            x: torch.Tensor,
            positions: torch.Tensor,
            inv_freq: torch.Tensor,
            inverse: bool = False,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.rope.rope`."""
            ...

        def q_norm_rope(
            self,
            q: torch.Tensor,
            positions: torch.Tensor,
            inv_freq: torch.Tensor,
            eps: float,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.rope.q_norm_rope`."""
            ...

        def kv_norm_rope(
            self,
            kv: torch.Tensor,
            weight: torch.Tensor,
            positions: torch.Tensor,
            inv_freq: torch.Tensor,
            eps: float,
            nope_quant_block: int | None = None,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.rope.kv_norm_rope`."""
            ...

        def sparse_mqa_attention(
            self,
            q: torch.Tensor,
            kv: torch.Tensor,
            indices: torch.Tensor,
            sink: torch.Tensor,
            scale: float,
            kv_format: str | None = None,
            kv_paged: bool = False,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.attention.sparse_mqa_attention`."""
            ...

        def compress_pool(
            self,
            kv: torch.Tensor,
            score: torch.Tensor,
            ape: torch.Tensor,
            overlap: bool,
            prev_kv: torch.Tensor | None = None,
            prev_score: torch.Tensor | None = None,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.compression.compress_pool`.
            Deprecated: the model calls compress_windows since HAL 1.1.
            """
            ...

        def compress_windows(self, kv: torch.Tensor, score: torch.Tensor, overlap: bool) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.compression.compress_windows`."""
            ...

        def indexer_scores(
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            weights: torch.Tensor,
            k_offsets: torch.Tensor,
            k_lengths: torch.Tensor,
            scale: float,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.compression.indexer_scores`.
            Deprecated: the model calls indexer_scores_rows since HAL 1.1.
            """
            ...

        def indexer_scores_rows(
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            weights: torch.Tensor,
            rows: torch.Tensor,
            scale: float,
            k_format: str | None = None,
            k_paged: bool = False,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.compression.indexer_scores_rows`."""
            ...

        def indexer_topk(self, scores: torch.Tensor, k_lengths: torch.Tensor, topk: int) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.compression.indexer_topk`."""
            ...

        def indexer_rotate_quant(self, x: torch.Tensor) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.compression.indexer_rotate_quant`."""
            ...

        def cache_store(
            self,
            pool: torch.Tensor,
            index: torch.Tensor,
            rows: torch.Tensor,
            row_format: str | None = None,
            paged: bool = False,
        ) -> None:
            """Spec and reference math: :func:`dsv4core.hal.ops.cache.cache_store`."""
            ...

        def linear(
            self,
            x: torch.Tensor,
            weight: torch.Tensor,
            weight_scale: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None,
            act_block: int | None = None,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.projections.linear`."""
            ...

        def wo_a(
            self,
            o: torch.Tensor,
            weight: torch.Tensor,
            weight_scale: torch.Tensor | None = None,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.projections.wo_a`."""
            ...

        def moe_route(
            self,
            logits: torch.Tensor,
            topk: int,
            scaling: float,
            correction_bias: torch.Tensor | None = None,
            hash_ids: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """Spec and reference math: :func:`dsv4core.hal.ops.moe.moe_route`."""
            ...

        def moe_experts(
            self,
            x: torch.Tensor,
            ids: torch.Tensor,
            weights: torch.Tensor,
            w13: torch.Tensor,
            w2: torch.Tensor,
            swiglu_limit: float,
            w13_scale: torch.Tensor | None = None,
            w2_scale: torch.Tensor | None = None,
            act_block: int | None = None,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.moe.moe_experts`."""
            ...

        def all_reduce(self, x: torch.Tensor, group=None) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.collectives.all_reduce`."""
            ...

        def all_gather(
            self,
            x: torch.Tensor,
            dim: int = 0,
            group=None,
            sizes: list[int] | None = None,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.collectives.all_gather`."""
            ...

        def reduce_scatter(
            self,
            x: torch.Tensor,
            dim: int = 0,
            group=None,
            sizes: list[int] | None = None,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.collectives.reduce_scatter`."""
            ...

        def all_to_all(
            self,
            x: torch.Tensor,
            output_split_sizes: list[int] | None = None,
            input_split_sizes: list[int] | None = None,
            group=None,
        ) -> torch.Tensor:
            """Spec and reference math: :func:`dsv4core.hal.ops.collectives.all_to_all`."""
            ...
