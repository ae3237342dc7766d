"""SGLang general plugin: puts rocm_mla's MLA decode under SGLang's attention registry.

SGLang runs every ``sglang.srt.plugins`` entry point (filtered by ``SGLANG_PLUGINS``) in each
process it starts, once per process, and only logs a plugin that raises. So :func:`register`
is re-entrant and never refuses anything itself: a backend that cannot run is refused by
the factory it registers, when the model runner builds its attention backend (start-up).
Nothing here imports SGLang, torch or aiter until SGLang calls it.

Environment:
    ``ROCM_MLA_DISABLE=1``: register nothing (SGLang runs exactly as without this package).
    ``ROCM_MLA_BACKEND=auto|aiter|triton|torch``: when set, also take over the MLA backends
    SGLang picks on its own (:data:`DROP_IN_BACKENDS`) for MLA models: decode is ours, extend
    stays the replaced backend's. Unset, only ``--attention-backend rocm_mla`` selects it.

Tested with SGLang 0.5.23 (``integrations.common.SGLANG``). Under another release
registration first checks what the plugin and backend need (:data:`NEEDS`,
``common.check_release``) and logs one line: it registers when that holds, and otherwise
registers nothing, so SGLang's own backends serve.
"""

from __future__ import annotations

import logging
import os

from rocm_mla.integrations.common import (
    BACKEND_ENV,
    DISABLE_ENV,
    SGLANG,
    check_release,
    plugin_disabled,
)

#: The name ``--attention-backend`` selects.
BACKEND_NAME = "rocm_mla"
#: SGLang 0.5.23 backend names whose MLA runners the drop-in takes over (read from
#: ``srt/server_args.py``'s defaults and ``attention_registry.py``): ROCm ``aiter`` (MLA
#: with 16 or 128 heads per rank) and ``triton`` (every other head count); CUDA
#: ``flashinfer``, ``flashmla``, ``trtllm_mla``, ``cutedsl_mla``, ``fa3``, ``fa4`` (and
#: ``triton``); CPU ``torch_native`` and ``intel_amx``. A runner that is not MLA
#: (``runner.use_mla_backend`` false) still gets the original backend. Names an installed
#: SGLang lacks are skipped.
DROP_IN_BACKENDS = (
    "aiter",
    "triton",
    "flashinfer",
    "flashmla",
    "trtllm_mla",
    "cutedsl_mla",
    "fa3",
    "fa4",
    "torch_native",
    "intel_amx",
)

#: What registration and the backend import from SGLang, checked under an untested release.
NEEDS = {
    "sglang.srt.arg_groups.choices": ("ATTENTION_BACKEND_CHOICES", "add_attention_backend_choices"),
    "sglang.srt.layers.attention.attention_registry": (
        "ATTENTION_BACKENDS",
        "register_attention_backend",
    ),
    "sglang.srt.models.deepseek_common.attention_backend_handler": ("AttentionBackendRegistry",),
    "rocm_mla.integrations.sglang.backend": (
        "RocmMLAAttnBackend",
        "platform_prefill_backend",
        "prefill_name_of",
    ),
}

# Under "sglang." so the line goes through SGLang's handlers and log level.
logger = logging.getLogger("sglang.srt.plugins.rocm_mla")


def _named_factory(runner):
    """``--attention-backend rocm_mla``: our decode, SGLang's own backend for the platform
    (``backend.platform_prefill_backend``) for everything else."""
    from rocm_mla.integrations.sglang.backend import RocmMLAAttnBackend, platform_prefill_backend

    prefill_name = platform_prefill_backend(runner)
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    factory = ATTENTION_BACKENDS[prefill_name]
    prefill = getattr(factory, "rocm_mla_original", factory)(runner)
    return RocmMLAAttnBackend(
        runner, name=BACKEND_NAME, prefill_backend=prefill, prefill_name=prefill_name
    )


def _drop_in_factory(name: str, original):
    """A factory for SGLang backend ``name``: MLA runners get our decode over ``original``'s
    backend (which keeps extend), other runners ``original``'s backend unchanged."""

    def factory(runner):
        prefill = original(runner)
        if not runner.use_mla_backend:
            return prefill
        from rocm_mla.integrations.sglang.backend import RocmMLAAttnBackend

        return RocmMLAAttnBackend(runner, name=name, prefill_backend=prefill, prefill_name=name)

    factory.rocm_mla_original = original
    return factory


def _named_handler(attn, forward_batch):
    """The DeepSeek forward-method choice under the name ``rocm_mla``: the one SGLang makes
    for the backend our extend is delegated to (its ``AttentionBackendRegistry`` handler)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )

    from rocm_mla.integrations.sglang.backend import prefill_name_of

    return AttentionBackendRegistry.get_handler(prefill_name_of(forward_batch))(attn, forward_batch)


def register() -> list[str]:
    """Register the rocm-mla MLA backend with SGLang; returns the backend names it now backs.

    Always ``rocm_mla`` (the attention registry, the ``--attention-backend`` choices and the
    DeepSeek models' forward-method registry); plus the :data:`DROP_IN_BACKENDS` this SGLang
    has when ``ROCM_MLA_BACKEND`` is non-empty; nothing when ``ROCM_MLA_DISABLE`` is set, or
    when this SGLang is not a tested release and lacks what the backend needs (one line
    logged). Calling it again changes nothing.

    Raises:
        ValueError: ``ROCM_MLA_DISABLE`` is not a boolean (SGLang logs it and loads no
            rocm-mla backend).
    """
    if plugin_disabled():
        logger.info("rocm-mla: %s is set, registering no SGLang attention backend", DISABLE_ENV)
        return []
    if not check_release(SGLANG, NEEDS, logger):
        return []

    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )

    register_attention_backend(BACKEND_NAME)(_named_factory)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    AttentionBackendRegistry.register(BACKEND_NAME, _named_handler)
    names = [BACKEND_NAME]

    # The name is checked when a runner builds the backend: SGLang would only log a
    # ValueError raised here and start without us.
    requested = os.environ.get(BACKEND_ENV, "").strip()
    if requested:
        for name in DROP_IN_BACKENDS:
            factory = ATTENTION_BACKENDS.get(name)
            if factory is None:
                continue
            original = getattr(factory, "rocm_mla_original", factory)
            register_attention_backend(name)(_drop_in_factory(name, original))
            names.append(name)
    logger.info(
        "rocm-mla: SGLang attention backend%s %s -> rocm-mla MLA decode (%s=%s)",
        "s" if len(names) > 1 else "",
        ", ".join(names),
        BACKEND_ENV,
        requested or "unset: select it with --attention-backend rocm_mla",
    )
    return names
