"""Devices compared as devices (issue 36, item 1).

On an H200 every ``rocm_mla.LLM`` failed: a plan made for ``"cuda"`` was compared with
lengths on ``cuda:0`` and ``replan_decode`` refused them. torch puts a tensor made for
``"cuda"`` on the current GPU, so every device check of the package resolves both sides
that way (``platform.resolve_device`` / ``same_device``).

No GPU here: a pretend machine of two GPUs (``torch.cuda.is_available`` / ``device_count``
/ ``current_device`` patched), and tensors "on" them are fake tensors (``FakeTensorMode``:
shapes, dtypes and devices without storage), so the real checks run on real arguments.
Fake tensors land on ``cuda:0`` for ``"cuda"`` whatever the current GPU, so every fake
tensor here names its index, as a real tensor's device always does.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import rocm_mla
from rocm_mla.backends.base import check_plan_matches
from rocm_mla.dcp import DecodeMetadata, dcp_mla_decode, plan_step_decode
from rocm_mla.engine.graphs import DecodeGraphs
from rocm_mla.engine.llm import local_device
from rocm_mla.engine.runner import Runner
from rocm_mla.inputs import DecodeSpec, check_decode_args
from rocm_mla.merge import check_merge_args
from rocm_mla.platform import resolve_device, same_device

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


class PretendGPUs:
    """Two visible GPUs; ``current`` is what ``torch.cuda.current_device()`` answers."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.current = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)


@pytest.fixture
def gpus(monkeypatch):
    return PretendGPUs(monkeypatch)


