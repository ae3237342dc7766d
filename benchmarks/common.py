"""Shared benchmark plumbing: device description, peaks, copy bandwidth, timing, output, and
what a GPU result records about the plan it ran.

Speed is reported as ratios measured side by side in one run; absolute times on shared
machines are noisy, so every figure is a median over repeats.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"


def device_slug() -> str:
    return "".join(c if c.isalnum() else "-" for c in device_name()).strip("-").lower()


def peak_bandwidth(name: str | None = None) -> float | None:
    """The datasheet peak HBM bandwidth in bytes/s of a known GPU (the registry's products),
    else None (then measure copy bandwidth)."""
    from rocm_mla.targets import find_product

    product = find_product(device_name() if name is None else name)
    return None if product is None else product.hbm_bytes_per_s


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 7, device: str = "cpu") -> float:
    """Bytes copied per second (source bytes / time) of a buffer far larger than the caches.

    Each byte copied is read once and written once, so STREAM's "Copy" figure for the same
    run is twice this number.
    """
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return nbytes / median_time(lambda: dst.copy_(src), repeats=repeats, warmup=1)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_time(fn, *, repeats: int = 5, warmup: int = 1, before=None) -> float:
    """Median wall time of ``fn()`` in seconds; ``before()`` runs untimed before each call."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_time(fn, *, device: str, warmup_ms: float = 5.0, rep_ms: float = 25.0) -> float:
    """Median seconds of ``fn()`` on ``device``: on a GPU ``triton.testing.do_bench`` (CUDA/HIP
    events around each call, the L2 flushed before each, outside the events; ``warmup_ms`` /
    ``rep_ms`` of calls), on the CPU ``median_time`` of 3 calls after 1.

    Device time, not what a caller waits: host work shorter than the flush before it (a
    planned call's checks) overlaps the flush and is not counted; ``benchmarks.gpu`` times
    the host side (``call_overhead``).
    """
    if device == "cpu":
        return median_time(fn, repeats=3, warmup=1)
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") / 1e3


def device_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy of ``nbytes``
    (far larger than any L2 or Infinity Cache): the memory ceiling a kernel can reach, the
    figure the "% of copy" columns divide by. Events, the median of ``device_time``."""
    src = torch.ones(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    seconds = device_time(lambda: dst.copy_(src), device="cuda", warmup_ms=20, rep_ms=100)
    return 2 * nbytes / seconds


#: Variables that change which config, slots or code a Triton plan gets (recorded with every
#: GPU result, so that two runs' plans can be compared; ``plan_inputs``).
PLAN_ENV = (
    "ROCM_MLA_TRITON_SLOTS",
    "ROCM_MLA_TRITON_CONFIGS",
    "ROCM_MLA_BACKEND",
    "TRITON_PTXAS_PATH",
    "TRITON_HIP_LLD_PATH",
    "TRITON_CACHE_DIR",
    "TRITON_INTERPRET",
    "TRITON_DEFAULT_FP_FUSION",
    "TRITON_F32_DEFAULT",
    "PTXAS_OPTIONS",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
)


def triton_build() -> dict:
    """The Triton that compiles here: the imported module's version and folder (the
    distribution's metadata can name another install: an image's Triton under a carried
    one), and on CUDA the ptxas it calls (path and release). None fields where absent."""
    from rocm_mla.platform import package_version

    info = {"version": None, "path": None, "dist_version": package_version("triton")}
    try:
        import triton
    except ImportError:
        return {**info, "ptxas": None}
    info["version"] = triton.__version__
    info["path"] = str(Path(triton.__file__).parent)
    ptxas = None
    if torch.version.cuda is not None:
        try:
            from triton import knobs

            tool = knobs.nvidia.ptxas
            ptxas = None if tool is None else {"path": tool.path, "version": tool.version}
        except Exception as exc:  # older Tritons, or no ptxas: say which
            ptxas = {"error": f"{type(exc).__name__}: {exc}"}
    return {**info, "ptxas": ptxas}


def device_properties() -> dict | None:
    """The GPU torch runs on: name, compute units, capability / arch, memory; None on CPU."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "name": props.name,
        "multi_processor_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "gcn_arch": getattr(props, "gcnArchName", None),
        "total_memory_gib": round(props.total_memory / 2**30, 1),
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
    }


