"""Kimi-K3 / Kimi-Linear text model in plain PyTorch (PP stage + TP rank aware)."""

from rocm_mla.models.kimi_k3.config import KimiK3Config
from rocm_mla.models.kimi_k3.loader import CheckpointError, load_model, make_tiny
from rocm_mla.models.kimi_k3.metadata import ForwardMetadata
from rocm_mla.models.kimi_k3.model import KimiK3ForCausalLM, StageCaches, StageIO, pp_layer_range

__all__ = [
    "CheckpointError",
    "ForwardMetadata",
    "KimiK3Config",
    "KimiK3ForCausalLM",
    "StageCaches",
    "StageIO",
    "load_model",
    "make_tiny",
    "pp_layer_range",
]
