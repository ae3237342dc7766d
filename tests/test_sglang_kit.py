"""SGLang's own MLA test kit (``sglang/test/kits/attention_unittest``, SGLang 0.5.23) driven
against our backend (``make test-sglang``, its own venv, CPU).

The kit builds a tiny DeepSeek MLA layer over SGLang's real KV pools (``MLATokenToKVPool``,
``ReqToTokenPool``; shuffled pages by default) and checks a backend against its float
reference. Here, at kv_lora_rank 512 and rope 64 in fp32: our decode (torch and the Triton
interpreter) passes the kit's own check and equals SGLang's ``torch_native`` and ``triton``
(interpreter) decode rows to 1e-5 on the same fixture, for page sizes 1/16/32/64 and
12/16/128 heads; fp8 caches; linear verify windows (EAGLE, topk 1) through our kernel and
tree verify delegated; the kit's graph-capture metadata run (capture, then replay from the
persistent buffers); extend delegated to SGLang's backend; the drop-in in SGLang's own
backend slots. Our call log proves which kernel ran.
"""

from __future__ import annotations

import unittest

import pytest
import torch

from tests.sglang_kit import TOLERANCE, call_log, mla_case, run_fixture, run_verify_fixture

pytestmark = pytest.mark.sglang

#: Requests' cached lengths before the decoded token: a page edge, a long one, a short one.
PREFIX = (15, 63, 100)


@pytest.fixture
def kit_env(monkeypatch, tmp_path):
    """Our plugin registered (named backend only) and the call log on; restored after."""
    from rocm_mla.integrations.sglang import plugin
    from tests.sglang_kit import SGLangState

    for var in ("ROCM_MLA_BACKEND", "ROCM_MLA_DISABLE", "SGLANG_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ROCM_MLA_SGLANG_CALL_LOG", str(tmp_path))
    state = SGLangState()
    plugin.register()
    yield tmp_path
    state.restore()


def _close(actual, expected, atol=TOLERANCE):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=TOLERANCE)


def _kit_check(actual, expected):
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
        MLA_ATOL,
        MLA_RTOL,
    )

    torch.testing.assert_close(actual, expected, atol=MLA_ATOL, rtol=MLA_RTOL)


@pytest.mark.parametrize("heads", [12, 16, 128])
@pytest.mark.parametrize("page", [1, 16, 32, 64])
def test_decode_torch_equals_torch_native(kit_env, monkeypatch, page, heads):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    ours, expected, _ = run_fixture(
        mla_case("rocm_mla", "DECODE", heads=heads, page=page, prefix=PREFIX)
    )
    theirs, _, _ = run_fixture(
        mla_case("torch_native", "DECODE", heads=heads, page=page, prefix=PREFIX)
    )
    _kit_check(ours, expected)
    _close(ours, theirs)
    assert call_log(kit_env) == {f"decode torch {len(PREFIX)} 1 DECODE": 1}


@pytest.mark.parametrize(("page", "heads"), [(1, 16), (16, 12), (32, 128), (64, 16)])
def test_decode_triton_equals_sglang_triton(kit_env, monkeypatch, page, heads):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "triton")
    ours, expected, _ = run_fixture(
        mla_case("rocm_mla", "DECODE", heads=heads, page=page, prefix=PREFIX)
    )
    theirs, _, _ = run_fixture(mla_case("triton", "DECODE", heads=heads, page=page, prefix=PREFIX))
    _kit_check(ours, expected)
    _close(ours, theirs)
    assert call_log(kit_env) == {f"decode triton {len(PREFIX)} 1 DECODE": 1}


@pytest.mark.parametrize("rocm_backend", ["torch", "triton"])
def test_fp8_cache_equals_torch_native(kit_env, monkeypatch, rocm_backend):
    """fp8 e4m3 pool (the kit's ``fp8_kv_cache``). The reference is SGLang's torch_native:
    SGLang's own triton decode differs from it by up to 0.11 on this fixture (both read the
    same bytes), so it is no reference for fp8 here."""
    monkeypatch.setenv("ROCM_MLA_BACKEND", rocm_backend)
    case = dict(heads=16, page=16, prefix=PREFIX)
    ours, _, fixture = run_fixture(mla_case("rocm_mla", "DECODE", **case), fp8=True)
    assert fixture.runner.token_to_kv_pool.get_key_buffer(0).dtype == torch.float8_e4m3fn
    theirs, _, _ = run_fixture(mla_case("torch_native", "DECODE", **case), fp8=True)
    _close(ours, theirs)
    assert call_log(kit_env) == {f"decode {rocm_backend} {len(PREFIX)} 1 DECODE": 1}


