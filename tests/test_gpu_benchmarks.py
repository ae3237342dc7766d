"""The GPU benchmarks' code without a GPU: ``kernel_roofline --gpu``'s table run on the CPU
(``--dry-run``: Triton interpreter, tiny shapes) with stand-in peers loaded from files the way
a device bundle lays them out, its ratios, acceptance lines and plan records; vLLM's kernel
found by file; the split rule; the launched-kernel record; ``benchmarks.gpu``'s CPU run; the
gpu markers' skip reasons; and ``scripts/gpu_check.sh`` refusing cleanly without a GPU and
running its steps' plumbing on the CPU (``--dry-run``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import rocm_mla

pytest.importorskip("triton")

from benchmarks import common, kernel_roofline
from rocm_mla.kernels.target import TritonTarget

ROOT = Path(__file__).resolve().parents[1]

#: Stand-ins for the bundle's peers (``peers/flash_mla_interface.py`` and
#: ``peers/vllm_triton_decode.py``): the same call signatures, answered by the torch backend.
FAKE_FLASH_MLA = """
import rocm_mla

CALLS = []


def get_mla_metadata(cache_seqlens, rows_per_kv_head, kv_heads):
    return "meta", None


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, splits,
                           softmax_scale=None, causal=False):
    assert meta == "meta" and k_cache.dim() == 4
    CALLS.append(q.shape)
    out, lse = rocm_mla.mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v=head_dim_v,
                                   softmax_scale=softmax_scale, causal=causal, backend="torch")
    return out, lse.transpose(1, 2)
"""
FAKE_VLLM = """
import torch

import rocm_mla

CALLS = []


def decode_attention_fwd(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits,
                         num_kv_splits, sm_scale, page_size=1, logit_cap=0.0, k_scale=None,
                         v_scale=None, is_mla=False):
    assert is_mla and num_kv_splits == attn_logits.shape[2]
    CALLS.append((q.shape, num_kv_splits))
    scale = None if k_scale is None else float(k_scale)
    out, _ = rocm_mla.mla_decode(q.unsqueeze(1), k_buffer[:, :, 0], req_to_token, b_seq_len,
                                 head_dim_v=v_buffer.shape[-1], softmax_scale=sm_scale,
                                 causal=False, kv_scale=scale, backend="torch")
    o.copy_(out[:, 0])
"""


def _bundle_peers(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "flash_mla_interface.py").write_text(textwrap.dedent(FAKE_FLASH_MLA))
    (folder / kernel_roofline.VLLM_TRITON_FILE).write_text(textwrap.dedent(FAKE_VLLM))
    return folder


def test_vllm_kernel_is_found_by_file_as_the_bundle_lays_it_out(tmp_path, monkeypatch):
    """Under the bundle vLLM's modules do not import (vLLM 0.33 moved the kernel; the peers
    folder holds only a stub ``vllm``): the kernel loads from the file beside FlashMLA's."""
    peers = _bundle_peers(tmp_path / "peers")
    monkeypatch.delenv(kernel_roofline.VLLM_TRITON_ENV, raising=False)
    monkeypatch.setenv("ROCM_MLA_FLASH_MLA", str(peers))
    fn, source = kernel_roofline.vllm_decode_attention()
    assert callable(fn) and fn.__name__ == "decode_attention_fwd"
    assert source == str(peers / kernel_roofline.VLLM_TRITON_FILE)
    # An explicit file wins, by flag or variable; one that is absent or wrong says so.
    other = tmp_path / "other.py"
    other.write_text("def decode_attention_fwd(*args, **kwargs):\n    pass\n")
    assert kernel_roofline.vllm_decode_attention(str(other))[1] == str(other)
    monkeypatch.setenv(kernel_roofline.VLLM_TRITON_ENV, str(tmp_path / "nope.py"))
    fn, reason = kernel_roofline.vllm_decode_attention()
    assert fn is None and "nope.py: no such file" in reason
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    fn, reason = kernel_roofline.vllm_decode_attention(str(empty))
    assert fn is None and "defines no decode_attention_fwd" in reason
    # Nothing named and no bundle: vLLM's own modules, each failure named.
    monkeypatch.delenv(kernel_roofline.VLLM_TRITON_ENV)
    monkeypatch.delenv("ROCM_MLA_FLASH_MLA")
    fn, reason = kernel_roofline.vllm_decode_attention()
    if fn is None:
        assert "vllm.v1.attention.ops.triton_decode_attention" in reason


