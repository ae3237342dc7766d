"""Helpers for the ``sglang`` tests: SGLang's registries saved and restored, the call log,
and SGLang's own MLA test kit (``sglang.test.kits.attention_unittest``) at our shapes.

Imported only by tests marked ``sglang``, from inside their fixtures and tests, so that the
main venv (no SGLang) collects them without importing SGLang.
"""

from __future__ import annotations

import dataclasses
import os
import unittest
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

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


# ---- decode context parallelism ------------------------------------------------------------

#: DCP ranks the DCP tests run (gloo processes on the CPU).
DCP_WORLD = 2
#: DCP-2 attention rows against DCP-1's on the same fixture (fp32: the LSE merge sums the
#: shards' partials in another order than one pass over all keys).
DCP_TOLERANCE = 1e-5


@dataclass(frozen=True)
class DcpCase:
    """One decode step of SGLang's MLA kit under DCP.

    ``slot`` is the SGLang backend name our backend serves (``rocm_mla``: the named backend,
    whose LSE SGLang's merge reads in base 2; ``aiter``: the drop-in's ROCm slot, natural log).
    ``writer`` is who writes the step's new KV rows: ``layer`` (SGLang's ROCm DCP path and the
    kit's own layer write them, then call the backend with ``save_kv_cache=False``), ``split``
    (SGLang's ``forward_mla``: the backend writes them from ``k`` and ``k_rope``) or ``row``
    (the backend writes whole latent rows ``k``).
    """

    rocm_backend: str
    mode: str
    page: int
    heads: int
    prefix: tuple[int, ...]
    window: int = 1
    slot: str = "rocm_mla"
    writer: str = "layer"

    @property
    def name(self) -> str:
        return (
            f"dcp_{self.rocm_backend}_{self.mode.lower()}_w{self.window}_p{self.page}"
            f"_h{self.heads}_{self.slot}_{self.writer}"
        )

    def kit_case(self):
        extend = (self.window,) * len(self.prefix) if self.mode == "TARGET_VERIFY" else ()
        case = mla_case(
            "rocm_mla",
            self.mode,
            heads=self.heads,
            page=self.page,
            prefix=self.prefix,
            extend=extend,
        )
        return dataclasses.replace(case, name=self.name)


def import_kit() -> None:
    """Load the kit modules the DCP helpers use. Call it before any parallel override: each
    of them enters an override of its own when it loads (``attn_tp_size`` 1, ``attn_dcp_rank``
    0), which would otherwise sit on top of the caller's."""
    from sglang.test.kits.attention_unittest.attention_methods import (  # noqa: F401
        dense_attention,
        mla_attention,
    )
    from sglang.test.kits.attention_unittest.runner_modes import (  # noqa: F401
        speculative_target_verify_runner,
    )


def dcp_runner(case, world: int):
    """The kit's mock model runner for ``case`` with SGLang's DCP allocator: pages of
    ``page_size * world`` KV ids (``kv_cache_configurator``'s DCP branch), the pool and the
    runner keeping the physical ``page_size``."""
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit

    config = kit.TinyMLAModelConfig(
        num_heads=case.num_heads,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        hidden_size=HIDDEN_SIZE,
        context_len=MAX_CONTEXT_LEN,
    )
    runner = kit.MockMLAModelRunner(
        case=case,
        model_config=config,
        dtype=torch.float32,
        device="cpu",
        max_context_len=MAX_CONTEXT_LEN,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
    )
    runner.token_to_kv_pool_allocator = SimpleNamespace(page_size=case.page_size * world)
    return runner


