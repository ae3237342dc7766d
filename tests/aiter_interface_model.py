"""A reference model of the interface of AITER's ``aiter.mla.mla_decode_fwd``, in plain torch,
for any release's signature.

Test-only, and not a kernel: it states, slowly and in float64, what AITER's MLA decode
entry point takes, computes and returns, so the CPU suite can drive the aiter backend
through it and prove the metadata, head padding, scale and LSE handling. The package never
imports this module and never falls back to it; a machine without AITER cannot run the
aiter backend at all.

A release is a ``ReleaseInterface``: ``mla_decode_fwd``'s parameters (names and defaults),
the parameters of its non-persistent split reduce (``_fwd_kernel_stage2_asm``) and its
version. ``CURRENT`` is ROCm/aiter's source as this model was written from; ``read_release``
reads another one from a release's ``aiter/mla.py`` with ``ast``, without importing it
(importing AITER needs ROCm); ``release_module`` makes a module whose ``mla_decode_fwd``
takes exactly that signature (an unknown keyword is Python's own TypeError) and behaves as
that release does. This module's own ``mla_decode_fwd`` / ``_fwd_kernel_stage2_asm`` are
``CURRENT``'s.

What it models (read from ROCm/aiter: ``aiter/mla.py``, ``csrc/py_itfs_cu/asm_mla.cu``,
``op_tests/test_mla.py``, ``aiter/utility/dtypes.py``, and their history):

- positional ``(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
  max_seqlen_q)``; ``q`` ``[total_q, H, D]`` dense; ``kv_buffer`` ``[num_pages, page_size,
  nhead_kv, D]``; ``o`` ``[total_q, H, Dv]`` written in place; int32 CSR metadata;
- ``page_size`` / ``nhead_kv``: keywords where the release has them, else read from
  ``kv_buffer.shape`` (releases before 0.1.11);
- every request has ``max_seqlen_q`` queries (the kernel strides q by that many rows);
- query ``i`` of a request with ``L`` keys sees keys ``[0, L - max_seqlen_q + i]``
  (``causal=True``, the only mode of older releases);
- ``sm_scale`` defaults to ``D ** -0.5``; fp8 q needs fp8 KV and both ``q_scale`` and
  ``kv_scale`` (``[1]`` fp32 tensors); fp16 q and fp8 q over bf16 KV are rejected;
- kernels exist for 16 or 128 query heads (other counts fail the kernel lookup);
- split-KV: each request's keys are cut into ``num_kv_splits`` chunks, each chunk gives a
  normalized partial output and a natural-log LSE, and the stage-2 reduce merges them with
  a running max. A request with no keys has no valid split and ends as ``0/0`` (NaN out,
  -inf LSE); a row whose keys are all masked ends as NaN;
- returns ``(logits, final_lse)``: ``logits`` is the fp32 split scratch ``[total_q, splits,
  H, Dv]`` (not the output, which is in ``o``). ``final_lse`` ``[total_q, H]`` fp32, by
  release: without a final-LSE output in the reduce (before 0.1.13) it is a buffer nothing
  wrote (``UNWRITTEN`` here), ``return_lse`` or not; with one, ``return_lse=False`` gives
  None, and ``return_lse=True`` fails the stage-1 kernel lookup for 16 and 128 heads before
  0.1.19 (a RuntimeError, as AITER's ``not find kernel``) and from then on is the reduce's
  LSE, or ``UNWRITTEN`` when the launch has one split and skips the reduce (every config
  but bf16, 16 heads, one query).

Deliberate differences, each to make the tests stricter or exact:

- every argument after ``max_seqlen_q`` is keyword-only (AITER accepts positions, but they
  moved between releases, so the backend must never rely on them);
- float32 q / KV / o (and a float32 o with fp8 q) are accepted so that the tests can
  compare at fp32 precision;
- only page size 1 and the non-persistent mode are modeled; persistent buffers, context
  parallel arguments, ``logit_cap`` and ``return_logits`` raise NotImplementedError;
- ``num_kv_splits`` defaults to ``MODEL_SPLITS`` (3) instead of AITER's occupancy heuristic,
  so the split merge is always exercised; a module's ``splits`` attribute changes it (1
  models the one-split launch AITER picks for large batches).
"""

from __future__ import annotations

