"""DSV4 model configuration.

`DSV4Config` is the one validated description of a DeepSeek-V4 network that the model core uses.
It is built from either of the two `config.json` dialects in circulation (SPEC.md section 1,
PEERS.md section 1.2):

* transformers 5.23.0 (`model_type: deepseek_v4`): `layer_types`, `mlp_layer_types`,
  `compress_rates`, nested `rope_parameters = {"main": {...}, "compress": {...}}`;
* the official DeepSeek `config.json`: `compress_ratios` (one entry per layer plus the MTP block,
  truncated to `num_hidden_layers`), `num_hash_layers`, `qk_rope_head_dim`, flat `rope_scaling`.

Both are normalised to the transformers vocabulary (so the model's parameter names and the
layer schedule are the same whichever file a checkpoint ships), then validated: every error names
the field, the value found and what was expected.

The rope frequencies (`inv_freq`) of the two rope kinds are computed here as well
(`DSV4Config.inv_freq("main" | "compress")`), exactly as SPEC.md's rope section states
(YaRN with floor/ceil correction range, no magnitude factor).
"""

from __future__ import annotations

import math
import reprlib
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}


class ConfigError(ValueError):
    """A config that cannot describe a DSV4 network (bad value, contradiction, unknown dialect)."""


#: Upper bounds of the size fields, checked before anything is built from a config (a size there
#: is allocated as a tensor dimension or a layer count). Each is well above DeepSeek-V4-Pro's
#: value (PEERS.md 1.1: vocab 129280, hidden 7168, 61 layers, 128 heads, head_dim 512, 384
#: experts, 1M positions) and far below what a typo or a hostile file asks for. `sliding_window`,
#: `index_topk` and the compression rates are bounded by `max_position_embeddings` instead.
SIZE_LIMITS: dict[str, int] = dict(
    vocab_size=1 << 22, hidden_size=1 << 16, num_hidden_layers=1024, num_attention_heads=1 << 12,
    head_dim=1 << 12, qk_rope_head_dim=1 << 12, q_lora_rank=1 << 16, o_groups=1 << 12, o_lora_rank=1 << 16,
    moe_intermediate_size=1 << 18, n_routed_experts=1 << 14, num_experts_per_tok=1 << 14,
    max_position_embeddings=1 << 24, hc_mult=64, hc_sinkhorn_iters=10_000, index_n_heads=1 << 12,
    index_head_dim=1 << 12)
#: rope parameters a config may carry (`mscale` / `mscale_all_dim` appear in official files and
#: are not applied: DSV4 has no rope magnitude factor); any other key is an error, never ignored
ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                       "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor",
                       "truncate"})
_YARN_ONLY = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")


def _int(v: Any, field: str) -> int:
    """A JSON integer (a bool, a float or a str is refused, not converted)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{field} must be an integer; got {v!r} ({type(v).__name__})")
    return v


def _num(v: Any, field: str) -> float:
    """A finite JSON number (int or float; a bool or a str is refused)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{field} must be a finite number; got {v!r} ({type(v).__name__})")
    return float(v)


def _list(v: Any, field: str) -> list:
    if not isinstance(v, (list, tuple)):
        raise ConfigError(f"{field} must be a list; got {type(v).__name__}")
    return list(v)