def test_kit_run_mla_attention_case(kit_env, monkeypatch):
    """The kit's own entry point, unchanged, on our backend (its tolerance and shapes)."""
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    for case in kit.make_mla_cases("rocm_mla"):
        kit.run_mla_attention_case(
            unittest.TestCase(), case, kv_lora_rank=512, qk_rope_head_dim=64, device="cpu"
        )
    log = call_log(kit_env)
    assert log["decode torch 3 1 DECODE"] == 1 and log["decode torch 1 1 DECODE"] == 1
    # Every extend case went to SGLang's torch_native backend.
    assert log["delegate torch_native EXTEND"] == 8


@pytest.mark.parametrize("rocm_backend", ["torch", "triton"])
def test_linear_verify_window_through_our_kernel(kit_env, monkeypatch, rocm_backend):
    monkeypatch.setenv("ROCM_MLA_BACKEND", rocm_backend)
    window = 4
    lens = dict(heads=16, page=16, prefix=PREFIX, extend=(window,) * len(PREFIX))
    ours, expected, _ = run_verify_fixture(mla_case("rocm_mla", "TARGET_VERIFY", **lens), topk=1)
    theirs, _, _ = run_verify_fixture(mla_case("triton", "TARGET_VERIFY", **lens), topk=1)
    _kit_check(ours, expected)
    _close(ours, theirs)
    rows = window * len(PREFIX)
    assert call_log(kit_env) == {f"decode {rocm_backend} {rows} {window} TARGET_VERIFY": 1}


def test_tree_verify_is_delegated(kit_env, monkeypatch):
    """A tree (topk 2) needs its custom mask: it goes to the replaced backend, here SGLang's
    triton slot under the drop-in (SGLang's torch_native has no target-verify path)."""
    from rocm_mla.integrations.sglang import plugin

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    plugin.register()
    lens = dict(heads=16, page=16, prefix=(15, 40), extend=(3, 3))
    ours, expected, _ = run_verify_fixture(mla_case("triton", "TARGET_VERIFY", **lens), topk=2)
    _kit_check(ours, expected)
    assert call_log(kit_env) == {"delegate triton TARGET_VERIFY": 1}


@pytest.mark.parametrize("rocm_backend", ["torch", "triton"])
def test_graph_capture_and_replay_metadata(kit_env, monkeypatch, rocm_backend):
    """The kit's CUDA-graph decode run (no device graph on the CPU, the same hooks): capture
    metadata for 4 requests, replay 3 real ones from the persistent buffers."""
    from sglang.test.kits.attention_unittest.runner_modes.cuda_graph_decode_runner import (
        run_mla_cuda_graph_decode_case,
    )

    monkeypatch.setenv("ROCM_MLA_BACKEND", rocm_backend)
    case = mla_case("rocm_mla", "DECODE", heads=16, page=16, prefix=PREFIX)
    run_mla_cuda_graph_decode_case(
        unittest.TestCase(),
        case,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        max_context_len=128,
        dtype=torch.float32,
        device="cpu",
        cuda_graph_capture_batch_size=4,
    )
    # Eager (3 requests), graph capture (4), replay (4: 3 real + 1 padded).
    assert call_log(kit_env) == {
        f"decode {rocm_backend} 3 1 DECODE": 1,
        f"decode {rocm_backend} 4 1 DECODE": 2,
    }


def test_graph_replay_reuses_the_captured_plan_and_buffers(kit_env, monkeypatch):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "triton")
    _, _, fixture = run_fixture(mla_case("rocm_mla", "DECODE", heads=16, page=16, prefix=PREFIX))
    backend, batch = fixture.backend, fixture.forward_batch
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    backend.init_forward_metadata_out_graph(batch, in_capture=True)
    captured = backend.forward_metadata
    backend.init_forward_metadata_out_graph(batch)
    replayed = backend.forward_metadata
    assert replayed.plan is captured.plan
    assert replayed.block_table.data_ptr() == captured.block_table.data_ptr()
    assert replayed.cache_seqlens.data_ptr() == captured.cache_seqlens.data_ptr()
    assert replayed.cache_seqlens.tolist() == [n + 1 for n in PREFIX]
    assert captured.plan.max_seqlen == 128  # planned for the pool's context length


@pytest.mark.parametrize("slot", ["torch_native", "triton"])
def test_drop_in_decodes_in_sglang_slots(kit_env, monkeypatch, slot):
    """With ROCM_MLA_BACKEND set, SGLang's own backend names decode through our kernel and
    keep their own extend."""
    from rocm_mla.integrations.sglang import plugin

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    plugin.register()
    ours, expected, fixture = run_fixture(
        mla_case(slot, "DECODE", heads=12, page=16, prefix=PREFIX)
    )
    assert fixture.backend.rocm_mla_prefill_name == slot
    _kit_check(ours, expected)
    extend, expected_extend, _ = run_fixture(
        mla_case(slot, "EXTEND", heads=12, page=16, prefix=(0, 17), extend=(5, 3))
    )
    _kit_check(extend, expected_extend)
    assert call_log(kit_env) == {
        f"decode torch {len(PREFIX)} 1 DECODE": 1,
        f"delegate {slot} EXTEND": 1,
    }
