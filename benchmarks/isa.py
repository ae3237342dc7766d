"""Readers of what Triton's compilers emit, for the benchmarks' compile-level gate
(``benchmarks/kernel_static.py``): the PTX/cubin/SASS of an NVIDIA build (``read_cuda``,
``read_sass_loop``), the amdgcn text of an AMD one (``read_amdgcn``, ``read_amdgcn_loop``),
and the TTGIR both share (``read_ttgir``), with the opcode tables they count by (matrix ops,
shared-memory accesses by width).

Each reader returns plain facts (counts, registers, spills, the main loop's ops); what they
mean for a case (the gates) is ``kernel_static``'s. Nothing here compiles: the compile is
``rocm_mla.kernels.occupancy.compile_for``, the planner's own, and an amdgcn build's register
counts are read by the planner's ``occupancy.amdgcn_registers`` (the package cannot import
this module), which ``read_amdgcn`` calls.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from pathlib import Path


def _triton_bin(name: str) -> Path:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"isa: {path} is missing from the Triton wheel")
    return path


def read_cuda(
    ptx: str,
    cubin: bytes,
    ptxas_log: str,
    fp_fusion: bool,
    excerpt: bool = False,
    *,
    capability: int,
) -> dict:
    """Registers (the cubin's), spill bytes (ptxas's log of that build) and the SASS loop.

    ``ptxas_log`` is what Triton's own ptxas run printed; on a Triton cache hit there was no
    run, so ptxas runs again with the flags Triton passes for compute ``capability`` (90:
    ``sm_90a``; same registers, checked)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin_path = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx_path.write_text(ptx)
        cubin_path.write_bytes(cubin)
        if "bytes spill stores" not in ptxas_log:
            # Triton 3.6 on picks ptxas by arch; 3.4 and 3.5 have one.
            ptxas = (
                get_ptxas(capability) if inspect.signature(get_ptxas).parameters else get_ptxas()
            )
            command = [ptxas.path, "-lineinfo", "-v", "--regAllocOptLevel=2"]
            command += [] if fp_fusion else ["--fmad=false"]
            gpu = f"--gpu-name=sm_{capability}a"
            command += [gpu, str(ptx_path), "-o", str(Path(tmp) / "v.cubin")]
            ptxas_log = subprocess.run(command, capture_output=True, text=True, check=True).stderr

        def cuobjdump(flag: str) -> str:
            command = [str(_triton_bin("cuobjdump")), flag, str(cubin_path)]
            return subprocess.run(command, capture_output=True, text=True, check=True).stdout

        usage, sass = cuobjdump("-res-usage"), cuobjdump("-sass")
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    used = re.search(r"Used (\d+) registers", ptxas_log)
    regs = re.search(r"REG:(\d+)", usage)
    if spills is None or regs is None or used is None:
        raise RuntimeError(f"isa: unreadable ptxas/cuobjdump output:\n{ptxas_log}\n{usage}")
    if used.group(1) != regs.group(1):
        raise RuntimeError(
            f"isa: ptxas's log says {used.group(1)} registers, the cubin "
            f"{regs.group(1)}: the log is not of this build"
        )
    return {
        "regs_per_thread": int(regs.group(1)),
        "spill_store_bytes": int(spills.group(1)),
        "spill_load_bytes": int(spills.group(2)),
        "loop": read_sass_loop(sass, excerpt),
    }


_SASS_LINE = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);"
)
_SASS_MMA = re.compile(r"^(HGMMA|QGMMA|HMMA|QMMA)\.(\d+x\d+x\d+|\d+)\.(.*)$")
#: SASS opcodes counted in the loop, by prefix.
_SASS_COUNTED = ("LDGSTS", "UTMALDG", "LDG", "LDS", "LDSM", "STS", "STL", "LDL", "MUFU.EX2", "BAR")


def _sass_matrix_shape(opcode: str) -> tuple[int, int, int, str] | None:
    match = _SASS_MMA.match(opcode)
    if match is None:
        return None
    family, shape, types = match.groups()
    if "x" in shape:
        m, n, k = (int(v) for v in shape.split("x"))
    else:  # mma.sync: "16816" is m16 n8 k16, "16832" m16 n8 k32
        m, n, k = int(shape[:2]), int(shape[2]), int(shape[3:])
    kind = "fp8" if family.startswith("Q") or "E4M3" in types or "E5M2" in types else "16bit"
    return m, n, k, kind


