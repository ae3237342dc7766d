"""Shared benchmark plumbing: device description, peaks, copy bandwidth, timing, output.

Speed is reported as ratios measured side by side in one run; absolute times on shared
machines are noisy, so every figure is a median over repeats.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: Peak HBM bandwidth in bytes/s, by a substring of the device name.
PEAK_BANDWIDTH = {
    "MI300X": 5.3e12,
    "MI325X": 6.0e12,
    "MI355X": 8.0e12,
    "H100": 3.35e12,
    "H200": 4.8e12,
}


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"


def device_slug() -> str:
    return "".join(c if c.isalnum() else "-" for c in device_name()).strip("-").lower()


def peak_bandwidth(name: str | None = None) -> float | None:
    """The datasheet peak for a known GPU, else None (then measure copy bandwidth)."""
    name = device_name() if name is None else name
    for key, peak in PEAK_BANDWIDTH.items():
        if key.lower() in name.lower():
            return peak
    return None


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


def environment() -> dict:
    from rocm_mla.platform import package_version

    return {
        "device": device_name(),
        "date": datetime.date.today().isoformat(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


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