class RopeSpec(BaseModel):
    """One rope kind. `type="default"`: plain `theta^(-2i/d_r)`; `type="yarn"`: YaRN frequencies
    (SPEC.md rope section). The YaRN magnitude factor is never applied (attention_factor = 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    type: Literal["default", "yarn"] = "default"
    theta: float = Field(gt=0)
    factor: float | None = Field(default=None, gt=0)
    original_max_position_embeddings: int | None = Field(default=None, gt=0)
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    @model_validator(mode="after")
    def _yarn_needs_fields(self) -> "RopeSpec":
        if self.type == "yarn" and self.original_max_position_embeddings is None:
            raise ValueError("yarn rope needs 'original_max_position_embeddings'")
        return self


class DSV4Config(BaseModel):
    """Validated DSV4 hyper-parameters, in transformers' vocabulary (see module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = 1
    head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    q_lora_rank: int = Field(gt=0)
    o_groups: int = Field(gt=0)
    o_lora_rank: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    n_routed_experts: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = Field(default=10.0, gt=0)
    max_position_embeddings: int = Field(default=1048576, gt=0)
    sliding_window: int = Field(default=128, gt=0)
    layer_types: list[str]
    compress_rates: dict[str, int] = Field(default_factory=lambda: dict(DEFAULT_COMPRESS_RATES))
    mlp_layer_types: list[str]
    rope_main: RopeSpec
    rope_compress: RopeSpec
    hc_mult: int = Field(default=4, gt=0)
    hc_sinkhorn_iters: int = Field(default=20, gt=0)
    hc_eps: float = Field(default=1e-6, ge=0)
    index_n_heads: int = Field(default=64, gt=0)
    index_head_dim: int = Field(default=128, gt=0)
    index_topk: int = Field(default=512, gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    #: multi-token-prediction ("NextN") layers after the main ones (0 or 1; `mtp.0.*` weights)
    num_nextn_predict_layers: int = Field(default=0, ge=0, le=1)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None

    @field_validator("layer_types")
    @classmethod
    def _check_layer_types(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}; got {bad}")
        return v

    @field_validator("mlp_layer_types")
    @classmethod
    def _check_mlp_types(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if t not in MLP_LAYER_TYPES]
        if bad:
            raise ValueError(f"mlp_layer_types entries must be one of {MLP_LAYER_TYPES}; got {bad}")
        return v

    @model_validator(mode="after")
    def _check_consistency(self) -> "DSV4Config":
        L = self.num_hidden_layers
        errs: list[str] = []
        for name, hi in SIZE_LIMITS.items():
            v = getattr(self, name)
            if v > hi:
                errs.append(f"{name}={v} exceeds the limit {hi}")
        maxpos = self.max_position_embeddings
        for name in ("sliding_window", "index_topk"):
            if getattr(self, name) > maxpos:
                errs.append(f"{name}={getattr(self, name)} must be <= max_position_embeddings={maxpos}")
        for t, r in self.compress_rates.items():
            if isinstance(r, int) and r > maxpos:
                errs.append(f"compress_rates[{t!r}]={r} must be <= max_position_embeddings={maxpos}")
        if errs:     # sizes first: the checks below iterate over the schedule
            raise ValueError("; ".join(errs))
        if len(self.layer_types) != L:
            errs.append(f"len(layer_types)={len(self.layer_types)} != num_hidden_layers={L}")
        if len(self.mlp_layer_types) != L:
            errs.append(f"len(mlp_layer_types)={len(self.mlp_layer_types)} != num_hidden_layers={L}")
        if self.num_key_value_heads != 1:
            errs.append(f"num_key_value_heads must be 1 (shared-KV MQA); got {self.num_key_value_heads}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            errs.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= head_dim={self.head_dim}")
        if self.num_attention_heads % self.o_groups:
            errs.append(f"num_attention_heads={self.num_attention_heads} not divisible by o_groups={self.o_groups}")
        if self.num_experts_per_tok > self.n_routed_experts:
            errs.append(f"num_experts_per_tok={self.num_experts_per_tok} > n_routed_experts={self.n_routed_experts}")
        if self.n_shared_experts != 1:
            errs.append(f"n_shared_experts must be 1 (one shared expert of width moe_intermediate_size); "
                        f"got {self.n_shared_experts}")
        if self.scoring_func != "sqrtsoftplus":
            errs.append(f"scoring_func must be 'sqrtsoftplus'; got {self.scoring_func!r}")
        if self.tie_word_embeddings:
            errs.append("tie_word_embeddings=True is not supported (DSV4 has an untied lm_head)")
        for t in set(self.layer_types) - {SLIDING}:
            r = self.compress_rates.get(t)
            if r is None or int(r) < 1:
                errs.append(f"compress_rates[{t!r}] must be an int >= 1 for a model with {t} layers; got {r}")
        if CSA in self.layer_types and self.qk_rope_head_dim > self.index_head_dim:
            errs.append(f"qk_rope_head_dim={self.qk_rope_head_dim} > index_head_dim={self.index_head_dim}")
        if errs:
            raise ValueError("; ".join(errs))
        return self

    # ----------------------------------------------------------------- derived values
    def compress_ratio(self, layer: int) -> int:
        """0 for a sliding-only layer, else the layer type's compression rate m."""
        t = self.layer_types[layer]
        return 0 if t == SLIDING else int(self.compress_rates[t])

    def with_mtp_layer(self) -> "DSV4Config":
        """This config with the MTP block as one more layer (index `num_hidden_layers`): sliding-window
        attention only (the official `compress_ratios` entry for it is 0) and a top-k (non-hash)
        MoE. The MTP block and its state (one more layer of the cache) are built from it."""
        if not self.num_nextn_predict_layers:
            raise ValueError("with_mtp_layer: the config declares no MTP layer (num_nextn_predict_layers = 0)")
        return self.model_copy(update=dict(
            num_hidden_layers=self.num_hidden_layers + 1, layer_types=[*self.layer_types, SLIDING],
            mlp_layer_types=[*self.mlp_layer_types, MOE], num_nextn_predict_layers=0))

    def rope_kind(self, layer: int) -> str:
        """'main' for sliding-only layers, 'compress' for CSA / HCA layers (SPEC.md section 1)."""
        return "main" if self.layer_types[layer] == SLIDING else "compress"

    def inv_freq(self, kind: str, device: torch.device | str | None = None) -> torch.Tensor:
        """float32 [qk_rope_head_dim/2] inverse frequencies for rope `kind` ('main'/'compress')."""
        spec = {"main": self.rope_main, "compress": self.rope_compress}[kind]
        return rope_inv_freq(spec, self.qk_rope_head_dim, device=device)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DSV4Config":
        """Build from a transformers or official DeepSeek `config.json` dict. Raises ConfigError."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a dict; got {type(d).__name__}")
        mt = d.get("model_type")
        if mt is not None and mt != "deepseek_v4":
            raise ConfigError(f"config model_type is {mt!r}, expected 'deepseek_v4'")
        try:
            kw = _normalise(d)
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
            raise ConfigError(f"cannot read DSV4 config: {type(e).__name__}: {str(e)[:300]}") from None
        try:
            return cls(**kw)
        except ValidationError as e:
            raise ConfigError(f"invalid DSV4 config: {_validation_text(e)}") from None
        except RecursionError:
            raise ConfigError("invalid DSV4 config: a value is nested too deeply") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers `DeepseekV4Config` kwargs dict describing the same network."""
        def rope(spec: RopeSpec) -> dict[str, Any]:
            out: dict[str, Any] = {"rope_type": spec.type, "rope_theta": spec.theta,
                                   "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim}
            if spec.type == "yarn":
                out.update(factor=spec.factor, original_max_position_embeddings=spec.original_max_position_embeddings,
                           beta_fast=spec.beta_fast, beta_slow=spec.beta_slow, attention_factor=1.0)
            return out

        keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts",
                "num_experts_per_tok", "n_shared_experts", "scoring_func", "routed_scaling_factor", "swiglu_limit",
                "max_position_embeddings", "sliding_window", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
                "index_n_heads", "index_head_dim", "index_topk", "rms_norm_eps", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id")
        out = {k: getattr(self, k) for k in keys}
        if self.num_nextn_predict_layers:
            out["num_nextn_predict_layers"] = self.num_nextn_predict_layers
        out.update(model_type="deepseek_v4", layer_types=list(self.layer_types),
                   mlp_layer_types=list(self.mlp_layer_types), compress_rates=dict(self.compress_rates),
                   rope_theta=self.rope_main.theta, compress_rope_theta=self.rope_compress.theta,
                   partial_rotary_factor=self.qk_rope_head_dim / self.head_dim,
                   rope_parameters={"main": rope(self.rope_main), "compress": rope(self.rope_compress)})
        return out


# transformers DeepseekV4Config defaults (used when a key is absent, as transformers does)
_HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
    num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024, num_experts_per_tok=6,
    n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
    max_position_embeddings=1048576, rope_theta=10000.0, compress_rope_theta=160000.0, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024,
    index_n_heads=64, index_head_dim=128, index_topk=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, pad_token_id=None,
)
_PLAIN_KEYS = tuple(k for k in _HF_DEFAULTS if k not in ("rope_theta", "compress_rope_theta"))


def _validation_text(e: ValidationError) -> str:
    """One line per pydantic error: the field, what it expected, the value found."""
    out = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        out.append(f"{loc}: {msg} (got {reprlib.repr(err.get('input'))})" if loc else msg)
    return "; ".join(out)


def _normalise(d: dict[str, Any]) -> dict[str, Any]:
    """Map either config dialect onto DSV4Config's fields. Values this function computes with
    are type-checked and bounded here, before any list is built from them."""
    g = lambda k: d[k] if d.get(k) is not None else _HF_DEFAULTS.get(k)  # noqa: E731
    kw: dict[str, Any] = {k: g(k) for k in _PLAIN_KEYS}
    for k in ("num_hidden_layers", "head_dim", "max_position_embeddings"):
        v = _int(kw[k], k)
        if v <= 0 or v > SIZE_LIMITS[k]:
            raise ConfigError(f"{k} must be an integer in 1..{SIZE_LIMITS[k]}; got {v}")
    kw["num_nextn_predict_layers"] = _int(d.get("num_nextn_predict_layers") or 0, "num_nextn_predict_layers")
    n = kw["num_hidden_layers"]

    # --- compression rates and the attention schedule
    rates = dict(DEFAULT_COMPRESS_RATES)
    if d.get("compress_rates") is not None:
        if not isinstance(d["compress_rates"], dict):
            raise ConfigError(f"compress_rates must be an object of layer type -> rate; got "
                              f"{type(d['compress_rates']).__name__}")
        rates.update({k: _int(v, f"compress_rates[{k!r}]") for k, v in d["compress_rates"].items()})
    if d.get("compress_rate_csa") is not None:
        rates[CSA] = _int(d["compress_rate_csa"], "compress_rate_csa")
    if d.get("compress_rate_hca") is not None:
        rates[HCA] = _int(d["compress_rate_hca"], "compress_rate_hca")
    if d.get("layer_types") is not None:
        layer_types = _list(d["layer_types"], "layer_types")
    elif d.get("compress_ratios") is not None:
        ratios = [_int(r, "compress_ratios entries") for r in _list(d["compress_ratios"], "compress_ratios")]
        if len(ratios) < n:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries, fewer than num_hidden_layers={n}")
        nextn = d.get("num_nextn_predict_layers")
        nextn = 1 if nextn is None else _int(nextn, "num_nextn_predict_layers")
        if len(ratios) not in (n, n + nextn):
            raise ConfigError(f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers={n} "
                              f"(+ num_nextn_predict_layers={nextn} for the MTP block)")
        ratios = ratios[:n]  # the trailing entries belong to the MTP block
        layer_types = []
        hca_rates = set()
        for r in ratios:
            if r < 0:
                raise ConfigError(f"compress_ratios entries must be >= 0; got {r}")
            if r == 0:
                layer_types.append(SLIDING)
            elif r == rates[CSA]:
                layer_types.append(CSA)
            else:
                layer_types.append(HCA)
                hca_rates.add(r)
        if len(hca_rates) > 1:
            raise ConfigError(f"compress_ratios has several non-CSA ratios {sorted(hca_rates)}; "
                              f"only one HCA rate is supported (CSA rate is {rates[CSA]})")
        if hca_rates:
            rates[HCA] = hca_rates.pop()
    else:  # transformers' default schedule (2x HCA then HCA/CSA alternating, PEERS.md 1.3)
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    kw["layer_types"] = layer_types     # a list of another length is an error (validation), never cut
    kw["compress_rates"] = rates

    # --- MoE schedule
    if d.get("mlp_layer_types") is not None:
        kw["mlp_layer_types"] = _list(d["mlp_layer_types"], "mlp_layer_types")
    else:
        nh = d.get("num_hash_layers")
        nh = 3 if nh is None else _int(nh, "num_hash_layers")
        if nh < 0:
            raise ConfigError(f"num_hash_layers must be >= 0; got {nh}")
        kw["mlp_layer_types"] = [HASH_MOE] * min(n, nh) + [MOE] * max(0, n - nh)

    # --- rope
    head_dim = kw["head_dim"]
    rp = d.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"rope_parameters must be an object; got {type(rp).__name__}")
    nested = isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)
    if d.get("qk_rope_head_dim") is not None:
        rope_dim = _int(d["qk_rope_head_dim"], "qk_rope_head_dim")
    elif d.get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * _num(d["partial_rotary_factor"], "partial_rotary_factor"))
    elif nested and rp["main"].get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * _num(rp["main"]["partial_rotary_factor"],
                                       "rope_parameters['main'].partial_rotary_factor"))
    else:
        rope_dim = int(head_dim * 64 / 512)
    kw["qk_rope_head_dim"] = rope_dim
    if nested:
        extra = sorted(set(rp) - {"main", "compress"})
        if extra:
            raise ConfigError(f"rope_parameters: unknown keys {extra} beside 'main' and 'compress'")
        for kind in ("main", "compress"):
            prf = rp[kind].get("partial_rotary_factor")
            where = f"rope_parameters[{kind!r}].partial_rotary_factor"
            if prf is not None and int(head_dim * _num(prf, where)) != rope_dim:
                raise ConfigError(f"{where}={prf} gives a rope dim {int(head_dim * float(prf))} != {rope_dim}")
        kw["rope_main"] = _rope_spec(rp["main"], "rope_parameters['main']", None, d)
        kw["rope_compress"] = _rope_spec(rp["compress"], "rope_parameters['compress']", None, d)
    else:
        src = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        raw = d.get("rope_scaling") or {k: v for k, v in rp.items() if k not in ("main", "compress")}
        if not isinstance(raw, dict):
            raise ConfigError(f"{src} must be an object; got {type(raw).__name__}")
        flat = dict(raw)
        flat.pop("rope_theta", None)  # a flat dict's theta is the main one; compress uses compress_rope_theta
        main_theta = _num(g("rope_theta"), "rope_theta")
        kw["rope_main"] = RopeSpec(type="default", theta=main_theta)
        kw["rope_compress"] = _rope_spec(flat, src, _num(g("compress_rope_theta"), "compress_rope_theta"), d)
    return kw