def read_sass_loop(sass: str, excerpt: bool = False) -> dict:
    """Counts in the body of the first innermost backward branch (a loop holding no other
    loop with matrix ops) with the most matrix ops; with ``excerpt`` also its SASS lines
    (without their encodings), which this reader reads back to the same counts."""
    instructions = [
        (int(m.group(1), 16), m.group(2), m.group(3)) for m in _SASS_LINE.finditer(sass)
    ]
    loops = []
    for addr, opcode, operands in instructions:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if target is not None and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            body = [op for a, op, _ in instructions if start <= a <= addr]
            if "EXIT" in body:
                # Not a loop: a divergent-branch fallback placed after the kernel's end
                # (``BRA.DIV``) jumps back to where it left.
                continue
            matrix = sum(_sass_matrix_shape(op) is not None for op in body)
            loops.append((matrix, -addr, body, (start, addr)))
    if not loops:
        return {"found": False}
    # A loop around the KV walk (stage 1's loop over its slot's segments) holds its matrix
    # ops too, and the pipeliner's peeled ones: only loops that hold no other loop with
    # matrix ops are the walk's candidates.
    spans = [span for matrix, _, _, span in loops if matrix]
    loops = [
        loop
        for loop in loops
        if not any(s != loop[3] and loop[3][0] <= s[0] and s[1] <= loop[3][1] for s in spans)
    ]
    # The first of the loops with the most matrix ops, as in the TTGIR (a verify window's
    # walk over the tiles every row sees comes first).
    _, _, body, (first, last) = max(loops, key=lambda loop: loop[:2])
    matrix: dict[str, int] = {}
    counts = dict.fromkeys(_SASS_COUNTED, 0)
    for op in body:
        if _sass_matrix_shape(op) is not None:
            matrix[op] = matrix.get(op, 0) + 1
        for prefix in _SASS_COUNTED:
            if op == prefix or op.startswith(prefix + "."):
                counts[prefix] += 1
    loop = {
        "found": True,
        "instructions": len(body),
        "matrix": matrix,
        "counts": counts,
        "shared": shared_counts(body, "cuda"),
    }
    if excerpt:
        loop["excerpt"] = "\n".join(
            " ".join(m.group(0).split())
            for m in _SASS_LINE.finditer(sass)
            if first <= int(m.group(1), 16) <= last
        )
    return loop


#: AMD matrix ops: MFMA (CDNA3 / CDNA4, per wave of 64) and WMMA (gfx1250, per wave of 32),
#: ``v_mfma_f32_16x16x32_bf16``, ``v_wmma_f32_16x16x64_fp8_fp8``: M x N x K and the operands.
_AMD_MFMA = re.compile(r"^v_(?:mfma|wmma)_(?:scale_)?[a-z0-9]+?_(\d+)x(\d+)x(\d+)_?([a-z0-9_]*)$")
#: amdgcn mnemonics counted in the loop, by prefix.
_AMD_COUNTED = (
    "buffer_load",
    "global_load",
    "ds_read",
    "ds_write",
    "ds_load",
    "ds_store",
    "s_waitcnt",
    "s_barrier",
    "scratch_",
    "buffer_store",
    "v_accvgpr_read",
    "v_accvgpr_write",
    "v_exp_f32",
)


def _amd_matrix_shape(mnemonic: str) -> tuple[int, int, int, str] | None:
    match = _AMD_MFMA.match(mnemonic)
    if match is None:
        return None
    m, n, k = (int(v) for v in match.groups()[:3])
    kind = "fp8" if re.search(r"fp8|bf8|f8", match.group(4)) else "16bit"
    return m, n, k, kind


def read_amdgcn(text: str, excerpt: bool = False, *, agprs: bool = True) -> dict:
    """Resources and the main loop of an amdgcn text; ``agprs``: the target has AGPRs (else it
    has none, and the text reports none). ``llvm_occupancy`` is LLVM's own waves per SIMD for
    the kernel's registers and workgroup size (LDS, dynamic in Triton, not counted)."""

    from rocm_mla.kernels.occupancy import amdgcn_registers

    def number(pattern: str) -> int:
        match = re.search(pattern, text)
        if match is None:
            raise RuntimeError(f"isa: {pattern!r} not in the amdgcn text")
        return int(match.group(1))

    registers = amdgcn_registers(text, agprs=agprs)
    return {
        "regs_per_thread": registers["regs_per_thread"],
        "agprs_per_thread": registers.get("agprs_per_thread", 0),
        "llvm_occupancy": number(r"; Occupancy: (\d+)"),
        "sgprs_per_wave": registers["sgprs_per_wave"],
        "vgpr_spill_count": number(r"\.vgpr_spill_count:\s+(\d+)"),
        "sgpr_spill_count": number(r"\.sgpr_spill_count:\s+(\d+)"),
        "scratch_bytes": number(r"; ScratchSize: (\d+)"),
        "loop": read_amdgcn_loop(text, excerpt),
    }