def test_vllm_split_rule_without_vllm():
    if kernel_roofline.importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: its own rule applies")
    rule = kernel_roofline.vllm_num_kv_splits
    assert rule(32768, 132) == (64, "vLLM 0.33's rule")
    assert rule(16384, 132)[0] == 32 and rule(8192, 132)[0] == 16 and rule(4096, 132)[0] == 8
    assert rule(1500, 132)[0] == 2 and rule(1600, 132)[0] == 4  # 2 and 3 -> powers of two
    assert rule(100, 132)[0] == 1
    assert rule(32768, 4)[0] == 8  # at most 2 per SM


def test_dry_run_table_with_peers_from_files(tmp_path, monkeypatch, capsys):
    """``--dry-run``: every column of the ``--gpu`` table on the CPU, the peers loaded from
    the bundle layout, the shapes precompiled in 2 processes first, 4 forced slots (cut
    units, the merge), the JSON + PNG and the text table last."""
    peers = _bundle_peers(tmp_path / "peers")
    monkeypatch.setenv("ROCM_MLA_FLASH_MLA", str(peers))
    monkeypatch.delenv(kernel_roofline.VLLM_TRITON_ENV, raising=False)
    # 4 slots for 2 x 3 pieces: both requests cut, so stage 2 merges.
    monkeypatch.setenv("ROCM_MLA_TRITON_SLOTS", "4")
    path = kernel_roofline.main(["--dry-run", "--precompile", "2", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    payload = json.loads(path.read_text())
    assert path.with_suffix(".png").is_file()
    assert payload["mode"] == "dry-run" and payload["skipped_cases"] == []
    # Two processes compiled every shape's calls first (here: ran them in the interpreter).
    warmed = payload["precompile"]
    assert warmed["workers"] == 2 and len(warmed["done"]) == len(kernel_roofline.DRY_RUN_CASES)
    assert all(line.endswith(" s") for line in warmed["done"]), warmed
    assert payload["peers"]["flashmla"]["loaded"] and payload["peers"]["vllm"]["loaded"]
    rows = {r["case"]: r for r in payload["rows"]}
    assert list(rows) == [c.label() for c in kernel_roofline.DRY_RUN_CASES]
    for label, row in rows.items():
        times = row["times_us"]
        assert times["ours"] > 0 and times["ours_graph"] > 0, label
        assert times["vllm"] > 0 and times["vllm_graph"] > 0, label
        assert row["vllm"]["splits"] >= 1 and row["vllm"]["splits_rule"]
        plan = row["plan"]
        assert plan["num_slots"] == 4 and plan["slots_forced"] == "4"
        assert plan["num_partials"] > 0 and plan["num_programs"] == 4
        assert plan["config"]["block_h"] >= 16 and plan["config_is_table_entry"]
        assert plan["launched"] == {"unknown": "interpreter"}
        assert row["graph_plan"]["num_programs"] is None  # the device planner fills it
        assert row["graph"].startswith("eager")
        check = row["check"]
        assert check["graph_vs_planned"] <= 1e-6 and check["ok"], check
        ratios = row["ratios"]
        assert ratios["vs_vllm"] == pytest.approx(times["vllm"] / times["ours"], rel=1e-3)
        assert row["pct_copy"]["ours"] > 0 and row["pct_datasheet"] is None
    bf16, fp8 = rows["B2 ctx130 H16"], rows["B2 ctx130 H16 fp8"]
    assert bf16["check"]["reference"] == "flashmla" and bf16["times_us"]["flashmla"] > 0
    assert bf16["ratios"]["vs_flashmla"] == pytest.approx(
        bf16["times_us"]["flashmla"] / bf16["times_us"]["ours"], rel=1e-3
    )
    # FlashMLA has no per-tensor-scaled fp8 cache: vLLM's fp8 run is the reference there.
    assert fp8["times_us"]["flashmla"] is None and "656-byte" in fp8["skipped"]["flashmla"]
    assert fp8["check"]["reference"] == "vllm"
    assert fp8["ratios"]["fp8_over_bf16"] == pytest.approx(
        bf16["times_us"]["ours"] / fp8["times_us"]["ours"], rel=1e-3
    )
    assert "fp8_over_bf16" not in bf16["ratios"]
    whats = [a["what"] for a in payload["acceptance"]]
    assert whats == [
        "ours / FlashMLA, H16 S_q 1-8",
        "ours / FlashMLA, H128 S_q 2-8",
        "ours / FlashMLA, H128 S_q 1",
        "ours fp8 / ours bf16, H16",
        "ours fp8 / ours bf16, H128",
    ]
    h16 = payload["acceptance"][0]
    assert h16["rows"] == 2 and h16["planned_min"] == min(
        r["ratios"]["vs_flashmla"] for r in (bf16, rows["B2 ctx130 H16 S_q2"])
    )
    # The text table comes last: the header, a row per shape, the plans, the verdicts.
    tail = out.split("wrote ")[-1]
    assert "B2 ctx130 H16 fp8" in tail and "plans (config, slots" in tail
    assert "ours fp8 / ours bf16, H16 >= 1.6 (1 rows)" in tail
    assert tail.strip().splitlines()[-1].startswith("device cpu-")
    # A repeat compares plan by plan.
    again = json.loads(path.read_text())
    again["rows"][0]["plan"] = {**again["rows"][0]["plan"], "fingerprint": "other"}
    text = kernel_roofline.compare_text(again, payload)
    assert "B2 ctx130 H16 " in text and "PLAN DIFFERS" in text and "same plan" in text


def test_gpu_table_cases_are_issue_37s():
    labels = [c.label() for c in kernel_roofline.GPU_CASES]
    assert len(labels) == len(set(labels))
    assert labels[:14] == [
        "B128 ctx32K H16",
        "B64 ctx8K H16",
        "B32 ctx16K H16",
        "B128 ctx4K H16",
        "B8 ctx32K H16",
        "B1 ctx32K H16",
        "B128 ctx32K H128",
        "B64 ctx8K H128",
        "B32 ctx16K H128",
        "B32 ctx16K H16 S_q4",
        "B64 ctx8K H128 S_q2",
        "B128 ctx16K H16",
        "B128 ctx16K H16 fp8",
        "B64 ctx8K H128 fp8",
    ]
    # The acceptance's verify windows: S_q 1, 2, 4, 8 at both head counts.
    for heads in (16, 128):
        q_lens = {c.q_len for c in kernel_roofline.GPU_CASES if c.heads == heads}
        assert q_lens == {1, 2, 4, 8}
    # Every fp8 row has its bf16 twin (the fp8/bf16 ratio).
    for c in kernel_roofline.GPU_CASES:
        if c.kv_kind == "fp8":
            twin = kernel_roofline.Case(c.batch, c.context, c.heads, c.q_len, "bf16")
            assert twin in kernel_roofline.GPU_CASES


def test_gpu_mode_refuses_without_a_gpu_and_checks_its_flags(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, message in (
        (["--gpu"], "--gpu and --profile-once need a GPU"),
        (["--profile-once"], "--gpu and --profile-once need a GPU"),
        (["--dry-run", "--cases", "B9 ctx1K H16"], "--cases: unknown"),
        (["--gpu", "--grid", "tiny"], "not allowed with argument"),
        (["--cases", "B2 ctx130 H16"], "go with --gpu, --dry-run or --profile-once"),
    ):
        with pytest.raises(SystemExit) as exc:
            kernel_roofline.main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err, argv


class _FakeKernel:
    def __init__(self, regs: int, shared: int) -> None:
        self.n_regs, self.n_spills = regs, 0
        self.metadata = types.SimpleNamespace(shared=shared, num_warps=4, num_stages=2)


def test_launched_stage1_kernel_record(monkeypatch):
    """The kernels Triton compiled during a call, read from its per-device cache: registers,
    spills, shared memory, and on sm90 the residency they give; a shape compiled by an
    earlier call is credited to it."""
    import rocm_mla.kernels.target as target_module

    monkeypatch.setattr(target_module, "triton_target", lambda: TritonTarget("cuda", "sm90", 132))
    kernels = common.Stage1Kernels()
    cache: dict = {}
    kernels.fn = types.SimpleNamespace(device_caches={0: (cache, None, None, None, None)})
    kernels.before()
    cache["a"] = _FakeKernel(regs=128, shared=100_000)
    record = kernels.after(shape="H16")
    # 128 regs x 128 threads: 4 programs by registers; 2 by shared memory (228 KB per SM).
    assert record == {
        "regs": 128,
        "spills": 0,
        "shared": 100_000,
        "num_warps": 4,
        "num_stages": 2,
        "programs_per_cu": 2,
    }
    kernels.before()
    assert kernels.after(shape="H16") == {**record, "compiled_by": "an earlier case"}
    assert "unknown" in kernels.after(shape="H128")


def test_plan_inputs_name_the_triton_that_compiles(monkeypatch):
    monkeypatch.setenv("ROCM_MLA_TRITON_SLOTS", "7")
    inputs = common.plan_inputs()
    import triton

    assert inputs["triton"]["version"] == triton.__version__
    assert inputs["triton"]["path"] == str(Path(triton.__file__).parent)
    assert inputs["env"]["ROCM_MLA_TRITON_SLOTS"] == "7"
    assert common.environment()["triton"] == triton.__version__


def test_bench_gpu_dry_run_overhead_and_planner_rows(tmp_path, capsys):
    """``benchmarks.gpu --dry-run``: the one-shot vs planned rows and the device planner rows
    on the CPU, each with the plan it ran, and the short table printed last."""
    from benchmarks import gpu

    payload = gpu.main(["--dry-run", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    (row,) = payload["call_overhead"]
    assert (row["batch"], row["context"], row["heads"]) == gpu.DRY_RUN_OVERHEAD_CASES[0][:3]
    assert row["one_shot_over_planned"] == pytest.approx(row["one_shot_s"] / row["planned_s"])
    assert row["one_shot_within_target"] is None  # B < 8: outside the target's range
    assert row["plan"]["num_slots"] >= 1 and row["graph"].startswith("eager")
    planner = payload["planner"]
    assert [(r["batch"], r["heads"]) for r in planner] == [(1, 16), (2, 16)]
    for r in planner:
        assert r["eager_us"] > 0 and r["graph_us"] > 0
        assert r["plan"]["num_programs"] is None  # the device planner fills the tables
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[0].startswith("gpu-") and files[1].endswith(".png")
    tail = out.split("wrote ")[-1]
    assert "one-shot" in tail and tail.strip().splitlines()[-1].startswith("planner worst")
    assert gpu.TARGETS == {"one_shot_over_planned_max": 1.3, "planner_us_max": 20.0}


def test_bench_gpu_refuses_without_a_gpu(monkeypatch, capsys):
    from benchmarks import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        gpu.main(["--skip-e2e"])
    assert exc.value.code == 2
    assert "needs a CUDA or HIP GPU (torch sees none)" in capsys.readouterr().err


def test_gpu_marked_tests_name_what_they_need(monkeypatch, tmp_path):
    """A gpu-marked test's skip names the missing requirement: the GPU, the Triton backend
    on it (with the backend's own reason), fp8; vLLM must be installed, not a stub package
    that only imports (a device bundle puts one on the path for FlashMLA)."""
    import rocm_mla.backends
    from tests import conftest

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert conftest._skip_reason("gpu", ("triton",)) == "needs a GPU: torch sees no CUDA/HIP device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        rocm_mla.backends,
        "available_backends",
        lambda: {"triton": "Triton 3.3.0 is below 3.5.1", "torch": None},
    )
    assert conftest._skip_reason("gpu") is None
    assert conftest._skip_reason("gpu", ("triton",)) == (
        "needs the Triton backend on this GPU: Triton 3.3.0 is below 3.5.1"
    )
    with pytest.raises(ValueError, match="unknown \\['cuda'\\]"):
        conftest._skip_reason("gpu", ("cuda",))
    import rocm_mla.backends.triton as triton_backend

    monkeypatch.setattr(
        triton_backend.TritonMLAImpl,
        "capabilities",
        types.SimpleNamespace(kv_dtypes=(torch.float32, torch.bfloat16)),
    )
    assert "fp8" in conftest._skip_reason("gpu", ("fp8",))
    stub = tmp_path / "peers"
    (stub / "vllm").mkdir(parents=True)
    (stub / "vllm" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(stub))
    assert kernel_roofline.importlib.util.find_spec("vllm") is not None
    assert conftest._skip_reason("vllm") == (
        "needs vllm installed (vllm is importable, but from no installed distribution; run "
        "`make test-vllm`, which uses its own venv)"
    )


def test_profile_once_runs_each_call_untimed(tmp_path):
    """``--profile-once`` (the ncu pass of gpu_check): our planned call and FlashMLA's, twice
    each, nothing timed; here on the CPU with the stand-in FlashMLA."""
    peers_dir = _bundle_peers(tmp_path / "peers")
    flash, reason = kernel_roofline.flash_mla_module(str(peers_dir))
    assert reason is None
    peers = kernel_roofline.Peers(flash=flash, flash_source="stand-in")
    cases = [kernel_roofline.DRY_RUN_CASES[0], kernel_roofline.DRY_RUN_CASES[1]]
    lines = kernel_roofline.profile_once(cases, peers, device="cpu")
    assert lines[0].startswith("ours B2 ctx130 H16: h16 ") and lines[1] == "flashmla B2 ctx130 H16"
    assert lines[2].startswith("ours B2 ctx130 H16 fp8") and "656-byte" in lines[3]
    assert len(flash.CALLS) == 2


def _gpu_check(tmp_path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)  # the script's Python starts as a device run's would
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_gpu_check_refuses_cleanly_without_a_gpu(tmp_path):
    """The one-call GPU suite where torch sees no GPU: one clear line, exit 2, nothing run
    and nothing written; an unknown flag is refused the same way."""
    done = _gpu_check(tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("gpu_check: torch sees no GPU") and done.stdout == ""
    assert not (tmp_path / "out").exists()
    done = _gpu_check(tmp_path, "--fast")
    assert done.returncode == 2 and "unknown argument '--fast'" in done.stderr


@pytest.mark.slow
def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    """``--dry-run``: the steps in order under their limits, the benchmarks' CPU variants,
    the four files in $OUT (the tarball holding every log, JSON, PNG and junit XML), and the
    summary with the step table printed last."""
    done = _gpu_check(tmp_path, "--dry-run", "--no-suite")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert names[0].startswith("gpu-check") and names[-1] == "summary.txt"
    assert len(names) == 4 and names[1].startswith("kernel-roofline-") and names[2].endswith(".png")
    import tarfile

    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        members = {m.name for m in tar.getmembers()}
    for name in (
        "./logs/gpu-tests.log",
        "./logs/kernel-roofline.log",
        "./logs/bench-gpu.log",
        "./logs/schedule-gpu.log",
        "./logs/environment.txt",
        "./junit-gpu-tests.xml",
        "./summary.txt",
    ):
        assert name in members, (name, sorted(members))
    assert any(m.startswith("./results/gpu-") and m.endswith(".json") for m in members)
    summary = (out / "summary.txt").read_text()
    steps = summary.split("== gpu_check steps")[-1].strip().splitlines()[1:]
    assert [s.split()[0] for s in steps] == [
        "gpu-tests",
        "kernel-roofline",
        "bench-gpu",
        "schedule-gpu",
        "suite",
    ]
    assert "tests:" in steps[0] and "skipped" in steps[0]
    assert steps[-1].endswith("not run: --no-suite")
    assert "== kernel_roofline --gpu" in summary and "== benchmarks.gpu" in summary
    assert done.stdout.rstrip().splitlines()[-1].startswith("gpu_check: ")
    assert "== gpu_check steps" in done.stdout.split("== benchmarks.gpu")[-1]


@pytest.mark.parametrize(("kind", "q_len"), [("16bit", 1), ("16bit", 3), ("fp8", 2)])
def test_vllm_call_matches_the_reference_with_vllms_own_kernel(kind, q_len):
    """``vllm_call`` sets vLLM's real ``decode_attention_fwd`` up right (cache views, causal
    verify windows flattened to one row per position, fp8 ``k_scale``): its output is the
    torch reference's. Runs where the kernel is found (a device bundle's file, or vLLM):
    on a GPU in bf16, on the CPU through the interpreter in fp16 (it truncates bf16)."""
    from rocm_mla.inputs import prepare_decode

    fn, source = kernel_roofline.vllm_decode_attention()
    if fn is None:
        pytest.skip(f"needs vLLM's Triton MLA kernel: {source}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    lens = torch.tensor([130, 70, q_len + 2], dtype=torch.int32)
    kv, table, scale = kernel_roofline.build_cache(
        lens, "fp8" if kind == "fp8" else "bf16", 64, device, 0
    )
    kv = kv if kind == "fp8" else kv.to(dtype)
    q = torch.randn(3, q_len, 16, 576, dtype=dtype, device=device)
    problem = prepare_decode(
        q, kv, table, lens.to(device), head_dim_v=512, softmax_scale=None, causal=True,
        kv_scale=scale,
    )  # fmt: skip
    call, reason, info = kernel_roofline.vllm_call(fn, problem, lens)
    assert reason is None and info["splits"] >= 1
    out, _ = call()
    ref, _ = rocm_mla.mla_decode(q, kv, table, lens.to(device), kv_scale=scale, backend="torch")
    assert kernel_roofline._rel_err(out, ref) < 1e-2


def test_a_shape_where_ours_fails_is_a_failed_row_not_the_end_of_the_run(monkeypatch):
    """One call on a lent GPU: our decode failing on one shape (a compile error, say) or
    its graph failing is that row's failed check, and the other shapes still run."""
    real_decode = rocm_mla.mla_decode

    def decode(q, kv, *args, **kwargs):
        if kv.dtype.itemsize == 1:
            raise RuntimeError("PassManager::run failed")
        return real_decode(q, kv, *args, **kwargs)

    def replan(plan, lens):
        raise ValueError("replan_decode: a stand-in failure")

    monkeypatch.setattr(rocm_mla, "mla_decode", decode)
    monkeypatch.setattr(rocm_mla, "replan_decode", replan)
    payload = kernel_roofline.run_gpu(
        kernel_roofline.DRY_RUN_CASES[:2],
        device="cpu",
        peers=kernel_roofline.Peers(),
        budget_s=1000,
        warmup_ms=0,
        rep_ms=1,
    )
    bf16, fp8 = payload["rows"]
    assert bf16["times_us"]["ours"] > 0 and bf16["times_us"]["ours_graph"] is None
    assert bf16["skipped"]["ours_graph"].startswith("failed: ValueError: replan_decode")
    assert fp8["plan"] is None and fp8["skipped"]["ours"].startswith("failed: RuntimeError")
    assert payload["checks_failed"] == ["B2 ctx130 H16", "B2 ctx130 H16 fp8"]
    text = kernel_roofline.table_text(payload)
    assert "B2 ctx130 H16 fp8        none: failed: RuntimeError: PassManager" in text
