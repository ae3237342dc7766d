"""Text-model configuration for Kimi-K3 and Kimi-Linear, parsed from a checkpoint's config.json.

Kimi-K3 checkpoints (``model_type: kimi_k3``) keep the text model under ``text_config``;
Kimi-Linear checkpoints (``model_type: kimi_linear``) are flat. Both are read into one
``KimiK3Config``; the names transformers writes when it re-saves a checkpoint are accepted as
aliases of the released names.

Keys absent from config.json take these defaults (only configs that omit them are affected;
the released K3 config sets every one). K3 follows the released reading, i.e. the
``KimiLinearConfig`` class shipped with the K3 checkpoint (also vLLM's); Kimi-Linear follows
transformers' ``KimiLinearConfig``, the model that the parity tests compare against.

=====================  ===================================  =================================
key                    kimi_k3 (released config class)      kimi_linear (transformers)
=====================  ===================================  =================================
rms_norm_eps           1e-6                                 1e-5
intermediate_size      11008                                9216
num_shared_experts     0                                    1 (``n_shared_experts``)
first_k_dense_replace  0 (every layer MoE)                  1 (layer 0 dense)
mla_use_nope           False (RoPE on the rope dims)        True (transformers never rotates)
routed_scaling_factor  1.0                                  2.446
linear_attn_config     absent: no KDA layer (all MLA)       every 4th layer MLA (0-based i%4==0,
                                                            i>0), 32 heads x 128, conv 4
activation_situ_beta,  refused when ``hidden_act`` is       (SiLU: unused)
activation_situ_       "situ" (see below)
linear_beta
tie_word_embeddings    False (top level for K3)             False
logit_scale            1.0 (logits unscaled); [1e-6, 1e6]   1.0; [1e-6, 1e6] (see below)
quantization_config    absent: plain weights                absent: plain weights
=====================  ===================================  =================================

``logit_scale``, absent or not, must be a finite number in ``[1e-6, 1e6]``; anything else
is refused with that range. Upstream model configs that scale their logits do so by a small
factor (Kimi by none); 0 would make every logit equal and 1e308 overflow them, and either
would only show as garbage tokens.

The MLA latent norms (``q_a_layernorm``, ``kv_a_layernorm``) use ``rms_norm_eps`` for K3 (the
released reading) and transformers' fixed 1e-6 for Kimi-Linear (``latent_norm_eps`` overrides
both).

A SiTU config without its betas is refused rather than given a value: the released config
class defaults both to None, and vLLM reads that two ways, its dense/shared MLP as beta 1.0
with the up projection unclipped, while its fused-MoE kernels refuse a SiTU layer without
``activation_situ_beta``. No one reading would match every upstream path, and the released
K3 config sets both (4.0 / 25.0).

``moe_renormalize`` divides the chosen weights by their sum for every ``top_k``, 1 included
(a single routed weight becomes 1 before ``routed_scaling_factor``), as vLLM's
routers (grouped and biased top-k) and transformers' ``KimiLinear`` router do.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rocm_mla.models.kimi_k3.files import checkpoint_file, json_kind, read_json_object
from rocm_mla.models.kimi_k3.mxfp4 import GROUP_SIZE, parse_quantization_config

ARCHS = ("kimi_k3", "kimi_linear")
ATTENTION_TYPES = ("full_attention", "linear_attention")
MLP_TYPES = ("dense", "sparse")
HIDDEN_ACTS = ("silu", "situ")
EXPERT_QUANTS = (None, "mxfp4")
# transformers' KimiLinearRMSNorm default, used for Kimi-Linear's q_a / kv_a norms.
TRANSFORMERS_LATENT_NORM_EPS = 1e-6
# Absent-key defaults per arch; see the module docstring's table for the sources.
_ABSENT_DEFAULTS: dict[str, dict[str, Any]] = {
    "kimi_k3": {
        "rms_norm_eps": 1e-6,
        "intermediate_size": 11008,
        "num_shared_experts": 0,
        "mla_use_nope": False,
        "routed_scaling_factor": 1.0,
    },
    "kimi_linear": {
        "rms_norm_eps": 1e-5,
        "intermediate_size": 9216,
        "num_shared_experts": 1,
        "mla_use_nope": True,
        "routed_scaling_factor": 2.446,
    },
}
_FIRST_K_DENSE_DEFAULT = {"kimi_k3": 0, "kimi_linear": 1}

# released name -> names transformers may write instead (same meaning).
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_local_experts",),
    "num_experts_per_token": ("num_experts_per_tok",),
    "num_shared_experts": ("n_shared_experts",),
    "moe_renormalize": ("norm_topk_prob",),
    "max_position_embeddings": ("model_max_length",),
    "num_expert_group": ("n_group",),
}


@dataclass
class KimiK3Config:
    """One text model: layer pattern, MLA, KDA, MoE and Attention Residuals settings.

    ``layer_types[i]`` / ``mlp_layer_types[i]`` are per 0-based layer. ``q_lora_rank=None``
    means a plain ``q_proj``; ``routed_expert_hidden_size=None`` means experts in hidden space;
    ``attn_res_block_size=None`` means the ordinary residual add; ``kda_gate_lower_bound=None``
    selects the Kimi-Linear decay ``-exp(A_log) * softplus(u)``.
    """

    arch: str = "kimi_k3"
    vocab_size: int = 256
    hidden_size: int = 64
    num_hidden_layers: int = 9
    intermediate_size: int = 128
    rms_norm_eps: float = 1e-5
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # Multiplies the logits (vLLM's LogitsProcessor scale); a finite number in [1e-6, 1e6].
    logit_scale: float = 1.0
    # MLA
    num_attention_heads: int = 4
    q_lora_rank: int | None = 32
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    rope_theta: float = 10000.0
    # q_a / kv_a latent RMSNorm eps; None: the per-arch reading (``mla_latent_norm_eps``).
    latent_norm_eps: float | None = None
    # KDA
    kda_num_heads: int = 4
    kda_head_dim: int = 16
    kda_conv_size: int = 4
    kda_full_rank_gate: bool = True
    kda_gate_lower_bound: float | None = -5.0
    # MoE
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_shared_experts: int = 2
    moe_intermediate_size: int = 32
    routed_expert_hidden_size: int | None = 32
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    # Routed-expert weight format: None (plain) or "mxfp4" (compressed-tensors, packed).
    routed_expert_quant: str | None = None
    # Attention Residuals
    attn_res_block_size: int | None = 3
    num_nextn_predict_layers: int = 0
    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Types and ranges first: the defaults below build per-layer lists.
        _check_field_values({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if not self.layer_types:
            self.layer_types = _default_layer_types(self.num_hidden_layers)
        if not self.mlp_layer_types:
            self.mlp_layer_types = ["dense"] + ["sparse"] * (self.num_hidden_layers - 1)
        self.validate()

    # ---------------------------------------------------------------- derived sizes
    @property
    def qk_head_dim(self) -> int:
        """MLA query/key width per head, ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """One latent cache row: ``kv_lora_rank + qk_rope_head_dim`` (576 for K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale ``(nope + rope) ** -0.5``."""
        return self.qk_head_dim**-0.5

    @property
    def mla_latent_norm_eps(self) -> float:
        """Eps of the MLA latent norms: ``rms_norm_eps`` for K3 (the released reading: the
        reference serving engines use the checkpoint value), transformers' 1e-6 for
        Kimi-Linear (its ``KimiLinearRMSNorm`` default there); ``latent_norm_eps`` overrides.
        """
        if self.latent_norm_eps is not None:
            return self.latent_norm_eps
        if self.arch == "kimi_k3":
            return self.rms_norm_eps
        return TRANSFORMERS_LATENT_NORM_EPS

    def is_mla(self, layer: int) -> bool:
        """Whether 0-based ``layer`` is an MLA (full attention) layer, else KDA."""
        return self.layer_types[layer] == "full_attention"

    def is_moe(self, layer: int) -> bool:
        """Whether 0-based ``layer`` has a MoE block, else a dense MLP."""
        return self.mlp_layer_types[layer] == "sparse"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field."""
        n = self.num_hidden_layers
        _check(self.arch in ARCHS, "arch", f"one of {ARCHS}", self.arch)
        _check(
            self.hidden_act in HIDDEN_ACTS, "hidden_act", f"one of {HIDDEN_ACTS}", self.hidden_act
        )
        for name in ("layer_types", "mlp_layer_types"):
            value = getattr(self, name)
            _check(len(value) == n, name, f"{n} entries (num_hidden_layers)", len(value))
        _check(
            self.routed_expert_quant in EXPERT_QUANTS,
            "routed_expert_quant",
            f"one of {EXPERT_QUANTS}",
            self.routed_expert_quant,
        )
        if self.routed_expert_quant is not None:
            expert_in = self.routed_expert_hidden_size or self.hidden_size
            _check(
                expert_in % GROUP_SIZE == 0,
                "routed_expert_hidden_size" if self.routed_expert_hidden_size else "hidden_size",
                f"a multiple of the MXFP4 group size {GROUP_SIZE} (the routed experts' input)",
                expert_in,
            )
        bad = [t for t in self.layer_types if t not in ATTENTION_TYPES]
        _check(not bad, "layer_types", f"entries in {ATTENTION_TYPES}", bad)
        bad = [t for t in self.mlp_layer_types if t not in MLP_TYPES]
        _check(not bad, "mlp_layer_types", f"entries in {MLP_TYPES}", bad)
        _check(
            self.num_experts_per_token <= self.num_experts,
            "num_experts_per_token",
            f"<= num_experts ({self.num_experts})",
            self.num_experts_per_token,
        )
        _check(
            self.num_experts % self.num_expert_group == 0,
            "num_expert_group",
            f"a divisor of num_experts ({self.num_experts})",
            self.num_expert_group,
        )
        _check(
            1 <= self.topk_group <= self.num_expert_group,
            "topk_group",
            f"in [1, num_expert_group={self.num_expert_group}]",
            self.topk_group,
        )
        if self.attn_res_block_size is not None:
            _check(
                self.attn_res_block_size >= 1,
                "attn_res_block_size",
                ">= 1",
                self.attn_res_block_size,
            )
        if self.kda_gate_lower_bound is not None:
            _check(
                self.kda_gate_lower_bound < 0, "gate_lower_bound", "< 0", self.kda_gate_lower_bound
            )
        if not self.mla_use_nope:
            _check(
                self.qk_rope_head_dim % 2 == 0,
                "qk_rope_head_dim",
                "even for RoPE",
                self.qk_rope_head_dim,
            )

    def check_tp(self, tp_size: int) -> None:
        """Raise ``ValueError`` when a sharded dimension is not divisible by ``tp_size``.

        Only the dimensions of layers the model has count: an all-MoE config's (absent, hence
        default) ``intermediate_size`` shards nothing.
        """
        layers = range(self.num_hidden_layers)
        dims = {
            "num_attention_heads": (self.num_attention_heads, any(map(self.is_mla, layers))),
            "linear_attn_config.num_heads": (
                self.kda_num_heads,
                not all(map(self.is_mla, layers)),
            ),
            "intermediate_size": (self.intermediate_size, not all(map(self.is_moe, layers))),
            "moe_intermediate_size": (self.moe_intermediate_size, any(map(self.is_moe, layers))),
        }
        for name, (value, used) in dims.items():
            if used:
                _check(value % tp_size == 0, name, f"a multiple of tp_size={tp_size}", value)
        if self.routed_expert_quant is not None:
            local = self.moe_intermediate_size // tp_size
            _check(
                local % GROUP_SIZE == 0,
                "moe_intermediate_size",
                f"a multiple of tp_size * {GROUP_SIZE} (each rank's MXFP4 w2 input is whole "
                f"groups of {GROUP_SIZE}) for tp_size={tp_size}",
                self.moe_intermediate_size,
            )

    # ---------------------------------------------------------------- presets
    @classmethod
    def tiny(cls, arch: str = "kimi_k3") -> KimiK3Config:
        """Tiny config keeping every mechanism (reference notes section 10); tests use it."""
        if arch == "kimi_k3":
            types = ["linear_attention"] * 9
            for i in (3, 7, 8):  # 1-based [4, 8, 9]: K3's double-MLA tail
                types[i] = "full_attention"
            return cls(layer_types=types)
        if arch == "kimi_linear":
            types = ["linear_attention"] * 4
            types[3] = "full_attention"
            return cls(
                arch="kimi_linear",
                num_hidden_layers=4,
                hidden_act="silu",
                q_lora_rank=None,
                mla_use_output_gate=False,
                kda_full_rank_gate=False,
                kda_gate_lower_bound=None,
                num_shared_experts=1,
                routed_expert_hidden_size=None,
                routed_scaling_factor=2.446,
                attn_res_block_size=None,
                layer_types=types,
            )
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")

    @classmethod
    def small(cls) -> KimiK3Config:
        """Kimi-Linear benchmark config: hidden 1024, 8 layers, MLA at 1-based 4 and 8."""
        types = ["linear_attention"] * 8
        types[3] = types[7] = "full_attention"
        return cls(
            arch="kimi_linear",
            vocab_size=32000,
            hidden_size=1024,
            num_hidden_layers=8,
            intermediate_size=4096,
            hidden_act="silu",
            num_attention_heads=8,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            mla_use_output_gate=False,
            kda_num_heads=8,
            kda_head_dim=128,
            kda_full_rank_gate=False,
            kda_gate_lower_bound=None,
            num_experts=16,
            num_experts_per_token=2,
            num_shared_experts=1,
            moe_intermediate_size=512,
            routed_expert_hidden_size=None,
            routed_scaling_factor=2.446,
            attn_res_block_size=None,
            layer_types=types,
        )

    # ---------------------------------------------------------------- parsing
    @classmethod
    def from_pretrained(cls, path: str | Path) -> KimiK3Config:
        """Read ``config.json`` from a checkpoint directory (or the file itself)."""
        path = Path(path)
        file = checkpoint_file(path, "config.json") if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {file}")
        raw = read_json_object(file)
        try:
            return cls.from_dict(raw)
        except ValueError as err:
            raise ValueError(f"{file}: {err}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KimiK3Config:
        """Parse a config.json dict (K3 nested or Kimi-Linear flat). ValueError names the field.

        Structure is checked before use: objects where objects belong, lists of the right
        items, booleans as booleans; nothing is coerced.
        """
        _expect(isinstance(raw, dict), "config.json", "a JSON object", raw)
        model_type = raw.get("model_type")
        if model_type == "kimi_k3":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("text_config: a kimi_k3 config.json needs a text_config dict")
            arch = "kimi_k3"
        elif model_type == "kimi_linear":
            text, arch = raw, "kimi_linear"
        else:
            raise ValueError(f"model_type: expected 'kimi_k3' or 'kimi_linear', got {model_type!r}")
        text = _resolve_aliases(text)
        kwargs: dict[str, Any] = {"arch": arch}
        plain = {f.name for f in dataclasses.fields(cls)} - {
            "arch",
            "layer_types",
            "mlp_layer_types",
            "kda_num_heads",
            "kda_head_dim",
            "kda_conv_size",
            "kda_full_rank_gate",
            "kda_gate_lower_bound",
            "routed_expert_quant",
            "tie_word_embeddings",
        }
        for name in plain:
            if name in text:
                kwargs[name] = text[name]
        for name in ("num_attention_heads", "num_hidden_layers", "hidden_size", "vocab_size"):
            if name not in text:
                raise ValueError(f"{name}: missing from config.json")
        _check_field_values(kwargs)
        n = kwargs["num_hidden_layers"]
        # A K3 config without these keys means the released K3 defaults; Kimi-Linear never
        # has a gate, latent MoE or AttnRes.
        kwargs.setdefault("mla_use_output_gate", False)
        kwargs.setdefault("routed_expert_hidden_size", None)
        kwargs.setdefault("attn_res_block_size", None)
        kwargs.setdefault("q_lora_rank", None)
        kwargs.setdefault("hidden_act", "silu")
        kwargs.setdefault("latent_moe_use_norm", False)
        for name, value in _ABSENT_DEFAULTS[arch].items():
            kwargs.setdefault(name, value)
        if kwargs["hidden_act"] == "situ":
            for name in ("activation_situ_beta", "activation_situ_linear_beta"):
                if text.get(name) is None:
                    raise ValueError(
                        f"{name}: hidden_act 'situ' needs it (the released K3 config sets "
                        "4.0 / 25.0); it is missing or null"
                    )
        kwargs.update(_parse_top_level(raw, text, arch))
        if text.get("num_key_value_heads") not in (None, text["num_attention_heads"]):
            raise ValueError(
                f"num_key_value_heads: MLA needs it equal to num_attention_heads "
                f"({text['num_attention_heads']}), got {text['num_key_value_heads']}"
            )
        act = text.get("moe_router_activation_func", "sigmoid")
        _check(act == "sigmoid", "moe_router_activation_func", "'sigmoid'", act)
        method = text.get("topk_method", "noaux_tc")
        _check(method == "noaux_tc", "topk_method", "'noaux_tc'", method)
        kwargs.update(_parse_linear_attn(text, n))
        _check_field_values(kwargs)
        kwargs["layer_types"] = _parse_layer_types(text, n, arch)
        kwargs["mlp_layer_types"] = _parse_mlp_types(text, n, arch)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The released flat text-config form (1-based layer lists in ``linear_attn_config``)."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not f.name.startswith("kda_") and f.name not in ("arch", "layer_types")
        }
        out.pop("mlp_layer_types")
        out.pop("latent_norm_eps")
        out.pop("routed_expert_quant")  # written as the top-level quantization_config
        first_dense = sum(1 for t in self.mlp_layer_types if t == "dense")
        prefix = ["dense"] * first_dense + ["sparse"] * (self.num_hidden_layers - first_dense)
        if self.mlp_layer_types == prefix:
            out.update(first_k_dense_replace=first_dense, moe_layer_freq=1)
        else:
            out["mlp_layer_types"] = list(self.mlp_layer_types)
        out.update(
            model_type="kimi_linear",
            num_key_value_heads=self.num_attention_heads,
            moe_router_activation_func="sigmoid",
            linear_attn_config={
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.kda_conv_size,
                "use_full_rank_gate": self.kda_full_rank_gate,
                "gate_lower_bound": self.kda_gate_lower_bound,
                "full_attn_layers": [
                    i + 1 for i in range(self.num_hidden_layers) if self.is_mla(i)
                ],
                "kda_layers": [i + 1 for i in range(self.num_hidden_layers) if not self.is_mla(i)],
            },
        )
        return out


def _check(ok: bool, name: str, expected: str, got: Any) -> None:
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {got!r}")


def _expect(ok: bool, name: str, expected: str, value: Any) -> None:
    """``_check`` for a JSON value of the wrong kind: says which kind came (``a list of 2``)."""
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {json_kind(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _object(text: dict[str, Any], key: str) -> dict[str, Any]:
    """``text[key]`` as a JSON object; absent or null is an empty one."""
    value = text.get(key)
    if value is None:
        return {}
    _expect(isinstance(value, dict), key, "an object or null", value)
    return value


def _list(value: Any, key: str, items: str) -> list[Any]:
    _expect(isinstance(value, list), key, f"a list of {items}", value)
    return list(value)


# Inclusive bounds of integer fields: a generous margin over every released Kimi model, low
# enough that a typo (or a hostile file) fails here rather than in a terabyte allocation.
_INT_RANGES: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 2**24),
    "hidden_size": (1, 2**16),
    "num_hidden_layers": (1, 2**12),
    "intermediate_size": (1, 2**20),
    "max_position_embeddings": (1, 2**30),
    "num_attention_heads": (1, 2**12),
    "q_lora_rank": (1, 2**16),
    "kv_lora_rank": (1, 2**16),
    "qk_nope_head_dim": (0, 2**12),
    "qk_rope_head_dim": (0, 2**12),
    "v_head_dim": (1, 2**12),
    "kda_num_heads": (1, 2**12),
    "kda_head_dim": (1, 2**12),
    "kda_conv_size": (1, 2**8),
    "num_experts": (0, 2**16),
    "num_experts_per_token": (0, 2**10),
    "num_shared_experts": (0, 2**8),
    "moe_intermediate_size": (1, 2**20),
    "routed_expert_hidden_size": (1, 2**16),
    "num_expert_group": (1, 2**16),
    "topk_group": (1, 2**16),
    "attn_res_block_size": (1, 2**12),
    "num_nextn_predict_layers": (0, 2**8),
}
_POSITIVE_FLOATS = ("rms_norm_eps", "latent_norm_eps", "rope_theta")
# Inclusive bounds of float fields (``logit_scale``: see the module docstring).
_FLOAT_RANGES: dict[str, tuple[float, float]] = {"logit_scale": (1e-6, 1e6)}
# Field -> its name in config.json, where they differ.
_JSON_NAMES = {
    "kda_num_heads": "linear_attn_config.num_heads",
    "kda_head_dim": "linear_attn_config.head_dim",
    "kda_conv_size": "linear_attn_config.short_conv_kernel_size",
    "kda_full_rank_gate": "linear_attn_config.use_full_rank_gate",
    "kda_gate_lower_bound": "linear_attn_config.gate_lower_bound",
}


def _check_field_values(values: dict[str, Any]) -> None:
    """Type and range of each scalar field in ``values`` (by the dataclass annotation);
    ValueError naming the config.json key. Nothing is coerced: ``"64"`` is not 64."""
    kinds = {f.name: str(f.type) for f in dataclasses.fields(KimiK3Config)}
    for name, value in values.items():
        kind = kinds.get(name)
        if kind is None:
            continue
        key = _JSON_NAMES.get(name, name)
        optional = kind.endswith(" | None")
        base = kind.removesuffix(" | None")
        if value is None and optional:
            continue
        null = " or null" if optional else ""
        if base == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
            _check(ok, key, f"an int{null}", value)
            lo, hi = _INT_RANGES.get(name, (0, 2**31 - 1))
            _check(lo <= value <= hi, key, f"an int in [{lo}, {hi}]", value)
        elif base == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if name in _FLOAT_RANGES:
                lo, hi = _FLOAT_RANGES[name]
                ok = ok and math.isfinite(value) and lo <= value <= hi
                _check(ok, key, f"a finite number in [{lo:g}, {hi:g}]{null}", value)
            _check(ok and math.isfinite(value), key, f"a finite number{null}", value)
            if name in _POSITIVE_FLOATS:
                _check(value > 0, key, "a number > 0", value)
        elif base == "bool":
            _check(isinstance(value, bool), key, f"true or false{null}", value)
        elif base == "str":
            _check(isinstance(value, str), key, f"a string{null}", value)


def _default_layer_types(n: int) -> list[str]:
    # transformers' Kimi-Linear default: every 4th layer (0-based, not layer 0) is MLA.
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


def _resolve_aliases(text: dict[str, Any]) -> dict[str, Any]:
    text = dict(text)
    for name, aliases in _ALIASES.items():
        for alias in aliases:
            if alias not in text:
                continue
            if name in text and text[name] != text[alias]:
                raise ValueError(
                    f"{name}: contradicts its alias {alias} ({text[name]!r} vs {text[alias]!r})"
                )
            text[name] = text.pop(alias)
    return text


def _parse_linear_attn(text: dict[str, Any], n: int) -> dict[str, Any]:
    lac = _object(text, "linear_attn_config")
    out: dict[str, Any] = {
        "kda_num_heads": lac.get("num_heads", text.get("linear_num_heads", 32)),
        "kda_head_dim": lac.get("head_dim", text.get("linear_head_dim", 128)),
        "kda_conv_size": lac.get("short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4)),
        "kda_full_rank_gate": lac.get("use_full_rank_gate", False),
        "kda_gate_lower_bound": lac.get("gate_lower_bound"),
    }
    for key, top in (
        ("num_heads", "linear_num_heads"),
        ("head_dim", "linear_head_dim"),
        ("short_conv_kernel_size", "linear_conv_kernel_dim"),
    ):
        if key in lac and top in text and lac[key] != text[top]:
            raise ValueError(
                f"linear_attn_config.{key}: contradicts {top} ({lac[key]!r} vs {text[top]!r})"
            )
    return out


def _parse_top_level(raw: dict[str, Any], text: dict[str, Any], arch: str) -> dict[str, Any]:
    """``tie_word_embeddings`` and ``quantization_config``: top-level keys of a K3 config.json
    (the composite model's), also accepted inside ``text_config`` when they agree."""
    out: dict[str, Any] = {}
    for name in ("tie_word_embeddings", "quantization_config"):
        values = [src[name] for src in (raw, text) if name in src]
        if len(values) == 2 and values[0] != values[1]:
            raise ValueError(
                f"{name}: the top-level value contradicts text_config's "
                f"({values[0]!r} vs {values[1]!r})"
            )
        if not values:
            continue
        if name == "tie_word_embeddings":
            _check(isinstance(values[0], bool), name, "true or false", values[0])
            out[name] = values[0]
        else:
            out["routed_expert_quant"] = parse_quantization_config(values[0])
    return out


def _parse_layer_types(text: dict[str, Any], n: int, arch: str = "kimi_linear") -> list[str]:
    lac = _object(text, "linear_attn_config")
    from_lists = None
    if "full_attn_layers" in lac or "kda_layers" in lac:
        full, kda = (
            _list(lac.get(name, []), f"linear_attn_config.{name}", "1-based layer numbers")
            for name in ("full_attn_layers", "kda_layers")
        )
        for name, values in (("full_attn_layers", full), ("kda_layers", kda)):
            bad = [v for v in values if not (_is_int(v) and 1 <= v <= n)]
            _check(not bad, f"linear_attn_config.{name}", f"1-based layer numbers in [1, {n}]", bad)
        both = sorted(set(full) & set(kda))
        _check(not both, "linear_attn_config.kda_layers", "no layer also in full_attn_layers", both)
        missing = sorted(set(range(1, n + 1)) - set(full) - set(kda))
        if "full_attn_layers" in lac and "kda_layers" in lac:
            _check(
                not missing,
                "linear_attn_config.kda_layers",
                "every layer in full_attn_layers or kda_layers",
                f"layers {missing} in neither",
            )
        elif "kda_layers" in lac:
            full = missing  # only the KDA list given: every other layer is MLA
        from_lists = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    given = text.get("layer_types")
    if given is not None:
        given = _list(given, "layer_types", f"layer types {ATTENTION_TYPES}")
        if from_lists is not None and given != from_lists:
            raise ValueError(
                "layer_types: contradicts linear_attn_config.full_attn_layers/kda_layers "
                f"({given} vs {from_lists})"
            )
        return given
    if from_lists is not None:
        return from_lists
    if arch == "kimi_k3":
        return ["full_attention"] * n  # the released reading: no linear_attn_config, no KDA
    return _default_layer_types(n)


def _parse_mlp_types(text: dict[str, Any], n: int, arch: str = "kimi_linear") -> list[str]:
    freq = text.get("moe_layer_freq", 1)
    _check(_is_int(freq) and freq >= 1, "moe_layer_freq", "an int >= 1", freq)
    first = text.get("first_k_dense_replace")
    if first is None and arch == "kimi_k3" and text.get("mlp_layer_types") is None:
        first = _FIRST_K_DENSE_DEFAULT[arch]
    derived = None
    if first is not None:
        _check(
            _is_int(first) and 0 <= first <= n,
            "first_k_dense_replace",
            f"in [0, {n}]",
            first,
        )
        derived = ["sparse" if i >= first and i % freq == 0 else "dense" for i in range(n)]
    given = text.get("mlp_layer_types")
    if given is not None:
        given = _list(given, "mlp_layer_types", f"MLP types {MLP_TYPES}")
        if derived is not None and given != derived:
            raise ValueError(
                "mlp_layer_types: contradicts first_k_dense_replace/moe_layer_freq "
                f"({given} vs {derived})"
            )
        return given
    if derived is not None:
        return derived
    return ["dense"] + ["sparse"] * (n - 1)  # transformers: first_k_dense_replace 1