import ast
import inspect
import math
import os
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
KERNEL_HEADS = (16, 128)
MODEL_SPLITS = 3
#: What a model returns for an LSE buffer the release allocates and never writes (AITER's
#: is ``torch.empty``): finite, so only a comparison with the right LSE catches its use.
UNWRITTEN = -12345.0
POSITIONAL = (
    "q",
    "kv_buffer",
    "o",
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_last_page_lens",
    "max_seqlen_q",
)
#: Arguments the model does not cover: any value but the default raises NotImplementedError.
UNMODELED = {
    "logit_cap": 0.0,
    "num_kv_splits_indptr": None,
    "work_meta_data": None,
    "work_indptr": None,
    "work_info_set": None,
    "reduce_indptr": None,
    "reduce_final_map": None,
    "reduce_partial_map": None,
    "intra_batch_mode": False,
    "return_logits": False,
    "g_kv_indptr": None,
    "cp_world_size": 1,
    "cp_rank": 0,
}
#: First release whose non-persistent ``return_lse=True`` passes the kernel lookup
#: (aiter#4308); the backend has the same fact as ``aiter.LSE_RELEASE``, the model keeps its
#: own so that a wrong one there fails here.
LOOKUP_FIXED = (0, 1, 19)
#: Compute units the backend's split choice is told it has (an MI300X).
MI300X_CUS = 304


@dataclass(frozen=True)
class ReleaseInterface:
    """One AITER release's MLA decode interface, as the model needs it."""

    version: str
    #: ``mla_decode_fwd``'s parameters: (name, default or ``inspect.Parameter.empty``)
    parameters: tuple[tuple[str, object], ...]
    #: ``_fwd_kernel_stage2_asm``'s parameter names
    reduce_parameters: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.parameters)

    def signature(self) -> inspect.Signature:
        """The release's signature, every argument after ``max_seqlen_q`` keyword-only."""
        params = []
        for name, default in self.parameters:
            kind = (
                inspect.Parameter.POSITIONAL_OR_KEYWORD
                if name in POSITIONAL
                else inspect.Parameter.KEYWORD_ONLY
            )
            params.append(inspect.Parameter(name, kind, default=default))
        return inspect.Signature(params)


#: ROCm/aiter's ``mla_decode_fwd`` at e4048607a5 (2026-08-22, after v0.1.20.post1).
CURRENT = ReleaseInterface(
    version="0.1.20.post1",
    parameters=(
        *((name, inspect.Parameter.empty) for name in POSITIONAL),
        ("page_size", 1),
        ("nhead_kv", 1),
        ("sm_scale", None),
        ("logit_cap", 0.0),
        ("num_kv_splits", None),
        ("num_kv_splits_indptr", None),
        ("work_meta_data", None),
        ("work_indptr", None),
        ("work_info_set", None),
        ("reduce_indptr", None),
        ("reduce_final_map", None),
        ("reduce_partial_map", None),
        ("q_scale", None),
        ("kv_scale", None),
        ("intra_batch_mode", False),
        ("return_logits", False),
        ("return_lse", False),
        ("g_kv_indptr", None),
        ("cp_world_size", 1),
        ("cp_rank", 0),
        ("causal", True),
    ),
    reduce_parameters=("Mid_O", "Mid_lse", "O", "Final_lse", "qo_indptr", "kv_indptr"),
)


#: v0.1.12 and v0.1.16 (ROCm/aiter tags): ``CURRENT``'s first 25 parameters, up to
#: ``return_lse``; 0.1.12's reduce writes no LSE, 0.1.16's does (aiter#2729) but its
#: ``return_lse=True`` fails the kernel lookup (fixed by aiter#4308 in 0.1.19).
_REDUCE_WITHOUT_LSE = ("Mid_O", "Mid_lse", "O", "qo_indptr", "kv_indptr")
V0_1_12 = ReleaseInterface("0.1.12", CURRENT.parameters[:25], _REDUCE_WITHOUT_LSE)
V0_1_16 = ReleaseInterface("0.1.16", CURRENT.parameters[:25], CURRENT.reduce_parameters)

#: The only amd-aiter on PyPI (2025-11): a pure-Python wheel whose interface
#: ``pypi_release`` reads.
PYPI_VERSION = "0.1.7.post2.dev18"


def pypi_wheel(version: str = PYPI_VERSION) -> Path:
    """The amd-aiter ``version`` wheel, downloaded once (``pip download --no-deps``, about
    40 MB) into ``${XDG_CACHE_HOME:-~/.cache}/rocm-mla/amd-aiter-<version>``, outside the
    clone, as ``make compile-check`` caches Triton. Raises with pip's own words when it
    cannot be had."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "rocm-mla"
    folder = cache / f"amd-aiter-{version}"
    pattern = f"amd_aiter-{version}-*.whl"
    if not any(folder.glob(pattern)):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--dest",
                str(folder),
                f"amd-aiter=={version}",
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"could not download amd-aiter=={version} into {folder} (pip exit "
                f"{done.returncode}: {done.stderr.strip()[-2000:]}); put the wheel there by "
                "hand to run these tests offline"
            )
    return next(iter(sorted(folder.glob(pattern))))


def pypi_release() -> ReleaseInterface:
    """amd-aiter ``PYPI_VERSION``'s interface, read from its wheel."""
    return read_release(pypi_wheel())


