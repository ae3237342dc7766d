"""No module imports from a floor above its own (the floors: docs/architecture.md, "Layers").

Every ``import`` in rocm_mla/ is read with
``ast``, at module level and inside functions alike (a lazy import is still a dependency), and
resolved to the package module it names. A module may import from its own floor or any floor
below. A module that sits on no floor fails too, so a new module gets placed on purpose.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package name it is installed under.
SOURCES = {ROOT / "rocm_mla": "rocm_mla"}

# Lowest floor first. A module belongs to the floor of its longest matching prefix, except
# the package root: a facade that re-exports the api and (lazily) the engine, it is the top
# floor and holds only itself.
ROOT_PACKAGE = "rocm_mla"
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "rocm_mla.inputs",
            "rocm_mla.contract",
            "rocm_mla.merge",
            "rocm_mla.platform",
            "rocm_mla.distributed",
        ),
    ),
    ("kernels", ("rocm_mla.kernels",)),
    ("backends", ("rocm_mla.backends",)),
    ("api", ("rocm_mla.api",)),
    ("dcp", ("rocm_mla.dcp",)),
    ("models", ("rocm_mla.models",)),
    ("engine", ("rocm_mla.engine",)),
    ("integrations and cli", ("rocm_mla.integrations", "rocm_mla.cli")),
    ("package root", ()),
]

# Upward imports that exist today, each to be removed by the code that owns it (none now).
KNOWN_UPWARD: set[tuple[str, str]] = set()

# The Triton decode's modules inside the kernels floor, in import order, as ranks: a module
# imports only from modules of earlier ranks, never from its own (docs/architecture.md,
# "Layers"). The schedule package's modules run cost <- tables <- host, device (neither
# imports the other) <- views <- the package, which re-exports them; plan comes after it
# (choose_num_kv_splits charges the schedule's cost model).
KERNEL_ORDER: list[tuple[str, ...]] = [
    ("rocm_mla.kernels.mla_decode_kernel",),
    ("rocm_mla.kernels.mla_decode_args",),
    ("rocm_mla.kernels.occupancy",),
    ("rocm_mla.kernels.schedule.cost",),
    ("rocm_mla.kernels.schedule.tables",),
    ("rocm_mla.kernels.schedule.host", "rocm_mla.kernels.schedule.device"),
    ("rocm_mla.kernels.schedule.views",),
    ("rocm_mla.kernels.schedule",),
    ("rocm_mla.kernels.plan",),
    ("rocm_mla.kernels.mla_decode",),
]
KERNEL_RANK = {module: rank for rank, tier in enumerate(KERNEL_ORDER) for module in tier}
# The kernels the Triton decode builds on: they import none of KERNEL_ORDER.
KERNEL_BASE = [
    "rocm_mla.kernels.merge_states",
    "rocm_mla.kernels.quantize_q",
    "rocm_mla.kernels.residency",
    "rocm_mla.kernels.target",
    "rocm_mla.kernels.tuned_configs",
]
# Triton's compiler internals: only OCCUPANCY compiles stage 1 by hand, so only it imports
# them. The target probe asks the runtime's active driver what GPU there is: that one import
# is allowed, nothing else.
TRITON_INTERNALS = ("triton.compiler", "triton.backends", "triton.runtime")
OCCUPANCY = "rocm_mla.kernels.occupancy"
ALLOWED_TRITON_INTERNALS = {("rocm_mla.kernels.target", "triton.runtime.driver")}


@dataclass(frozen=True)
class Upward:
    module: str
    line: int
    imported: str

    def __str__(self) -> str:
        return (
            f"{self.module}:{self.line} ({floor_name(self.module)}) imports {self.imported} "
            f"({floor_name(self.imported)})"
        )


def floor_of(module: str) -> int | None:
    if module == ROOT_PACKAGE:
        return len(FLOORS) - 1
    best: tuple[int, int] | None = None  # (prefix length, floor index)
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def floor_name(module: str) -> str:
    index = floor_of(module)
    return "no floor" if index is None else FLOORS[index][0]


def package_modules() -> dict[str, tuple[Path, bool]]:
    """Installed module name -> (source file, is a package __init__)."""
    modules = {}
    for folder, package in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            modules[".".join([package, *parts])] = (path, is_package)
    return modules


def imported_modules(
    module: str, source: str, is_package: bool, root: str = "rocm_mla"
) -> list[tuple[int, str]]:
    """(line, module name) for every import of package `root` in `source`, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import name` imports the submodule pkg.name when there is one; the
            # floor lookup by prefix makes either reading land on the right floor.
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == root]


def imported_target(name: str, modules: Collection[str]) -> str:
    """The package module an imported dotted name resolves to: itself, or the nearest parent
    (`rocm_mla.api.mla_decode` -> `rocm_mla.api`; a name re-exported by the root -> the root).
    """
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def upward_imports(
    module: str, source: str, is_package: bool = False, modules: Collection[str] | None = None
) -> list[Upward]:
    modules = package_modules() if modules is None else modules
    own = floor_of(module)
    assert own is not None, f"{module} is on no floor: add it to FLOORS in {__file__}"
    upward = []
    for line, name in imported_modules(module, source, is_package):
        target = imported_target(name, modules)
        if floor_of(target) is None or floor_of(target) > own:
            upward.append(Upward(module, line, target))
    return upward


def later_kernel_imports(
    module: str, source: str, modules: Collection[str] | None = None, is_package: bool = False
) -> list[tuple[int, str]]:
    """(line, module) for each import in `source` (of `module`) of a module of its own rank
    in KERNEL_ORDER (itself included) or a later one; for a module outside KERNEL_ORDER, of
    any module in it."""
    modules = set(package_modules() if modules is None else modules) | set(KERNEL_RANK)
    own = KERNEL_RANK.get(module, 0)
    later = []
    for line, name in imported_modules(module, source, is_package):
        target = imported_target(name, modules)
        if target in KERNEL_RANK and KERNEL_RANK[target] >= own:
            later.append((line, target))
    return later


def triton_internal_imports(module: str, source: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, name) for each import of Triton's compiler internals in `source` that is not
    allowed for `module`."""
    return [
        (line, name)
        for line, name in imported_modules(module, source, is_package, root="triton")
        if any(name == p or name.startswith(p + ".") for p in TRITON_INTERNALS)
        and module != OCCUPANCY
        and (module, name) not in ALLOWED_TRITON_INTERNALS
    ]


def test_every_module_sits_on_a_floor():
    unplaced = [m for m in package_modules() if floor_of(m) is None]
    assert not unplaced, f"modules on no floor (add them to FLOORS): {unplaced}"


def test_no_module_imports_from_a_higher_floor():
    modules = package_modules()
    found = set()
    problems = []
    for module, (path, is_package) in modules.items():
        for upward in upward_imports(module, path.read_text(), is_package, modules):
            if (module, upward.imported) in KNOWN_UPWARD:
                found.add((module, upward.imported))
            else:
                problems.append(str(upward))
    assert not problems, "upward imports:\n" + "\n".join(problems)
    # A known exception that is gone must leave the list, so the list stays true.
    assert found == KNOWN_UPWARD, f"no longer imported upward: {KNOWN_UPWARD - found}"


@pytest.mark.parametrize(
    ("module", "is_package", "source", "imported"),
    [
        ("rocm_mla.inputs", False, "from rocm_mla.engine import LLM\n", "rocm_mla.engine"),
        (
            "rocm_mla.backends.triton",
            False,
            "import torch\n\ndef run():\n    import rocm_mla.dcp\n",
            "rocm_mla.dcp",
        ),
        (
            "rocm_mla.kernels.mla_decode",
            False,
            "from ..backends import base\n",
            "rocm_mla.backends.base",
        ),
        ("rocm_mla.backends", True, "from ..models import kimi_k3\n", "rocm_mla.models.kimi_k3"),
        ("rocm_mla.api", False, "from rocm_mla import cli\n", "rocm_mla.cli"),
        ("rocm_mla.dcp.layout", False, "from rocm_mla import LLM\n", "rocm_mla"),
    ],
)
def test_the_check_finds_a_synthetic_upward_import(module, is_package, source, imported):
    (upward,) = upward_imports(module, source, is_package)
    assert (upward.module, upward.imported) == (module, imported)
    assert floor_of(upward.imported) > floor_of(module)
    assert "imports" in str(upward)


def test_the_check_allows_same_and_lower_floors():
    source = (
        "from rocm_mla.inputs import prepare_decode\n"
        "from . import base\n"
        "from rocm_mla.kernels.mla_decode import decode\n"
        "import torch\n"
    )
    assert upward_imports("rocm_mla.backends.triton", source) == []


def test_a_module_on_no_floor_is_refused():
    with pytest.raises(AssertionError, match="on no floor"):
        upward_imports("elsewhere.module", "import os\n")


def kernel_order_problems(modules: dict[str, tuple[Path, bool]]) -> list[str]:
    """The imports against KERNEL_ORDER of its modules and KERNEL_BASE's among `modules`;
    a module named there that is not among them fails (a moved module gets placed again)."""
    named = [*KERNEL_RANK, *KERNEL_BASE]
    missing = [m for m in named if m not in modules]
    assert not missing, f"modules named in KERNEL_ORDER / KERNEL_BASE not on disk: {missing}"
    problems = []
    for module in named:
        path, is_package = modules[module]
        for line, later in later_kernel_imports(module, path.read_text(), modules, is_package):
            problems.append(f"{module}:{line} imports {later}, against KERNEL_ORDER")
    return problems


def test_kernel_modules_import_only_earlier_ones():
    problems = kernel_order_problems(package_modules())
    assert not problems, "kernel modules importing out of order:\n" + "\n".join(problems)


def test_a_kernel_module_missing_on_disk_is_reported():
    modules = dict(package_modules())
    modules.pop("rocm_mla.kernels.schedule.host")
    with pytest.raises(AssertionError, match=r"not on disk: \['rocm_mla.kernels.schedule.host'\]"):
        kernel_order_problems(modules)


def test_every_schedule_module_has_a_rank():
    """A new module of the schedule package gets its place in KERNEL_ORDER on purpose."""
    unranked = [
        m
        for m in package_modules()
        if m.split(".")[:3] == ["rocm_mla", "kernels", "schedule"] and m not in KERNEL_RANK
    ]
    assert not unranked, f"schedule modules not in KERNEL_ORDER: {unranked}"


def test_only_occupancy_imports_tritons_compiler_internals():
    modules = package_modules()
    problems = [
        f"{module}:{line} imports {name}"
        for module, (path, is_package) in modules.items()
        for line, name in triton_internal_imports(module, path.read_text(), is_package)
    ]
    assert not problems, f"Triton's compiler internals outside {OCCUPANCY}:\n" + "\n".join(problems)
    # The allowance stays true: the import it names exists.
    for module, name in ALLOWED_TRITON_INTERNALS:
        path, is_package = modules[module]
        found = imported_modules(module, path.read_text(), is_package, root="triton")
        assert name in {n for _, n in found}, f"{module} no longer imports {name}: drop it"
    path, _ = modules[OCCUPANCY]
    found = imported_modules(OCCUPANCY, path.read_text(), False, root="triton")
    assert any(n.startswith("triton.compiler.") for _, n in found)


@pytest.mark.parametrize(
    ("module", "source", "imported"),
    [
        (
            "rocm_mla.kernels.mla_decode_kernel",
            "from rocm_mla.kernels.mla_decode_args import _dot_types\n",
            "rocm_mla.kernels.mla_decode_args",
        ),
        (
            "rocm_mla.kernels.mla_decode_args",
            "def f():\n    from rocm_mla.kernels import occupancy\n",
            "rocm_mla.kernels.occupancy",
        ),
        ("rocm_mla.kernels.occupancy", "from . import plan\n", "rocm_mla.kernels.plan"),
        (
            "rocm_mla.kernels.schedule.host",
            "from rocm_mla.kernels import plan\n",
            "rocm_mla.kernels.plan",
        ),
        (
            "rocm_mla.kernels.plan",
            "from rocm_mla.kernels.mla_decode import mla_decode\n",
            "rocm_mla.kernels.mla_decode",
        ),
        (
            "rocm_mla.kernels.schedule.host",
            "from rocm_mla.kernels.schedule.device import empty_tables\n",
            "rocm_mla.kernels.schedule.device",
        ),
        (
            "rocm_mla.kernels.schedule.cost",
            "from rocm_mla.kernels.schedule import PIECE_KEYS\n",
            "rocm_mla.kernels.schedule",
        ),
        (
            "rocm_mla.kernels.mla_decode",
            "from rocm_mla.kernels import mla_decode as md\n",
            "rocm_mla.kernels.mla_decode",
        ),
    ],
)
def test_the_order_check_finds_a_synthetic_later_import(module, source, imported):
    assert later_kernel_imports(module, source) == [(source.count("\n"), imported)]


def test_the_order_check_finds_a_base_module_importing_the_decode():
    source = "from rocm_mla.kernels.mla_decode_kernel import _mla_decode_stage1\n"
    assert later_kernel_imports("rocm_mla.kernels.merge_states", source) == [
        (1, "rocm_mla.kernels.mla_decode_kernel")
    ]


def test_the_order_check_allows_earlier_and_outside_modules():
    source = (
        "from rocm_mla.kernels.mla_decode_kernel import _mla_decode_stage1\n"
        "from rocm_mla.kernels.mla_decode_args import _dot_types\n"
        "from . import merge_states, residency\n"
        "from rocm_mla.inputs import FAULT_BLOCK_ID\n"
        "import triton\n"
    )
    assert later_kernel_imports("rocm_mla.kernels.occupancy", source) == []


@pytest.mark.parametrize(
    "source",
    [
        "from triton.compiler import ASTSource\n",
        "def f():\n    from triton.backends.compiler import GPUTarget\n",
        "import triton.runtime.jit\n",
        "from triton import runtime\n",
    ],
)
def test_the_internals_check_finds_a_synthetic_import(source):
    (found,) = triton_internal_imports("rocm_mla.kernels.plan", source, False)
    assert found[1].startswith(TRITON_INTERNALS)
    assert triton_internal_imports(OCCUPANCY, source, False) == []


def test_the_internals_check_allows_the_language_and_the_target_probe():
    source = "import triton\nimport triton.language as tl\nfrom triton import cdiv\n"
    assert triton_internal_imports("rocm_mla.kernels.plan", source, False) == []
    probe = "def f():\n    from triton.runtime import driver\n"
    assert triton_internal_imports("rocm_mla.kernels.target", probe, False) == []
    assert len(triton_internal_imports("rocm_mla.kernels.plan", probe, False)) == 1


#: Each framework's integration: what it shares with the others is in INTEGRATIONS_COMMON,
#: and it imports no other framework's modules (issue 41, item 4).
FRAMEWORK_INTEGRATIONS = ("rocm_mla.integrations.vllm", "rocm_mla.integrations.sglang")
INTEGRATIONS_COMMON = "rocm_mla.integrations.common"


def cross_framework_imports(module: str, source: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, name) for each import in ``module`` of another framework's integration."""
    own = next((f for f in FRAMEWORK_INTEGRATIONS if module.startswith(f)), None)
    return [
        (line, name)
        for line, name in imported_modules(module, source, is_package)
        if any(name.startswith(f + ".") or name == f for f in FRAMEWORK_INTEGRATIONS if f != own)
        and own is not None
    ]


def test_each_framework_integration_imports_only_the_common_layer():
    problems = []
    for module, (path, is_package) in package_modules().items():
        problems += [
            f"{module}:{line} imports {name}"
            for line, name in cross_framework_imports(module, path.read_text(), is_package)
        ]
    assert not problems, (
        f"a framework's integration imports another's (share it through {INTEGRATIONS_COMMON}):"
        f" {problems}"
    )


def test_the_cross_framework_check_finds_a_synthetic_import():
    source = "from rocm_mla.integrations.vllm.plugin import BACKEND_ENV\n"
    found = cross_framework_imports("rocm_mla.integrations.sglang.plugin", source, False)
    assert found == [(1, "rocm_mla.integrations.vllm.plugin.BACKEND_ENV")]
    common = "from rocm_mla.integrations.common import BACKEND_ENV\n"
    assert cross_framework_imports("rocm_mla.integrations.sglang.plugin", common, False) == []
