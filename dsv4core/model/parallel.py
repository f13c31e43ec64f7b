"""Tensor and expert parallelism: the rank layout, its process groups, and which slice of each
weight a rank holds.

Layout (world = tp * ep ranks, tensor-parallel ranks adjacent):

    rank = ep_rank * tp + tp_rank        tp group: the tp ranks of one ep_rank
                                         ep group: the ep ranks of one tp_rank

    attention   q_b_proj rows, sinks: heads split over the tp group (h / tp heads a rank)
                o_a_proj (wo_a): output groups split (o_groups / tp a rank)
                o_b_proj: columns split (row-parallel) -> all_reduce(tp group)
                kv_proj, kv_norm, compressor, indexer: replicated (the KV cache layout is the
                same on every rank); attention is computed once per tp group (so ep groups
                repeat it: attention is not data-parallel here)
    MoE         router: replicated (every rank routes every token the same way)
                routed experts: ep_rank holds experts [ep_rank * E/ep, (ep_rank+1) * E/ep),
                each split along its intermediate size over the tp group (gate/up rows,
                down columns)
                shared expert: intermediate size split over all world ranks
                combine: one all_reduce(world) of (routed + shared) partial sums. The tokens
                are already on every rank, so no dispatch is needed: this is the all-gather +
                reduce form of expert parallelism with the all-gather free.
    vocabulary  embed_tokens rows and lm_head rows split over the tp group in chunks of
                ceil(V / tp) (the last one shorter when tp does not divide V); masked lookup +
                all_reduce(tp), logits all_gather(tp) (padded to equal chunks, trimmed).

Every collective goes through the bound HAL op table (`all_reduce`, `all_gather`) with the
groups held here, so a plugin's collectives serve them. A model with tp = ep = 1 calls none.
"""

from __future__ import annotations

import datetime
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from dsv4core.hal.util import cdiv

from .config import DSV4Config


class ParallelError(ValueError):
    """A tensor/expert-parallel layout that does not fit the model or the process group. Raised
    identically on every rank (the checks depend only on the arguments, the config and the world
    size)."""


@dataclass(frozen=True)
class Parallel:
    """One rank's place in the tp x ep layout and the process groups its collectives use
    (`None` = the default group; unused when the size is 1)."""

    tp: int = 1
    ep: int = 1
    rank: int = 0
    tp_group: Any = None
    ep_group: Any = None
    world_group: Any = None

    @property
    def world(self) -> int:
        return self.tp * self.ep

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp

    # ---------------------------------------------------------------- slices (start, stop)
    @staticmethod
    def _even(n: int, parts: int, i: int) -> tuple[int, int]:
        k = n // parts
        return i * k, (i + 1) * k

    def heads(self, cfg: DSV4Config) -> tuple[int, int]:
        return self._even(cfg.num_attention_heads, self.tp, self.tp_rank)

    def groups(self, cfg: DSV4Config) -> tuple[int, int]:
        return self._even(cfg.o_groups, self.tp, self.tp_rank)

    def experts(self, cfg: DSV4Config) -> tuple[int, int]:
        return self._even(cfg.n_routed_experts, self.ep, self.ep_rank)

    def expert_inter(self, cfg: DSV4Config) -> tuple[int, int]:
        """Intermediate slice of each routed expert (over the tp group)."""
        return self._even(cfg.moe_intermediate_size, self.tp, self.tp_rank)

    def shared_inter(self, cfg: DSV4Config) -> tuple[int, int]:
        """Intermediate slice of the shared expert (over every rank)."""
        return self._even(cfg.moe_intermediate_size, self.world, self.rank)

    def vocab_chunk(self, cfg: DSV4Config) -> int:
        return cdiv(cfg.vocab_size, self.tp)

    def vocab(self, cfg: DSV4Config) -> tuple[int, int]:
        c, V = self.vocab_chunk(cfg), cfg.vocab_size
        return min(self.tp_rank * c, V), min((self.tp_rank + 1) * c, V)



SINGLE = Parallel()


