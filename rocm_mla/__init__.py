"""rocm-mla: AMD-first MLA decode behind one context-parallel normalization contract.

Architecture (layers, data flow, contracts): docs/architecture.md.
"""

from rocm_mla.api import (
    FAULT_BEYOND_PLAN,
    FAULT_BEYOND_TABLE,
    FAULT_BLOCK_ID,
    FAULT_NEGATIVE_LENGTH,
    FAULT_ROW_BOUND,
    DecodePlan,
    KVBoundsError,
    available_backends,
    merge_states,
    mla_decode,
    plan_decode,
    plan_schedule,
    raise_on_fault,
    replan_decode,
)
from rocm_mla.contract import normalize_cp

__version__ = "0.1.0"

__all__ = [
    "FAULT_BEYOND_PLAN",
    "FAULT_BEYOND_TABLE",
    "FAULT_BLOCK_ID",
    "FAULT_NEGATIVE_LENGTH",
    "FAULT_ROW_BOUND",
    "LLM",
    "DecodePlan",
    "KVBoundsError",
    "__version__",
    "available_backends",
    "merge_states",
    "mla_decode",
    "normalize_cp",
    "plan_decode",
    "plan_schedule",
    "raise_on_fault",
    "replan_decode",
]


def __getattr__(name: str):
    # The engine (models, torch.distributed, multiprocessing) loads on first use of LLM, so
    # `import rocm_mla` stays light for kernel users.
    if name == "LLM":
        from rocm_mla.engine import LLM

        return LLM
    raise AttributeError(f"module 'rocm_mla' has no attribute {name!r}")