def _function_parameters(tree: ast.Module, name: str) -> tuple[tuple[str, object], ...]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            args = node.args
            positional = args.posonlyargs + args.args
            defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults))
            defaults += [ast.literal_eval(d) for d in args.defaults]
            pairs = list(zip((a.arg for a in positional), defaults, strict=True))
            for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
                pairs.append(
                    (
                        arg.arg,
                        inspect.Parameter.empty if default is None else ast.literal_eval(default),
                    )
                )
            return tuple(pairs)
    raise ValueError(f"no function {name} at the top level of aiter/mla.py")


def read_release(wheel: Path) -> ReleaseInterface:
    """The interface of the amd-aiter in ``wheel`` (a ``py3-none-any`` wheel file), read from
    its ``aiter/mla.py`` with ``ast`` and its metadata: nothing of it is imported."""
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read("aiter/mla.py").decode()
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        version = next(
            line.split(":", 1)[1].strip()
            for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Version:")
        )
    tree = ast.parse(source)
    return ReleaseInterface(
        version=version,
        parameters=_function_parameters(tree, "mla_decode_fwd"),
        reduce_parameters=tuple(n for n, _ in _function_parameters(tree, "_fwd_kernel_stage2_asm")),
    )


def release_module(
    release: ReleaseInterface, module: types.ModuleType | None = None
) -> types.ModuleType:
    """A stand-in for ``aiter.mla`` of ``release`` (a new module, or ``module`` filled in):
    ``mla_decode_fwd`` with exactly its signature, ``_fwd_kernel_stage2_asm`` carrying its
    reduce's parameters (a stub that computes nothing: the backend only reads its signature),
    ``release`` and ``splits``."""
    if module is None:
        module = types.ModuleType(f"aiter.mla (interface model of {release.version})")
    signature = release.signature()

    def mla_decode_fwd(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)  # an unknown keyword: TypeError, as AITER's
        bound.apply_defaults()
        return _decode(release, module.splits, **bound.arguments)

    def _fwd_kernel_stage2_asm(*args):
        raise NotImplementedError("the interface model's reduce stub is never launched")

    mla_decode_fwd.__signature__ = signature
    _fwd_kernel_stage2_asm.__signature__ = inspect.Signature(
        [
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            for name in release.reduce_parameters
        ]
    )
    module.mla_decode_fwd = mla_decode_fwd
    module._fwd_kernel_stage2_asm = _fwd_kernel_stage2_asm
    module.release = release
    module.splits = MODEL_SPLITS
    return module


def _release_numbers(version: str) -> tuple[int, int, int]:
    major, minor, patch = (int(part) for part in version.split(".")[:3])
    return major, minor, patch


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"mla_decode_fwd (interface model): {message}")


def _check_int32(name: str, t: torch.Tensor, device: torch.device) -> None:
    _require(
        isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1,
        f"{name} must be a 1-D int32 tensor, got {getattr(t, 'dtype', type(t))}",
    )
    _require(t.device == device, f"{name} must be on q's device {device}, got {t.device}")


def _check_dtypes(q, kv_buffer, o, q_scale, kv_scale) -> None:
    if q.dtype in FP8:
        _require(kv_buffer.dtype == q.dtype, "fp8 q needs an fp8 kv_buffer of the same type")
        for name, scale in (("q_scale", q_scale), ("kv_scale", kv_scale)):
            _require(
                isinstance(scale, torch.Tensor)
                and scale.dtype == torch.float32
                and scale.numel() == 1,
                f"fp8 q requires {name} as a [1] float32 tensor, got {scale!r}",
            )
    elif q.dtype == torch.bfloat16:
        _require(
            kv_buffer.dtype == torch.bfloat16,
            f"bf16 q runs over a bf16 kv_buffer only here, got {kv_buffer.dtype}",
        )
    elif q.dtype == torch.float32:
        _require(kv_buffer.dtype == torch.float32, "float32 q (test precision) needs float32 kv")
    else:
        raise ValueError(f"mla_decode_fwd (interface model): unsupported Q dtype {q.dtype}")
    # AITER writes bf16/fp16 only (its reduce rejects fp8 output); float32 is the test
    # precision extension.
    allowed_o = (torch.bfloat16, torch.float16, torch.float32)
    _require(o.dtype in allowed_o, f"o must be one of {allowed_o}, got {o.dtype}")


