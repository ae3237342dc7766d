"""rocm-mla: AMD-first MLA decode behind one context-parallel normalization contract."""

from rocm_mla.api import available_backends, merge_states, mla_decode
from rocm_mla.contract import normalize_cp

__version__ = "0.1.0"

__all__ = ["__version__", "available_backends", "merge_states", "mla_decode", "normalize_cp"]