def fake_tensors() -> FakeTensorMode:
    """Tensors made inside are fake; plan host lengths outside (a fake one cannot be read)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def _plan(device, lengths=(5, 9), **kwargs):
    return rocm_mla.plan_decode(
        list(lengths),
        q_len=1,
        num_heads=16,
        kv_dtype=torch.bfloat16,
        device=device,
        backend="torch",
        **kwargs,
    )


def _call(device: torch.device, batch: int = 2, **moved: torch.device):
    """Fake decode tensors on ``device``; ``moved`` puts named ones elsewhere."""
    where = {name: moved.get(name, device) for name in ("q", "kv", "bt", "lens")}
    q = torch.empty(batch, 1, 16, 576, dtype=torch.bfloat16, device=where["q"])
    kv = torch.empty(8, 16, 576, dtype=torch.bfloat16, device=where["kv"])
    bt = torch.zeros(batch, 4, dtype=torch.int32, device=where["bt"])
    lens = torch.ones(batch, dtype=torch.int32, device=where["lens"])
    return q, kv, bt, lens


# ---- the resolver -------------------------------------------------------------------------------


def test_cuda_resolves_to_the_current_gpu_as_torch_places_tensors(gpus):
    gpus.current = 1
    assert resolve_device("cuda") == CUDA1
    assert resolve_device(torch.device("cuda")) == CUDA1
    assert resolve_device("cuda:0") == CUDA0
    assert resolve_device("cpu") == torch.device("cpu")
    with fake_tensors():
        on_gpu0 = torch.empty(1, device="cuda:0")
    assert resolve_device(on_gpu0.device) == CUDA0  # a tensor's device as is
    # Read at each call: set_device changes what "cuda" means.
    gpus.current = 0
    assert resolve_device("cuda") == CUDA0


def test_same_device_compares_resolved_devices(gpus):
    assert torch.device("cuda") != CUDA0  # what the package compared before
    assert same_device("cuda", CUDA0) and same_device(CUDA0, torch.device("cuda"))
    assert not same_device("cuda", CUDA1)
    gpus.current = 1
    assert same_device("cuda", "cuda:1") and not same_device("cuda", CUDA0)
    assert same_device("cpu", torch.device("cpu"))
    assert not same_device("cpu", "cuda") and not same_device("cuda:0", "cuda:1")


def test_without_a_gpu_cuda_stays_unindexed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cuda") == torch.device("cuda")
    assert not same_device("cuda", "cuda:0")


# ---- plans and specs store the resolved device --------------------------------------------------


def test_spec_and_plan_store_the_resolved_device(gpus):
    gpus.current = 1
    spec = DecodeSpec(
        device="cuda",
        q_dtype=torch.bfloat16,
        kv_dtype=torch.bfloat16,
        num_heads=16,
        q_len=1,
        head_dim=576,
        head_dim_v=512,
    )
    assert spec.device == CUDA1
    assert _plan("cuda").spec.device == CUDA1
    assert _plan(torch.device("cuda")).spec.device == CUDA1
    assert _plan(None).spec.device == CUDA1  # host lengths: the current GPU
    gpus.current = 0
    assert _plan("cuda").spec.device == CUDA0


def test_replan_takes_lengths_on_the_gpu_a_cuda_plan_was_made_on(gpus):
    # The H200 failure: a graph plan made for "cuda", the step's lengths on cuda:0.
    plan = _plan("cuda", graph_max_seqlen=64)
    with fake_tensors():
        lens = torch.zeros(2, dtype=torch.int32, device=CUDA0)
        elsewhere = torch.zeros(2, dtype=torch.int32, device=CUDA1)
    assert rocm_mla.replan_decode(plan, lens) is plan
    with pytest.raises(ValueError, match=r"cache_seqlens .* \[2\] on cuda:0, got .* on cuda:1"):
        rocm_mla.replan_decode(plan, elsewhere)


def test_planned_call_must_run_on_the_plans_gpu(gpus):
    gpus.current = 1
    stale = _plan("cuda")  # made while GPU 1 was current: its data would live there
    gpus.current = 0
    plan = _plan("cuda")
    with fake_tensors():
        q, kv, bt, lens = _call(CUDA0)
        problem = check_decode_args(
            q, kv, bt, lens, head_dim_v=512, softmax_scale=None, causal=True, kv_scale=None
        )
    with pytest.raises(ValueError, match=r"device: plan cuda:1, call cuda:0"):
        check_plan_matches(stale, problem, "torch")
    check_plan_matches(plan, problem, "torch")


def test_plan_decode_refuses_tensors_off_the_plans_device(gpus):
    with fake_tensors():
        on_gpu1 = torch.zeros(2, dtype=torch.int32, device=CUDA1)
        table = torch.zeros(2, 4, dtype=torch.int32, device=CUDA1)
        cache = torch.empty(8, 16, 576, dtype=torch.bfloat16, device=CUDA1)
    for name, tensor in (("block_table", table), ("kv_cache", cache)):
        with pytest.raises(ValueError, match=rf"plan_decode: {name} must be on the plan's "):
            _plan("cuda", graph_max_seqlen=64, **{name: tensor})
    with pytest.raises(ValueError, match=r"cache_seqlens must be on the plan's device cuda:0"):
        rocm_mla.plan_decode(
            on_gpu1, q_len=1, num_heads=16, kv_dtype=torch.bfloat16, device="cuda",
            graph_max_seqlen=64, backend="torch",
        )  # fmt: skip
    plan = rocm_mla.plan_decode(
        on_gpu1, q_len=1, num_heads=16, kv_dtype=torch.bfloat16, graph_max_seqlen=64,
        backend="torch",
    )  # fmt: skip
    assert plan.spec.device == CUDA1  # device None: the lengths'


# ---- every other device check, through the real functions ---------------------------------------


def test_call_arguments_must_share_qs_device(gpus):
    for name, arg in (("kv_cache", "kv"), ("block_table", "bt"), ("cache_seqlens", "lens")):
        with fake_tensors():
            q, kv, bt, lens = _call(CUDA0, **{arg: CUDA1})
        with pytest.raises(ValueError, match=rf"{name} must be on q's device cuda:0, got cuda:1"):
            check_decode_args(
                q, kv, bt, lens, head_dim_v=512, softmax_scale=None, causal=True, kv_scale=None
            )
    with fake_tensors():
        q, kv, bt, lens = _call(CUDA0)
        flag = torch.zeros(1, dtype=torch.int32, device=CUDA1)
    with pytest.raises(ValueError, match=r"fault_flag must be on q's device cuda:0"):
        check_decode_args(
            q, kv, bt, lens, head_dim_v=512, softmax_scale=None, causal=True, kv_scale=None,
            fault_flag=flag,
        )  # fmt: skip


def test_triton_launcher_checks_flag_and_schedule_devices(gpus):
    pytest.importorskip("triton")
    from rocm_mla.kernels import mla_decode as launcher
    from rocm_mla.kernels.schedule import empty_tables

    common = {"head_dim_v": 512, "softmax_scale": 0.04}
    config = launcher.default_config(launcher.triton_target(), num_heads=16)
    with fake_tensors():
        q, kv, bt, lens = _call(CUDA0)
        flag = torch.zeros(1, dtype=torch.int32, device=CUDA1)
        schedule = empty_tables(2, 1, 4, CUDA1, config.num_xcds)
    with pytest.raises(ValueError, match=r"fault_flag must be .* on q's device \(cuda:0\)"):
        launcher.mla_decode(q, kv, bt, lens, fault_flag=flag, **common)
    with pytest.raises(ValueError, match=r"schedule was made for .* on cuda:1; .* on cuda:0"):
        launcher.mla_decode(q, kv, bt, lens, config=config, schedule=schedule, **common)


def test_merge_needs_outs_and_lses_on_one_device(gpus):
    with fake_tensors():
        outs, lses = torch.empty(2, 3, 8, device=CUDA0), torch.empty(2, 3, device=CUDA0)
        elsewhere = torch.empty(2, 3, device=CUDA1)
    check_merge_args(outs, lses)
    with pytest.raises(ValueError, match=r"share a device, got cuda:0 and cuda:1"):
        check_merge_args(outs, elsewhere)


def test_dcp_step_plan_and_decode_compare_resolved_devices(gpus, monkeypatch):
    from rocm_mla.backends.torch_ref import TorchMLAImpl

    lens_host = torch.tensor([5, 9], dtype=torch.int32)
    common = {
        "num_heads": 16, "head_dim_v": 512, "rope_dim": 64, "kv_dtype": torch.bfloat16,
        "q_dtype": torch.bfloat16, "device": "cuda", "backend": "torch",
    }  # fmt: skip
    decoded = []

    def stand_in(self, problem, plan):  # the kernel itself needs real memory
        decoded.append(plan)
        rows = problem.q.shape[:3]
        return problem.q.new_zeros(*rows, 512), torch.zeros(rows, device=problem.q.device)

    monkeypatch.setattr(TorchMLAImpl, "_decode", stand_in)
    gpus.current = 1
    stale = plan_step_decode(lens_host, 1, **common)
    assert stale.spec.device == CUDA1
    gpus.current = 0
    plan = plan_step_decode(lens_host, 1, **common)
    assert plan.spec.device == CUDA0
    with fake_tensors():
        q, kv, bt, lens = _call(CUDA0)
        meta = DecodeMetadata(bt, lens)
        with pytest.raises(ValueError, match=r"device: plan cuda:1, call cuda:0"):
            dcp_mla_decode(q, kv, meta, None, backend="torch", plan=stale)
        dcp_mla_decode(q, kv, meta, None, backend="torch", plan=plan)
        dcp_mla_decode(q, kv, meta, None, backend=TorchMLAImpl(num_heads=16), plan=plan)
    assert decoded == [plan, plan]


# ---- the engine ---------------------------------------------------------------------------------


def test_engine_resolves_its_device_once(gpus):
    gpus.current = 1
    assert local_device("cuda") == CUDA1
    assert local_device(None) == CUDA1
    assert local_device("cuda:0") == CUDA0
    assert local_device("cpu") == torch.device("cpu")
    with fake_tensors():
        runner = Runner(8, 4, 2, device="cuda")
    assert runner.device == CUDA1
    assert runner.fault_flag.device == CUDA1


def _graphs(device) -> DecodeGraphs:
    return DecodeGraphs(
        lambda meta, ids: None,
        kv_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
        num_heads=16,
        head_dim_v=512,
        rope_dim=64,
        backend="torch",
        block_size=4,
        max_seqlen=64,
        max_batch=4,
        trash_block=8,
        trash_slot=4,
        device=device,
    )


def test_graph_bucket_replans_a_step_on_cuda(gpus):
    # test_in_process_engine_on_the_gpu_matches_the_cpu's path: LLM(device="cuda") builds
    # its buckets for "cuda" (GPU 0 current, where torch puts them) and each step
    # replans the bucket's plan from its static lengths (``DecodeGraphs._load``, whose
    # copies a CPU-only torch cannot run on fake GPU tensors, so the replan is called here).
    graphs = _graphs("cuda")
    with fake_tensors():
        bucket = graphs._static(2)
    plan, seq_lens = bucket.meta.decode_plan, bucket.meta.seq_lens
    assert plan.spec.device == seq_lens.device == CUDA0
    assert rocm_mla.replan_decode(plan, seq_lens) is plan