def dcp_backend(runner, slot: str):
    """Our backend as SGLang builds it for ``slot``: by name, or as the drop-in over the slot
    (its extend is SGLang's ``torch_native`` here, the one that runs on the CPU)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from rocm_mla.integrations.sglang import plugin

    if slot == plugin.BACKEND_NAME:
        return plugin._named_factory(runner)
    torch_native = ATTENTION_BACKENDS["torch_native"]
    return plugin._drop_in_factory(slot, getattr(torch_native, "rocm_mla_original", torch_native))(
        runner
    )


def dcp_fixture(dcp_case: DcpCase, world: int):
    """SGLang's MLA kit fixture for ``dcp_case`` as DCP rank ``get_parallel().attn_dcp_rank``
    of ``world`` holds it: ``req_to_token`` of striped KV ids (the kit's shuffled pages, in
    pages of ``page_size * world`` ids) and this rank's share of the prefix KV in its pool.
    The weights and inputs come from a seed of the case name, so every rank and the DCP-1
    run see the same model, cache and tokens. Call under the parallel overrides of the rank.
    """
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit
    from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (
        make_loc_fn,
    )
    from sglang.test.kits.attention_unittest.runner_modes import (
        speculative_target_verify_runner as verify,
    )

    case = dcp_case.kit_case()
    seed = 3090 + len(case.name)
    torch.manual_seed(seed)
    runner = dcp_runner(case, world)
    backend = dcp_backend(runner, dcp_case.slot)
    common = dict(
        hidden_size=HIDDEN_SIZE,
        num_heads=case.num_heads,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        dtype=torch.float32,
        device="cpu",
    )
    module = kit.TinyDeepseekMLAAttention(**common)
    reference = kit.ReferenceDeepseekMLAAttention(**common)
    kit._copy_mla_weights(module, reference)
    prefix_hidden = [torch.randn(n, HIDDEN_SIZE) for n in case.prefix_lens]
    input_hidden = torch.randn(case.num_input_tokens, HIDDEN_SIZE)
    loc_fn = make_loc_fn(
        "shuffled_pages",
        batch_size=case.batch_size,
        seq_lens=case.seq_lens,
        prefix_lens=case.prefix_lens,
        page_size=case.page_size * world,
        max_context_len=MAX_CONTEXT_LEN,
        seed=seed,
    )
    batch = kit._make_forward_batch(
        case, runner, max_context_len=MAX_CONTEXT_LEN, device="cpu", loc_fn=loc_fn
    )
    kit._populate_prefix_kv(
        module,
        case,
        runner,
        backend,
        prefix_hidden,
        max_context_len=MAX_CONTEXT_LEN,
        loc_fn=loc_fn,
    )
    if dcp_case.mode == "TARGET_VERIFY":
        verify._prepare_target_verify_batch(batch, case, "cpu")
        batch.spec_info = verify._make_spec_verify_input(
            case, batch, topk=1, device="cpu", spec_kind="eagle"
        )
    return kit.MLAAttentionFixture(
        case=case,
        runner=runner,
        backend=backend,
        actual_module=module,
        reference_module=reference,
        forward_batch=batch,
        prefix_hidden=prefix_hidden,
        input_hidden=input_hidden,
    )


def dcp_attention(fixture, dcp_case: DcpCase, world: int) -> torch.Tensor:
    """One step of the kit's MLA layer as SGLang's DeepSeek layer runs it under DCP
    (``forward_mla``'s absorbed core): this rank's TP shard of the query heads, gathered over
    the DCP group (``all_gather_q_for_mla_decode``), the backend over ``attn_mqa_for_dcp_decode``
    (a ``RadixAttention`` of the gathered heads) returning ``(out, lse)``, and SGLang's merge
    (``cp_lse_ag_out_rs_mla``, LSE base by the slot's name). With ``world`` 1 the plain layer.

    Returns:
        ``[T, H / world, kv_lora_rank]``: the attention rows of this rank's heads.
    """
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.runtime_context import get_parallel

    module, batch = fixture.actual_module, fixture.forward_batch
    heads = module.num_heads // world
    rank = get_parallel().attn_dcp_rank if world > 1 else 0
    mine = slice(rank * heads, (rank + 1) * heads)
    layer = RadixAttention(
        heads * world,
        KV_LORA_RANK + ROPE_DIM,
        module.attn_mqa.scaling,
        num_kv_heads=1,
        layer_id=0,
        v_head_dim=KV_LORA_RANK,
    )
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fixture.backend)):
        fixture.backend.init_forward_metadata(batch)
        q_nope, k_nope, q_rope, k_rope = module.forward_absorb_prepare(fixture.input_hidden)
        q_nope, q_rope = q_nope[:, mine].contiguous(), q_rope[:, mine].contiguous()
        if world > 1:
            from sglang.srt.layers.dcp import all_gather_q_for_mla_decode

            q_nope, q_rope = all_gather_q_for_mla_decode(q_nope, q_rope)
        if dcp_case.writer == "split":
            result = layer(q_nope, k_nope, k_nope, batch, q_rope=q_rope, k_rope=k_rope)
        elif dcp_case.writer == "row":
            q, k = torch.cat([q_nope, q_rope], dim=-1), torch.cat([k_nope, k_rope], dim=-1)
            result = layer(q, k, k_nope, batch)
        else:
            module.write_kv_cache(batch.out_cache_loc, k_nope, k_rope)
            q = torch.cat([q_nope, q_rope], dim=-1)
            result = layer(q, None, None, batch, save_kv_cache=False)
        if world == 1:
            return result.view(-1, heads, KV_LORA_RANK)
        from sglang.srt.layers.dcp import cp_lse_ag_out_rs_mla
        from sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla import (
            is_mla_dcp_lse_base_on_e,
        )

        out, lse = result
        merged = cp_lse_ag_out_rs_mla(
            out.view(-1, heads * world, KV_LORA_RANK),
            lse,
            get_parallel().dcp_group,
            is_lse_base_on_e=is_mla_dcp_lse_base_on_e(dcp_case.slot),
        )
        return merged.transpose(0, 1)


def dcp_rank_main(state, cases: list[DcpCase], log_dir: str) -> dict[str, torch.Tensor]:
    """One DCP rank under ``rocm_mla.distributed.launch`` (gloo): SGLang's DCP group over the
    world (also its TP group: TP = DCP = world), the rank's parallel state, then
    ``dcp_attention`` of every case with our call log in ``log_dir``.

    Returns:
        ``{case name: [T, H / world, kv_lora_rank]}``.
    """
    import sglang.srt.distributed.parallel_state as parallel_state
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.runtime_context import get_parallel

    import_kit()

    # SGLang's collectives take their CPU path (torch.distributed on the group) only on its
    # CPU engine; elsewhere they are custom ops registered for the GPU alone.
    parallel_state._is_cpu = True
    world, rank = state.layout.dcp, state.dcp_rank
    group = GroupCoordinator(
        [list(range(world))],
        0,
        "gloo",
        use_pynccl=False,
        use_mscclpp=False,
        use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False,
        use_hpu_communicator=False,
        use_xpu_communicator=False,
        group_name="dcp",
    )
    os.environ["ROCM_MLA_SGLANG_CALL_LOG"] = log_dir
    results = {}
    for case in cases:
        os.environ["ROCM_MLA_BACKEND"] = case.rocm_backend
        with get_parallel().override(
            tp_size=world,
            tp_group=group,
            attn_tp_size=world,
            moe_tp_size=world,
            dcp_size=world,
            dcp_rank=rank,
            dcp_enabled=True,
            attn_dcp_size=world,
            attn_dcp_rank=rank,
            dcp_group=group,
        ):
            fixture = dcp_fixture(case, world)
            results[case.name] = dcp_attention(fixture, case, world)
    return results
