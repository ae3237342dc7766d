"""The target registry (``rocm_mla.targets``) is the one place that knows a GPU (issue 41).

- No arch name in code outside the registry: every string literal the code of the package
  (``rocm_mla/``) or of the benchmarks (``benchmarks/``) evaluates is read with ``ast`` (plain
  and f-string parts alike); one naming an arch (``gfx942``, ``gfx90a``, ``gfx1250``,
  ``sm90``, ``sm_90``...) fails, outside ``rocm_mla/targets.py`` and the case lists.
  Docstrings and comments are prose, not code: a string that is a statement of its own is not
  read. The registry's data files (``rocm_mla/kernels/configs/*.json``) are not code.
- A case list is a module-level tuple of string literals assigned to ``CASE_TARGETS`` in a
  benchmark module: the registry keys that benchmark runs by default. ``CASE_LISTS`` names
  every one there is; each holds registry keys only.
- Targets resolve as the package has them: an arch with a record of its own to it, another
  NVIDIA GPU to ``fallback`` (fp8 from sm89 on), another AMD GPU to ``hip`` (gfx942's table).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from rocm_mla import targets
from rocm_mla.targets import TARGETS, AmdResidency, NvidiaResidency, target_spec

ROOT = Path(__file__).resolve().parents[1]
#: The code scanned for arch names: the package's and the benchmarks'.
CODE = (ROOT / "rocm_mla", ROOT / "benchmarks")
REGISTRY = ROOT / "rocm_mla" / "targets.py"
#: Every case list, (module, assigned name): see the module docstring.
CASE_LISTS = {
    ("benchmarks/kernel_static.py", "CASE_TARGETS"),
    ("benchmarks/schedule.py", "CASE_TARGETS"),
}
#: Modules that still spell arch names, each to be emptied by the change that owns it (none).
PENDING: set[str] = set()
ARCH = re.compile(r"(?<![A-Za-z0-9_])(gfx[0-9]{2,4}[a-z]?|sm_?[0-9]{2,3}[a-z]?)(?![A-Za-z0-9_])")


def _prose(tree: ast.AST) -> set[int]:
    """ids of the string constants that are statements of their own (docstrings)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def _case_list_values(tree: ast.Module, name: str) -> set[int]:
    """ids of the string constants of the module-level tuple assigned to ``name``."""
    found = set()
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [t.id for t in node.targets if isinstance(t, ast.Name)] == [name]
            and isinstance(node.value, ast.Tuple)
        ):
            found |= {id(e) for e in node.value.elts if isinstance(e, ast.Constant)}
    return found


def _arch_literals(path: Path) -> list[str]:
    relative = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(), filename=str(path))
    allowed = _prose(tree)
    for module, name in CASE_LISTS:
        if module == relative:
            allowed |= _case_list_values(tree, name)
    return [
        f"{relative}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in allowed
        and ARCH.search(node.value)
    ]


def test_no_arch_name_outside_the_registry_and_the_case_lists():
    found = []
    for folder in CODE:
        for path in sorted(folder.rglob("*.py")):
            if path == REGISTRY or path.relative_to(ROOT).as_posix() in PENDING:
                continue
            found += _arch_literals(path)
    assert not found, (
        "arch names spelled in code outside rocm_mla/targets.py and the case lists (read the "
        "fact from the registry instead):\n" + "\n".join(found)
    )


def test_the_scan_finds_what_it_must():
    """The reader flags literals in comparisons and f-strings and skips docstrings."""
    source = '"""On gfx942."""\nx = arch == "gfx90a"\ny = f"{a} on sm_90"\n"""sm90 prose"""\n'
    tree = ast.parse(source)
    allowed = _prose(tree)
    flagged = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and id(n) not in allowed
        and ARCH.search(n.value)
    ]
    assert flagged == ["gfx90a", " on sm_90"]
    for name in ("gfx1250", "gfx950", "sm100a", "sm89"):
        assert ARCH.search(name), name
    for name in ("gfx9", "smem", "sm_count", "asm90"):
        assert not ARCH.search(name), name


def test_case_lists_hold_registry_keys_and_pending_modules_exist():
    for module, name in CASE_LISTS:
        tree = ast.parse((ROOT / module).read_text())
        values = [
            node.value.elts
            for node in tree.body
            if isinstance(node, ast.Assign)
            and [t.id for t in node.targets if isinstance(t, ast.Name)] == [name]
        ]
        assert len(values) == 1, f"{module}: one module-level {name}"
        keys = [ast.literal_eval(e) for e in values[0]]
        assert keys and set(keys) <= set(TARGETS), (module, keys)
    for module in PENDING:
        assert (ROOT / module).is_file(), module


def test_records_are_consistent():
    archs = [arch for spec in TARGETS.values() for arch in spec.archs]
    assert len(archs) == len(set(archs)), "an arch belongs to one record"
    tables = targets.tables()
    for key, spec in TARGETS.items():
        assert spec.key == key
        assert spec.table in tables, f"{key} reads table {spec.table!r}, no record owns it"
        assert spec.backend in ("cuda", "hip", "interpreter")
        if spec.residency is not None:
            want = NvidiaResidency if spec.backend == "cuda" else AmdResidency
            assert isinstance(spec.residency, want), key
        if isinstance(spec.residency, AmdResidency):
            assert spec.residency.agprs == (spec.residency.agpr_offset_align is not None)
        assert spec.fp8_dots <= bool(spec.fp8_dtypes), key
        if spec.aiter_mla:
            assert spec.archs and spec.fp8_dtype is not None, key
        for product in spec.products:
            assert product.units is None or product.units > 0
        if spec.archs:
            assert target_spec(spec.backend, spec.archs[0]) is spec


@pytest.mark.parametrize(
    ("backend", "arch", "key", "fp8"),
    [
        ("cuda", "sm90", "sm90", torch.float8_e4m3fn),
        ("cuda", "sm80", "fallback", None),
        ("cuda", "sm89", "fallback", torch.float8_e4m3fn),
        ("hip", "gfx942", "gfx942", torch.float8_e4m3fnuz),
        ("hip", "gfx950", "gfx950", torch.float8_e4m3fn),
        ("hip", "gfx1250", "gfx1250", torch.float8_e4m3fn),
        ("hip", "gfx90a", "hip", torch.float8_e4m3fn),
        ("interpreter", None, "interpreter", torch.float8_e4m3fn),
        (None, None, "interpreter", torch.float8_e4m3fn),
    ],
)
def test_targets_resolve_to_their_record_or_their_family(backend, arch, key, fp8):
    spec = target_spec(backend, arch)
    assert (spec.key, spec.fp8_dtype) == (key, fp8)
    assert spec.fp8_dots == (fp8 is not None and key != "hip")
    with pytest.raises(ValueError, match="backend must be"):
        target_spec("metal", "m3")


def test_products_are_found_by_device_name():
    assert targets.find_product("AMD Instinct MI300X").units == 304
    assert targets.find_product("NVIDIA H200").hbm_bytes_per_s == 4.8e12
    assert targets.find_product("cpu-x86_64-2threads") is None