def plan_inputs() -> dict:
    """Everything besides the shape that decides a Triton plan on this machine: the device,
    the Triton build and ptxas, and the variables of ``PLAN_ENV`` (set ones only)."""
    return {
        "device": device_properties(),
        "triton": triton_build(),
        "env": {k: os.environ[k] for k in PLAN_ENV if k in os.environ},
    }


#: The CPU flags recorded with every result: which vector paths the host can run.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile")


def cpu_host() -> dict:
    """The CPU a result ran on: its model, architecture, cores and the ``ISA_FLAGS`` it has."""
    from rocm_mla.kernels import cpu_decode

    flags = cpu_decode._cpu_flags() or set()
    return {
        "cpu_model": cpu_decode.cpu_model(),
        "machine": platform.machine(),
        "isa_flags": [f for f in ISA_FLAGS if f in flags],
        "cores": os.cpu_count(),
    }


def environment() -> dict:
    inputs = plan_inputs()
    return {
        "device": device_name(),
        "cpu": cpu_host(),
        "date": datetime.date.today().isoformat(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": inputs["triton"]["version"],
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "plan_inputs": inputs,
    }


def triton_plan(launch, *, num_heads: int, q_len: int, kv_dtype: torch.dtype) -> dict:
    """What a Triton decode ran: ``launch`` is a plan's ``TritonLaunch`` (``plan.launch``) or
    anything with its ``config``, ``num_slots`` and ``schedule`` (``ScheduleTables``).

    Fields: ``config`` (every ``LaunchConfig`` field: BLOCK_H/N, warps, stages, ...),
    ``table_source`` (the tuned entry's provenance), ``num_slots``, ``num_cus``,
    ``programs_per_cu`` (the residency the planner assumed: slots / CUs), ``used_slots``,
    ``num_partials``, ``num_programs`` (None when the device planner fills the tables),
    ``slots_forced`` ($ROCM_MLA_TRITON_SLOTS), ``target``, ``device``, ``triton`` and
    ``fingerprint`` (a short hash of config and slots: equal in two runs iff they planned the
    same launch).
    """
    from rocm_mla.backends.triton import SLOTS_ENV
    from rocm_mla.kernels.mla_decode_args import group_config, table_entry
    from rocm_mla.kernels.target import triton_target

    target = triton_target()
    config = launch.config.to_dict()
    schedule = launch.schedule
    entry = table_entry(target, num_heads=num_heads, q_len=q_len, kv_dtype=kv_dtype)
    fingerprint = json.dumps([config, launch.num_slots], sort_keys=True)
    return {
        "config": config,
        "table_source": entry.source,
        # False when the planner fell back from the tuned entry (e.g. it failed to compile).
        "config_is_table_entry": group_config(entry.config, q_len * num_heads) == launch.config,
        "num_slots": launch.num_slots,
        "num_cus": target.num_cus,
        "programs_per_cu": launch.num_slots / target.num_cus,
        "used_slots": schedule.used_slots,
        "num_partials": schedule.num_partials,
        "num_programs": schedule.num_programs,
        "slots_forced": os.environ.get(SLOTS_ENV),
        "target": str(target),
        "device": device_name(),
        "triton": triton_build()["version"],
        "fingerprint": hashlib.sha1(fingerprint.encode()).hexdigest()[:10],
    }


def plan_text(plan: dict) -> str:
    """One short line for a ``triton_plan`` record (and the launched kernel's resources when
    ``launched_stage1`` added them)."""
    c = plan["config"]
    text = (
        f"h{c['block_h']} n{c['block_n']} w{c['num_warps']} s{c['num_stages']}"
        f" {plan['num_slots']} slots ({plan['programs_per_cu']:g}/CU)"
    )
    if plan.get("num_programs") is not None:
        text += f" {plan['num_programs']} seg {plan['num_partials']} part"
    kernel = plan.get("launched")
    if kernel and "regs" in kernel:
        text += f" | {kernel['regs']} regs {kernel['spills']} spill"
        if kernel.get("programs_per_cu") is not None:
            text += f" {kernel['programs_per_cu']}/CU"
    return text + f" [{plan['fingerprint']}]"


class Stage1Kernels:
    """The stage-1 kernels Triton compiled during a call: their registers, spills and shared
    memory as launched (``CompiledKernel.n_regs`` / ``n_spills`` / ``metadata.shared``), and
    the residency those resources give (``residency.resident_programs``, NVIDIA targets with
    residency rules).

    ``before()`` notes the compiled variants, ``after()`` returns the new ones' resources (a
    call that compiled nothing new reuses the variant an earlier call of the same shape
    compiled: ``after(shape=)`` then returns that one). Read from Triton's per-device kernel
    cache (``JITFunction.device_caches[device][0]``, the same in Triton 3.4 to 3.9); under the
    interpreter there is none and the record says so.
    """

    def __init__(self) -> None:
        from rocm_mla.kernels.mla_decode_kernel import _mla_decode_stage1

        self.fn = _mla_decode_stage1
        self.seen: set[int] = set()
        self.by_shape: dict = {}

    def _kernels(self) -> list:
        caches = getattr(self.fn, "device_caches", None)
        if not caches:
            return []
        return [k for cache in caches.values() for k in cache[0].values()]

    def before(self) -> None:
        self.seen = {id(k) for k in self._kernels()}

    def after(self, shape=None) -> dict:
        new = [k for k in self._kernels() if id(k) not in self.seen]
        if not new:
            if shape in self.by_shape:
                return {**self.by_shape[shape], "compiled_by": "an earlier case"}
            reason = "interpreter" if not torch.cuda.is_available() else "no new compile seen"
            return {"unknown": reason}
        records = [self._record(k) for k in new]
        record = max(records, key=lambda r: r.get("regs", 0))
        if len(records) > 1:
            record["variants"] = len(records)
        self.by_shape[shape] = record
        return record

    @staticmethod
    def _record(kernel) -> dict:
        from rocm_mla.kernels.residency import resident_programs
        from rocm_mla.kernels.target import triton_target

        try:
            regs, spills = kernel.n_regs, kernel.n_spills
        except AttributeError:
            return {"unknown": "the kernel was compiled but never loaded"}
        meta = kernel.metadata
        record = {
            "regs": regs,
            "spills": spills,
            "shared": int(meta.shared),
            "num_warps": meta.num_warps,
            "num_stages": getattr(meta, "num_stages", None),
            "programs_per_cu": None,
        }
        # AMD's residency needs the VGPR, AGPR and SGPR counts apart (occupancy.py reads them
        # from the amdgcn); the loaded kernel's n_regs is not that.
        spec = triton_target().spec
        if spec.backend == "cuda" and spec.residency is not None:
            record["programs_per_cu"] = resident_programs(
                spec.key,
                num_warps=meta.num_warps,
                regs_per_thread=regs,
                smem_bytes=int(meta.shared),
            )
        return record


def write_results(stem: str, payload: dict, out_dir: Path | None = None) -> Path:
    """Write ``<out_dir>/<stem>-<device>-<date>.json``; returns its path."""
    out_dir = RESULTS_DIR if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}-{device_slug()}-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def progress(i: int, total: int, label: str) -> None:
    """A one-line progress bar on stderr."""
    width = 30
    done = int(width * (i + 1) / total)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i + 1}/{total} {label[:60]:<60}")
    if i + 1 == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