def _rope_spec(p: dict[str, Any], where: str, theta: float | None, d: dict[str, Any]) -> RopeSpec:
    unknown = sorted(str(k) for k in set(p) - ROPE_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown rope parameters {unknown} (known: {sorted(ROPE_KEYS)})")
    rtype = p.get("rope_type", p.get("type", "default")) or "default"
    if rtype not in ("default", "yarn"):
        raise ConfigError(f"{where}: rope type {rtype!r} is not supported (only 'default' and 'yarn')")
    af = p.get("attention_factor")
    if af is not None and _num(af, f"{where}.attention_factor") != 1.0:
        raise ConfigError(f"{where}: attention_factor={af}; DSV4 applies no rope magnitude factor (must be 1.0)")
    if p.get("truncate") not in (None, True):
        raise ConfigError(f"{where}: truncate={p['truncate']!r}; DSV4's YaRN uses the floor/ceil (truncated) "
                          f"correction range (must be true)")
    # `mscale` / `mscale_all_dim` may appear in official files; DSV4 applies no magnitude factor.
    th = p.get("rope_theta", theta)
    if th is None:
        raise ConfigError(f"{where}: missing rope_theta")
    th = _num(th, f"{where}.rope_theta")
    if rtype == "default":
        given = [k for k in _YARN_ONLY if p.get(k) is not None]
        if given:
            raise ConfigError(f"{where}: {given} given for a 'default' rope (they apply to 'yarn' only)")
        return RopeSpec(type="default", theta=th)
    omax = p.get("original_max_position_embeddings")
    if omax is None:
        raise ConfigError(f"{where}: yarn rope needs original_max_position_embeddings")
    omax = _int(omax, f"{where}.original_max_position_embeddings")
    factor = p.get("factor")
    if factor is None:  # transformers' fallback
        factor = d.get("max_position_embeddings", _HF_DEFAULTS["max_position_embeddings"]) / float(omax)
    num = lambda k, default: default if p.get(k) is None else _num(p[k], f"{where}.{k}")  # noqa: E731
    return RopeSpec(type="yarn", theta=th, factor=_num(factor, f"{where}.factor"),
                    original_max_position_embeddings=omax, beta_fast=num("beta_fast", 32.0),
                    beta_slow=num("beta_slow", 1.0))


def rope_inv_freq(spec: RopeSpec, rope_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 inverse frequencies [rope_dim/2] of one rope kind (the HAL's `rope_frequencies`,
    SPEC.md rope section: bit-identical to transformers' default / YaRN initialisers)."""
    from dsv4core.hal.ops.rope import rope_frequencies

    if spec.type == "default":
        return rope_frequencies(rope_dim, spec.theta).to(device)
    return rope_frequencies(rope_dim, spec.theta, spec.factor, spec.original_max_position_embeddings,
                            spec.beta_fast, spec.beta_slow).to(device)
