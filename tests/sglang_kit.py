"""Helpers for the ``sglang`` tests: SGLang's registries saved and restored, the call log,
and SGLang's own MLA test kit (``sglang.test.kits.attention_unittest``) at our shapes.

Imported only by tests marked ``sglang``, from inside their fixtures and tests, so that the
main venv (no SGLang) collects them without importing SGLang.
"""

from __future__ import annotations

import os
import unittest
from collections import Counter

import torch

KV_LORA_RANK = 512
ROPE_DIM = 64
HIDDEN_SIZE = 64
#: Tokens per request slot of the kit's ``req_to_token`` pool: two 64-token pages.
MAX_CONTEXT_LEN = 128
#: Decode rows of ours vs SGLang's backends on the same fixture (fp32).
TOLERANCE = 1e-5


class SGLangState:
    """SGLang's process-wide plugin state, saved on creation and put back by ``restore``:
    the attention registry, the ``--attention-backend`` choices, the DeepSeek forward-method
    handlers and the plugin loader's once-per-process flag."""

    def __init__(self) -> None:
        import sglang.srt.plugins as plugins
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.models.deepseek_common.attention_backend_handler import (
            AttentionBackendRegistry,
        )

        self.plugins = plugins
        self.backends = ATTENTION_BACKENDS
        self.choices = ATTENTION_BACKEND_CHOICES
        self.handlers = AttentionBackendRegistry._handlers
        self._saved = (
            dict(self.backends),
            list(self.choices),
            dict(self.handlers),
            plugins._plugins_loaded,
        )
        plugins._plugins_loaded = False

    def restore(self) -> None:
        backends, choices, handlers, loaded = self._saved
        self.backends.clear()
        self.backends.update(backends)
        self.choices[:] = choices
        self.handlers.clear()
        self.handlers.update(handlers)
        self.plugins._plugins_loaded = loaded


def call_log(directory) -> Counter:
    """Every line our backend appended under ``directory`` (all processes), counted."""
    lines: Counter = Counter()
    for name in os.listdir(directory):
        with open(os.path.join(directory, name)) as log:
            lines.update(line.strip() for line in log if line.strip())
    return lines


def mla_case(backend: str, mode: str, *, heads: int, page: int, prefix, extend=()):
    """A kit ``MLAAttentionCase``; ``mode`` names a ``ForwardMode`` member."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
        MLAAttentionCase,
    )

    return MLAAttentionCase(
        name=f"{mode.lower()}_h{heads}_p{page}_{len(prefix)}",
        backend=backend,
        forward_mode=ForwardMode[mode],
        num_heads=heads,
        page_size=page,
        prefix_lens=tuple(prefix),
        extend_lens=tuple(extend),
    )


KIT_ARGS = {
    "kv_lora_rank": KV_LORA_RANK,
    "qk_rope_head_dim": ROPE_DIM,
    "hidden_size": HIDDEN_SIZE,
    "max_context_len": MAX_CONTEXT_LEN,
    "dtype": torch.float32,
    "device": "cpu",
}


def run_fixture(case, *, fp8: bool = False):
    """The kit's fixture for ``case`` run eagerly: ``(output, the kit's reference, fixture)``.
    Weights and inputs come from a seed of the case name, so two backends on cases of the
    same name see the same model, cache and tokens."""
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit

    fixture = kit.build_mla_attention_fixture(
        unittest.TestCase(), case, fp8_kv_cache=fp8, **KIT_ARGS
    )
    return kit.run_mla_fixture_eager(fixture), kit.expected_mla_fixture_output(fixture), fixture


def run_verify_fixture(case, *, topk: int):
    """The kit's EAGLE target-verify forward (its ``run_mla_eagle_verify_case`` steps) for
    ``case``: ``(output, the kit's masked reference, fixture)``."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit
    from sglang.test.kits.attention_unittest.runner_modes import (
        speculative_target_verify_runner as verify,
    )

    fixture = kit.build_mla_attention_fixture(unittest.TestCase(), case, **KIT_ARGS)
    batch = fixture.forward_batch
    verify._prepare_target_verify_batch(batch, case, "cpu")
    masks, _ = verify._make_custom_masks(case, topk=topk, device="cpu")
    batch.spec_info = verify._make_spec_verify_input(
        case, batch, topk=topk, device="cpu", spec_kind="eagle"
    )
    inputs = kit.mla_fixture_inputs(fixture)
    expected = kit.mla_attention_reference_with_custom_mask(
        fixture.reference_module, case, inputs["prefix_hidden"], inputs["input_hidden"], masks
    )
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fixture.backend)):
        fixture.backend.init_forward_metadata(batch)
        actual = kit.run_mla_forward(fixture, batch, inputs)
    return actual, expected, fixture