def check_layout(cfg: DSV4Config, tp: Any, ep: Any) -> None:
    """Raise `ParallelError` if tp / ep do not split this model. Pure: the same on every rank."""
    for name, v in (("tp", tp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ParallelError(f"{name} must be an int >= 1; got {v!r}")
    need = [
        ("tp", tp, "num_attention_heads", cfg.num_attention_heads),
        ("tp", tp, "o_groups", cfg.o_groups),
        ("ep", ep, "n_routed_experts", cfg.n_routed_experts),
        ("tp", tp, "moe_intermediate_size (routed experts split over tp)", cfg.moe_intermediate_size),
        ("tp * ep", tp * ep, "moe_intermediate_size (shared expert split over every rank)",
         cfg.moe_intermediate_size),
    ]
    for what, v, field_name, n in need:
        if n % v:
            raise ParallelError(f"{what}={v} must divide {field_name}={n} (tp={tp}, ep={ep})")


def config_fingerprint(cfg: DSV4Config) -> int:
    """A 31-bit checksum of the config (compared across ranks)."""
    text = json.dumps(cfg.to_hf_dict(), sort_keys=True, default=str)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


DEFAULT_TIMEOUT_S = 300.0
_GROUPS: dict[tuple, tuple[list, list]] = {}   # (default group, tp, ep) -> (tp groups, ep groups)


def setup(cfg: DSV4Config, tp: int = 1, ep: int = 1, *, ops=None, device: torch.device | None = None,
          timeout_s: float | None = None) -> Parallel:
    """The `Parallel` of this process for a tp x ep layout.

    tp = ep = 1: the single-process layout (no collectives), whatever process group exists.
    Otherwise `torch.distributed` is initialised from the launcher's environment (`torchrun`:
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) if it is not already, with `timeout_s` (default
    env DSV4CORE_DIST_TIMEOUT or 300 s) so that a rank that fails leaves the others an error,
    not a hang. The world size must equal tp * ep. When `ops` is given, the config, tp and ep
    are compared across ranks through its `all_gather` (every rank raises on a mismatch)."""
    check_layout(cfg, tp, ep)
    import torch.distributed as dist

    if tp * ep == 1:  # also inside a larger process group: each process runs the whole model
        return SINGLE
    initialised = dist.is_available() and dist.is_initialized()
    if not initialised:
        if not dist.is_available():
            raise ParallelError(f"tp={tp} ep={ep} needs torch.distributed, which this torch build lacks")
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ParallelError(f"tp={tp} ep={ep} needs {tp * ep} processes in a torch.distributed group; none is "
                                f"initialised and the launcher environment lacks {', '.join(missing)} "
                                f"(launch with: torchrun --nproc-per-node {tp * ep} ...)")
        t = timeout_s if timeout_s is not None else float(os.environ.get("DSV4CORE_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
        dist.init_process_group(timeout=datetime.timedelta(seconds=t))  # torch picks the backend per device
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp * ep:
        raise ParallelError(f"tp={tp} x ep={ep} = {tp * ep} ranks, but the process group has world size {world}")
    tp_group = ep_group = None          # None: the default group (when it is the whole group)
    if tp > 1 and ep > 1:               # every rank creates every group, in the same order (once)
        key = (id(dist.group.WORLD), tp, ep)
        if key not in _GROUPS:
            _GROUPS[key] = ([dist.new_group(list(range(j * tp, (j + 1) * tp))) for j in range(ep)],
                            [dist.new_group(list(range(i, world, tp))) for i in range(tp)])
        tp_groups, ep_groups = _GROUPS[key]
        tp_group, ep_group = tp_groups[rank // tp], ep_groups[rank % tp]
    par = Parallel(tp=tp, ep=ep, rank=rank, tp_group=tp_group, ep_group=ep_group, world_group=None)
    if ops is not None:
        mine = torch.tensor([[config_fingerprint(cfg), tp, ep]], dtype=torch.int64, device=device)
        allv = ops.all_gather(mine, 0, None).cpu()
        bad = [r for r in range(world) if not torch.equal(allv[r], allv[0])]
        if bad:
            rows = "; ".join(f"rank {r}: config {int(v[0]):08x} tp={int(v[1])} ep={int(v[2])}"
                             for r, v in enumerate(allv))
            raise ParallelError(f"ranks disagree on the model config or layout ({rows})")
    return par


# --------------------------------------------------------------------------------------------
# weight slicing


def _rule(name: str, cfg: DSV4Config, par: Parallel) -> list[tuple[int, int, int]] | None:
    """How the full tensor `name` is cut for `par`: a list of (dim, start, stop) (several for
    gate_up_proj, whose gate and up halves are cut separately and re-joined), or None when the
    tensor is replicated."""
    leaf = name.rsplit(".", 1)[-1]
    d, I = cfg.head_dim, cfg.moe_intermediate_size
    R = cfg.o_lora_rank
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return [(0, *par.vocab(cfg))] if par.tp > 1 else None
    if ".self_attn." in name and ".compressor." not in name:
        h0, h1 = par.heads(cfg)
        g0, g1 = par.groups(cfg)
        if name.endswith("self_attn.q_b_proj.weight"):
            return [(0, h0 * d, h1 * d)]
        if name.endswith("self_attn.sinks"):
            return [(0, h0, h1)]
        if name.endswith("self_attn.o_a_proj.weight"):
            return [(0, g0 * R, g1 * R)]
        if name.endswith("self_attn.o_b_proj.weight"):
            return [(1, g0 * R, g1 * R)]
        return None
    if ".mlp.experts." in name and leaf in ("gate_up_proj", "down_proj"):
        e0, e1 = par.experts(cfg)
        i0, i1 = par.expert_inter(cfg)
        if leaf == "gate_up_proj":
            return [(0, e0, e1), (1, i0, i1), (1, I + i0, I + i1)]
        return [(0, e0, e1), (2, i0, i1)]
    if ".mlp.shared_experts." in name:
        s0, s1 = par.shared_inter(cfg)
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return [(0, s0, s1)]
        if name.endswith("down_proj.weight"):
            return [(1, s0, s1)]
    return None


def _full_dims(name: str, cfg: DSV4Config) -> dict[int, int]:
    """The full sizes of the dims `_rule` cuts (to check a checkpoint against the config)."""
    h, d, G, R = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    E, I, V = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.vocab_size
    table = {"embed_tokens.weight": {0: V}, "lm_head.weight": {0: V}, "q_b_proj.weight": {0: h * d},
             "sinks": {0: h}, "o_a_proj.weight": {0: G * R}, "o_b_proj.weight": {1: G * R},
             "experts.gate_up_proj": {0: E, 1: 2 * I}, "experts.down_proj": {0: E, 2: I},
             "shared_experts.gate_proj.weight": {0: I}, "shared_experts.up_proj.weight": {0: I},
             "shared_experts.down_proj.weight": {1: I}}
    for k, v in table.items():
        if name.endswith(k):
            return v
    return {}


class RankCut:
    """What one rank reads of a checkpoint (`Checkpoint.load_into(..., cut=)`, see
    `dsv4core.checkpoint.cuts`): the same cuts as `shard_state_dict`, expressed per target."""

    def __init__(self, cfg: DSV4Config, par: Parallel) -> None:
        self.cfg, self.par = cfg, par

    def rule(self, target: str) -> list[tuple[int, int, int]] | None:
        return _rule(target, self.cfg, self.par) if self.par.world > 1 else None

    def full_dims(self, target: str) -> dict[int, int]:
        return _full_dims(target, self.cfg)

    def expert(self, target: str, e: int) -> int | None:
        e0, e1 = self.par.experts(self.cfg)
        return e - e0 if e0 <= e < e1 else None


def shard_state_dict(state_dict: dict[str, torch.Tensor], cfg: DSV4Config, par: Parallel) -> dict[str, torch.Tensor]:
    """The tensors rank `par` holds, cut from a full (single-process) state dict: names unchanged,
    shapes those of a model built with `par`. A quantised weight's scale (`<name>_scale_inv`) is
    cut with it: FP8 128 x 128 block grids on block boundaries, packed FP4 (int8 / uint8, two
    values a byte) on its bytes and 32-value scale groups (`dsv4core.checkpoint.cuts`); a cut
    inside a block raises `ParallelError`."""
    from dsv4core.checkpoint import CheckpointError
    from dsv4core.checkpoint.cuts import cut_tensor, tensor_rules
    from dsv4core.checkpoint.names import HF_SCALE_SUFFIX as SCALE_SUFFIX   # X.weight -> X.weight_scale_inv

    if par.world == 1:
        return dict(state_dict)
    out = {}
    for name, t in state_dict.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in state_dict:
            continue                                   # cut with its weight below
        rule = _rule(name, cfg, par)
        scale = state_dict.get(name + SCALE_SUFFIX)
        if rule is None:
            out[name] = t
            if scale is not None:
                out[name + SCALE_SUFFIX] = scale
            continue
        try:
            w_rule, s_rule = tensor_rules(rule, t.dtype, tuple(t.shape), scale is not None, name)
        except CheckpointError as e:
            raise ParallelError(f"{name}: {e.reason}") from None
        out[name] = cut_tensor(t, w_rule)
        if scale is not None:
            out[name + SCALE_SUFFIX] = cut_tensor(scale, s_rule)
    return out


__all__ = ["Parallel", "ParallelError", "RankCut", "SINGLE", "check_layout", "setup", "shard_state_dict", "config_fingerprint"]