def _decode(release: ReleaseInterface, splits_default: int, **arguments):
    """The modeled ``mla_decode_fwd`` of ``release``; see the module docstring."""
    for name, default in UNMODELED.items():
        if name in arguments and arguments[name] != default:
            raise NotImplementedError(f"the interface model does not cover {name}")
    q, kv_buffer, o = arguments["q"], arguments["kv_buffer"], arguments["o"]
    qo_indptr, kv_indptr = arguments["qo_indptr"], arguments["kv_indptr"]
    kv_indices, kv_last_page_lens = arguments["kv_indices"], arguments["kv_last_page_lens"]
    max_seqlen_q = arguments["max_seqlen_q"]
    sm_scale = arguments["sm_scale"]
    q_scale, kv_scale = arguments.get("q_scale"), arguments.get("kv_scale")
    causal = arguments.get("causal", True)
    num_kv_splits = arguments["num_kv_splits"]

    _require(q.dim() == 3 and q.is_contiguous(), f"q must be dense [total_q, H, D], got {q.shape}")
    total_q, heads, head_dim = q.shape
    device = q.device
    _require(kv_buffer.dim() == 4, f"kv_buffer must be 4-D, got {tuple(kv_buffer.shape)}")
    # Releases without the keywords read both from the buffer's shape.
    page_size = arguments.get("page_size", kv_buffer.shape[1])
    nhead_kv = arguments.get("nhead_kv", kv_buffer.shape[2])
    _require(page_size == 1, f"the model covers page_size 1, got {page_size}")
    _require(nhead_kv == 1, f"only nhead_kv 1 is supported, got {nhead_kv}")
    _require(
        tuple(kv_buffer.shape[1:]) == (page_size, nhead_kv, head_dim),
        f"kv_buffer must be [num_pages, {page_size}, {nhead_kv}, {head_dim}], "
        f"got {tuple(kv_buffer.shape)}",
    )
    _require(
        o.dim() == 3 and o.shape[:2] == (total_q, heads) and o.shape[2] < head_dim,
        f"o must be [{total_q}, {heads}, Dv < {head_dim}], got {tuple(o.shape)}",
    )
    _check_dtypes(q, kv_buffer, o, q_scale, kv_scale)
    _require(heads in KERNEL_HEADS, f"no kernel for {heads} heads (kernels: {KERNEL_HEADS})")
    for name, t in (
        ("qo_indptr", qo_indptr),
        ("kv_indptr", kv_indptr),
        ("kv_indices", kv_indices),
        ("kv_last_page_lens", kv_last_page_lens),
    ):
        _check_int32(name, t, device)
    _require(
        isinstance(max_seqlen_q, int) and max_seqlen_q >= 1,
        f"max_seqlen_q must be an int >= 1, got {max_seqlen_q!r}",
    )
    batch = qo_indptr.shape[0] - 1
    _require(
        kv_indptr.shape[0] == batch + 1 and kv_last_page_lens.shape[0] == batch,
        "qo_indptr, kv_indptr ([B + 1]) and kv_last_page_lens ([B]) disagree on B",
    )
    _require(
        torch.equal(qo_indptr.cpu(), torch.arange(batch + 1, dtype=torch.int32) * max_seqlen_q)
        and total_q == batch * max_seqlen_q,
        "every request must have max_seqlen_q queries (q is strided by that many rows)",
    )
    _require(bool((kv_last_page_lens == 1).all()), "kv_last_page_lens must be 1 at page_size 1")
    # The kernel walks kv_indices[kv_indptr[b]:kv_indptr[b + 1]] unchecked: an indptr that
    # runs backwards or past the buffer reads memory that is not the request's.
    _require(
        int(kv_indptr[0]) == 0
        and bool((kv_indptr[1:] >= kv_indptr[:-1]).all())
        and int(kv_indptr[-1]) <= kv_indices.shape[0],
        "kv_indptr must run from 0, non-decreasing, to at most len(kv_indices)",
    )
    if kv_indices.numel():
        _require(
            int(kv_indices.min()) >= 0 and int(kv_indices.max()) < kv_buffer.shape[0],
            f"kv_indices must lie in [0, {kv_buffer.shape[0]})",
        )
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    _require(isinstance(sm_scale, float), f"sm_scale must be a float, got {sm_scale!r}")

    reduce_lse = "Final_lse" in release.reduce_parameters
    return_lse = arguments.get("return_lse", False)
    if reduce_lse and return_lse and _release_numbers(release.version) < LOOKUP_FIXED:
        # 0.1.13-0.1.18 hand final_lse to stage 1, whose kernel lookup then asks for an LSE
        # kernel that exists only in persistent mode (for these head counts).
        raise RuntimeError(
            f"mla_decode_stage1_asm_fwd (interface model of {release.version}): not find "
            f"kernel for lse=1, gqa {heads}, non-persistent"
        )

    dv = o.shape[2]
    splits = splits_default if num_kv_splits is None else int(num_kv_splits)
    q_deq = q.to(torch.float64) * (1.0 if q_scale is None else float(q_scale))
    kv_deq = kv_buffer[:, 0, 0].to(torch.float64) * (1.0 if kv_scale is None else float(kv_scale))

    logits = torch.zeros(total_q, splits, heads, dv, dtype=torch.float32, device=device)
    split_lse = torch.full((total_q, splits, heads), -math.inf, dtype=torch.float64, device=device)
    final = torch.empty(total_q, heads, dv, dtype=torch.float64, device=device)
    final_lse = torch.empty(total_q, heads, dtype=torch.float64, device=device)
    for b in range(batch):
        start, end = int(kv_indptr[b]), int(kv_indptr[b + 1])
        keys = kv_deq[kv_indices[start:end].long()]  # [L, D]
        length = end - start
        chunk = max(1, -(-length // splits))
        valid_splits = -(-length // chunk)
        for i in range(max_seqlen_q):
            row = b * max_seqlen_q + i
            visible = length - max_seqlen_q + 1 + i if causal else length
            scores = (q_deq[row] @ keys.T) * sm_scale  # [H, L]
            scores[:, max(visible, 0) :] = -math.inf
            # Stage 1: one normalized partial and its LSE per split of the keys.
            for s in range(valid_splits):
                part = scores[:, s * chunk : (s + 1) * chunk]
                lse = torch.logsumexp(part, dim=-1)  # [H]
                weights = torch.exp(part - lse[:, None]).nan_to_num(0.0)
                logits[row, s] = (weights @ keys[s * chunk : (s + 1) * chunk, :dv]).float()
                split_lse[row, s] = lse
            # Stage 2: AITER's running-max merge over the valid splits, 0/0 included.
            e_max = torch.full((heads,), -math.inf, dtype=torch.float64, device=device)
            e_sum = torch.zeros(heads, dtype=torch.float64, device=device)
            acc = torch.zeros(heads, dv, dtype=torch.float64, device=device)
            for s in range(valid_splits):
                new_max = torch.maximum(e_max, split_lse[row, s])
                old_scale = torch.exp(e_max - new_max)
                weight = torch.exp(split_lse[row, s] - new_max)
                acc = acc * old_scale[:, None] + weight[:, None] * logits[row, s].double()
                e_sum = e_sum * old_scale + weight
                e_max = new_max
            final[row] = acc / e_sum[:, None]
            final_lse[row] = e_max + torch.log(e_sum)
    o.copy_(final.to(o.dtype))

    if reduce_lse and "return_lse" in release.names and not return_lse:
        return logits, None
    # One split per request and not the 16-head bf16 single-query launch: the kernel writes
    # o directly (or the reduce only copies it out), and nothing writes final_lse.
    always_reduces = heads == 16 and max_seqlen_q == 1 and q.dtype not in FP8
    if not reduce_lse or (splits == 1 and not always_reduces):
        return logits, torch.full((total_q, heads), UNWRITTEN, device=device)
    return logits, final_lse.float()


#: This module is ``CURRENT``'s: ``mla_decode_fwd``, ``_fwd_kernel_stage2_asm``, ``splits``.
release_module(CURRENT, sys.modules[__name__])


def use_in_backend(monkeypatch, release: ReleaseInterface = CURRENT) -> types.ModuleType:
    """Point the aiter backend's kernel lookup (and the amd-aiter version it reads) at
    ``release``'s model; returns the module it then calls."""
    from rocm_mla.backends import aiter as aiter_backend

    module = sys.modules[__name__] if release is CURRENT else release_module(release)
    monkeypatch.setattr(aiter_backend, "_aiter_mla", lambda: module)
    monkeypatch.setattr(aiter_backend, "_aiter_version", lambda: release.version)
    monkeypatch.setattr(aiter_backend, "_compute_units", lambda device: MI300X_CUS)
    return module