def read_amdgcn_loop(text: str, excerpt: bool = False) -> dict:
    """Counts in the blocks of the innermost loop (LLVM's ``Loop Header`` / ``in Loop:
    Header=`` block comments, which name a block's innermost loop) that holds the most
    MFMAs, among the loops that enclose no other loop with MFMAs (stage 1's loop over its
    slot's segments holds the KV walk, and the pipeliner's peeled iterations); with
    ``excerpt`` also the loop's blocks as text (labels, their loop comments and the
    instructions), which this reader reads back to the same counts."""
    blocks: dict[str, list[str]] = {}
    lines: dict[str, list[str]] = {}  # loop header -> its blocks' lines, for the excerpt
    enclosing: dict[str, set[str]] = {}  # loop header -> the loops around it
    current = None
    label, notes = None, ""  # a block whose label comments (one line or more) are being read
    heading: list[str] = []  # that block's label and comment lines

    def settle() -> None:
        nonlocal current, label, notes
        if label is None:
            return
        member = re.search(r"in Loop: Header=BB(\d+_\d+) Depth=\d+", notes)
        if label and re.search(r"Loop Header: Depth=\d+", notes):
            current = label
            enclosing[label] = set(re.findall(r"Parent Loop BB(\d+_\d+) Depth=\d+", notes))
        else:
            current = member.group(1) if member else None
        if current is not None:
            lines.setdefault(current, []).extend(heading)
        label, notes = None, ""

    for line in text.splitlines():
        block = re.match(r"^(?:\.LBB(\d+_\d+):|; %bb\.\d+:)(.*)", line)
        if block:
            label, notes, current = block.group(1) or "", block.group(2), None
            heading = [line]
            continue
        if re.match(r"^\s*;", line):
            if label is not None:
                notes += line
                heading.append(line)
            continue
        if re.match(r"^\s*(\.|$)", line) or re.match(r"^[A-Za-z_.]\S*:", line):
            if re.match(r"^[A-Za-z_]\S*:", line):
                label, current = None, None
            continue
        settle()
        if current is not None:
            blocks.setdefault(current, []).append(line.split()[0])
            lines[current].append(line)
    if not blocks:
        return {"found": False}

    def mfmas(ops: list[str]) -> int:
        return sum(_amd_matrix_shape(op) is not None for op in ops)

    outer = {o for loop, ops in blocks.items() if mfmas(ops) for o in enclosing.get(loop, ())}
    header = max((loop for loop in blocks if loop not in outer), key=lambda h: mfmas(blocks[h]))
    body = blocks[header]
    matrix: dict[str, int] = {}
    counts = dict.fromkeys(_AMD_COUNTED, 0)
    for op in body:
        if _amd_matrix_shape(op) is not None:
            matrix[op] = matrix.get(op, 0) + 1
        for prefix in _AMD_COUNTED:
            if op.startswith(prefix):
                counts[prefix] += 1
    direct_to_lds = len(re.findall(r"^\s*(?:buffer|global)_load\S*.*\blds\b", "\n".join(body)))
    loop = {
        "found": True,
        "instructions": len(body),
        "matrix": matrix,
        "counts": counts,
        "shared": shared_counts(body, "hip"),
        "direct_to_lds_loads": direct_to_lds,
    }
    if excerpt:
        loop["excerpt"] = "\n".join(lines[header])
    return loop


# ---- shared-memory accesses by width ---------------------------------------------------------

#: sm90 SASS shared loads and stores: ``LDS``/``STS`` (``.U8``/``.S8``: a byte, ``.U16``/``.S16``
#: 16 bits, ``.64``/``.128``, none: 32 bits a thread) and the matrix forms ``LDSM``/``STSM``
#: (``.16.M88``/``.MT88`` with ``.2``/``.4``: one, two or four 8x8 matrices of 16-bit values,
#: 32 bits a thread each, read as 16-byte rows).
_SASS_SHARED = re.compile(r"^(LDS|STS|LDSM|STSM)(\.[A-Z0-9.]+)?$")
#: AMD LDS accesses: ``ds_read_*``/``ds_write_*`` and their newer names ``ds_load_*``/
#: ``ds_store_*``, the ``2``/``2st64`` forms doing two accesses, a type of ``b``/``u``/``i`` and
#: its bits (gfx950's transposing reads ``ds_read_b64_tr_b16`` move 64 bits a lane).
_AMD_SHARED = re.compile(
    r"^ds_(read|write|load|store)(2st64|2)?_(?:addtid_|tr\d+_)?[biu](\d+)(_tr\w*)?(_d16\w*)?$"
)


def shared_counts(body: list[str], backend: str) -> dict[str, int]:
    """The shared-memory loads and stores of a loop body, by full opcode."""
    pattern = _SASS_SHARED if backend == "cuda" else _AMD_SHARED
    counts: dict[str, int] = {}
    for op in body:
        if pattern.match(op):
            counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items()))


