"""Official DeepSeek-V4 tensor names <-> transformers 5.23 ``DeepseekV4ForCausalLM`` names.

The mapping is the one transformers applies at load time (``conversion_mapping["deepseek_v4"]``
plus the FP8 quantizer's ``.scale -> .weight_scale_inv``), written out as a table here
(PEERS.md 11.2). Routed experts are per-expert tensors officially and packed tensors in HF:
``layers.N.ffn.experts.E.w1/w3.weight [I, H]`` -> ``model.layers.N.mlp.experts.gate_up_proj[E]``
rows ``[0:I]`` (w1 = gate) and ``[I:2I]`` (w3 = up); ``w2 [H, I]`` -> ``down_proj[E]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# layer-relative official module path -> HF module path (both without the leaf ".weight")
_LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.q_norm": "self_attn.q_a_norm",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.kv_norm": "self_attn.kv_norm",
    "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj",
    "attn.compressor.norm": "self_attn.compressor.kv_norm",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj",
    "attn.indexer.compressor.norm": "self_attn.compressor.indexer.kv_norm",
    "ffn.gate": "mlp.gate",
    # transformers' save_pretrained reverses ``\.norm\. -> .kv_norm.`` and so writes the
    # attention kv_norm as ``attn.norm``; transformers' loader maps it back. Accept it too.
    "attn.norm": "self_attn.kv_norm",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}

# layer-relative official full names (no ".weight" leaf) -> HF names
_LAYER_LEAVES = {
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
}

_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

# the MTP block (``mtp.N.`` officially, ``model.mtp.N.`` here): its own leaves besides a layer's
_MTP_LEAVES = {
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
}
_MTP_SCALES = {"e_proj.scale": "e_proj.weight", "h_proj.scale": "h_proj.weight"}

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP_RE = re.compile(r"^mtp\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")

HF_SCALE_SUFFIX = "_scale_inv"  # HF: X.weight -> X.weight_scale_inv, experts gate_up_proj -> gate_up_proj_scale_inv


@dataclass(frozen=True)
class Target:
    """Where one official tensor goes.

    ``hf_name``: the HF parameter (the weight, also for a scale); ``is_scale``: the tensor is the
    ``.scale`` companion of that weight; ``expert`` / ``part``: for routed experts the expert
    index and ``"gate"`` (w1), ``"up"`` (w3) or ``"down"`` (w2); ``weight_name``: the official
    name of the weight this scale belongs to (or the name itself).
    """

    hf_name: str
    is_scale: bool = False
    expert: int | None = None
    part: str | None = None
    weight_name: str = ""


def is_mtp(name: str) -> bool:
    return name.startswith("mtp.") or name.startswith("model.mtp.")


def official_to_hf(name: str) -> Target | None:
    """Map an official tensor name; ``None`` if the name is not a known official tensor.

    ``mtp.N.*`` (the MTP block) maps to ``model.mtp.N.*``: its layer tensors as a layer's, and
    ``e_proj`` / ``h_proj`` (+ ``.scale``), ``enorm``, ``hnorm``, ``norm``, ``hc_head_*``.
    """
    m = _MTP_RE.match(name)
    if m:
        pre, rest = f"model.mtp.{m.group(1)}.", m.group(2)
        if rest in _MTP_LEAVES:
            return Target(pre + _MTP_LEAVES[rest], weight_name=name)
        if rest in _MTP_SCALES:
            return Target(pre + _MTP_SCALES[rest], is_scale=True, weight_name=name[: -len("scale")] + "weight")
        t = official_to_hf(f"layers.0.{rest}")
        if t is None:
            return None
        hf = pre + t.hf_name[len("model.layers.0."):]
        return Target(hf, t.is_scale, t.expert, t.part, name[: -len(rest)] + t.weight_name[len("layers.0."):])
    if name in _TOP_LEVEL:
        return Target(_TOP_LEVEL[name], weight_name=name)
    m = _LAYER_RE.match(name)
    if not m:
        return None
    layer, rest = m.group(1), m.group(2)
    pre = f"model.layers.{layer}."
    e = _EXPERT_RE.match(rest)
    if e:
        part = {"w1": "gate", "w3": "up", "w2": "down"}[e.group(2)]
        hf = pre + ("mlp.experts.down_proj" if part == "down" else "mlp.experts.gate_up_proj")
        is_scale = e.group(3) == "scale"
        wname = name[: -len("scale")] + "weight" if is_scale else name
        return Target(hf, is_scale=is_scale, expert=int(e.group(1)), part=part, weight_name=wname)
    if rest in _LAYER_LEAVES:
        return Target(pre + _LAYER_LEAVES[rest], weight_name=name)
    for leaf, is_scale in ((".weight", False), (".scale", True)):
        if rest.endswith(leaf):
            mod = rest[: -len(leaf)]
            if mod in _LAYER_MODULES:
                wname = name[: -len(leaf)] + ".weight"
                return Target(pre + _LAYER_MODULES[mod] + ".weight", is_scale=is_scale, weight_name=wname)
    return None


def hf_to_official(hf_name: str) -> str | None:
    """Inverse of :func:`official_to_hf` for non-expert tensors (experts are split per expert by
    the writer). ``None`` for packed experts or unknown names."""
    for k, v in _TOP_LEVEL.items():
        if v == hf_name:
            return k
    m = re.match(r"^model\.mtp\.(\d+)\.(.+)$", hf_name)
    if m:
        for k, v in _MTP_LEAVES.items():
            if v == m.group(2):
                return f"mtp.{m.group(1)}.{k}"
        off = hf_to_official(f"model.layers.0.{m.group(2)}")
        return None if off is None else f"mtp.{m.group(1)}." + off[len("layers.0."):]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf_name)
    if not m:
        return None
    layer, rest = m.group(1), m.group(2)
    pre = f"layers.{layer}."
    for k, v in _LAYER_LEAVES.items():
        if v == rest:
            return pre + k
    if rest.endswith(".weight"):
        mod = rest[: -len(".weight")]
        for k, v in _LAYER_MODULES.items():
            if v == mod:
                return pre + k + ".weight"
    return None


def hf_scale_name(hf_weight_name: str) -> str:
    """HF name of the block-scale companion of a weight (``X.weight`` -> ``X.weight_scale_inv``,
    ``...experts.gate_up_proj`` -> ``...experts.gate_up_proj_scale_inv``)."""
    return hf_weight_name + HF_SCALE_SUFFIX