def shared_access(op: str, backend: str) -> tuple[int, int]:
    """``(bits one access moves per thread / lane, accesses the instruction makes)`` of a
    shared-memory opcode (``_shared_counts``'s keys)."""
    if backend == "cuda":
        family, *tokens = op.split(".")
        if family in ("LDSM", "STSM"):
            matrices = 4 if "4" in tokens else 2 if "2" in tokens else 1
            return 32 * matrices, 1
        for names, bits in (
            (("U8", "S8"), 8),
            (("U16", "S16"), 16),
            (("64",), 64),
            (("128",), 128),
        ):
            if any(t in names for t in tokens):
                return bits, 1
        return 32, 1
    match = _AMD_SHARED.match(op)
    if match is None:
        raise ValueError(f"isa: {op!r} is not an LDS load or store")
    return int(match.group(3)), 2 if match.group(2) else 1


_TENSOR = re.compile(r"tensor<([0-9x]+)x[A-Za-z0-9!.<>]+?[,>]")
_MEMDESC_ALLOC = re.compile(
    r"(%[\w#]+) = ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<([0-9x]+)x"
)


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split("x"))


def read_ttgir(text: str) -> dict:
    """Shared buffers, async copies and register round trips of the KV loop in TTGIR.

    Returns the raw facts; ``_kv_facts`` interprets them with the tile shape."""
    lines = text.splitlines()
    loops, depth, stack = [], 0, []
    for i, line in enumerate(lines):
        code = re.sub(r'"[^"]*"', "", line)
        if "scf.for" in code and code.rstrip().endswith("{"):
            stack.append((i, depth))
        depth += code.count("{") - code.count("}")
        while stack and depth <= stack[-1][1]:
            start, _ = stack.pop()
            loops.append((start, i))
    dots = ("tt.dot ", "ttng.warp_group_dot ", "tt.dot_scaled ")

    def dot_count(span) -> int:
        return sum(any(d in lines[j] for d in dots) for j in range(span[0], span[1] + 1))

    # Only loops that hold no other loop with dots: the KV walk and a causal verify window's
    # tail tiles, not stage 1's loop over its slot's segments around them.
    dotted = [span for span in loops if dot_count(span)]
    loops = [
        (a, b) for a, b in loops if not any((a, b) != s and a <= s[0] and s[1] <= b for s in dotted)
    ]
    # The first of the loops with the most dots: the KV walk (a causal verify window's tail
    # tiles come after it, in a loop of their own).
    main = max(loops, key=dot_count, default=None)
    allocs = [(m.group(1), _dims(m.group(2))) for m in _MEMDESC_ALLOC.finditer(text)]
    facts: dict = {
        "multi_buffer_allocs": [list(dims) for _, dims in allocs],
        "loop_found": main is not None,
    }
    if main is None:
        return facts
    body = lines[main[0] : main[1] + 1]
    # The buffers the main loop itself uses (another loop, e.g. a verify window's guarded
    # tail, may have its own).
    used = set(re.findall(r"%[\w#]+", "\n".join(body)))
    facts["multi_buffer_allocs"] = [list(dims) for name, dims in allocs if name in used]
    facts["loop_ops"] = _loop_ops(body)
    # The other loops with dots (a verify window's tail tiles): checked for round trips too.
    facts["other_loop_ops"] = [
        _loop_ops(lines[a : b + 1]) for a, b in loops if (a, b) != main and dot_count((a, b))
    ]
    return facts


def _loop_ops(body: list[str]) -> list[tuple]:
    """``(result, op, operands, rest)`` of each op line of a loop body."""
    ops = []
    for line in body:
        match = re.match(r"\s*(%[\w#:]+)(?:, %[\w#]+)* = ([\w.]+)(.*)", line)
        if match:
            result, op, rest = match.groups()
            operands = re.findall(r"%[\w#]+", rest.split(" : ")[0])
            ops.append((result.split(":")[0], op, operands, rest))
        else:
            match = re.match(r"\s*([\w.]+) (.*)", line)
            if match:
                operands = re.findall(r"%[\w#]+", match.group(2).split(" : ")[0])
                ops.append((None, match.group(1), operands, match.group(2)))
    return ops


def matrix_shape(op: str, backend: str) -> tuple[int, int, int, str]:
    """``(M, N, K, operand kind)`` of a matrix op the loop readers counted (their
    ``loop["matrix"]`` keys), on ``backend`` ("cuda": SASS, "hip": amdgcn)."""
    shape = _sass_matrix_shape(op) if backend == "cuda" else _amd_matrix_shape(op)
    if shape is None:
        raise ValueError(f"isa: {op!r} is not a {backend} matrix op")
    return shape


def tensor_shape(types: str) -> tuple[int, ...] | None:
    """The dims of the first ``tensor<...>`` type in TTGIR ``types`` text, or None."""
    match = _TENSOR.search(types)
    return _dims(match.group(1)) if match else None
