"""The framework releases the integrations are tested against, and registration under another
one (issue 43, item 5): one log line naming the version and what was checked, then either
registering or leaving the framework's own backends in charge, never a failure later.

Here without vLLM or SGLang: a small framework package written into a temporary folder
stands in for one (its registry module and a base class our integration module overrides),
and the real plugins are registered with their framework missing altogether. The same checks
against the real vLLM and SGLang: tests/test_vllm_plugin.py and tests/test_sglang_plugin.py.
"""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest

from rocm_mla.integrations import common
from rocm_mla.integrations.common import SGLANG, VLLM, ReleasesTested, check_release


@pytest.mark.parametrize(
    ("version", "inside"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.33.4", True),
        ("0.33.0.post1", True),
        ("0.31.0", False),
        ("0.32.0rc1", False),
        ("0.34.0", False),
        ("1.0.0", False),
        (None, False),
        ("main", False),
    ],
)
def test_vllm_range(version, inside):
    assert VLLM.covers(version) is inside


@pytest.mark.parametrize(
    ("version", "inside"),
    [("0.5.23", True), ("0.5.23.post2", True), ("0.5.22", False), ("0.5.24", False)],
)
def test_sglang_range(version, inside):
    assert SGLANG.covers(version) is inside


def test_ranges_are_stated():
    assert str(VLLM) == "vLLM 0.32.0 to 0.33.x"
    assert str(SGLANG) == "SGLang 0.5.23"
    assert (VLLM.package, SGLANG.package) == ("vllm", "sglang")


@pytest.fixture
def framework(tmp_path, monkeypatch):
    """``fakefw`` (a registry and a base class, as a framework ships them) and
    ``rocm_mla_fakefw_backend`` (an integration module overriding the base), importable."""
    (tmp_path / "fakefw").mkdir()
    (tmp_path / "fakefw" / "__init__.py").write_text("")
    (tmp_path / "fakefw" / "registry.py").write_text(
        "def register_backend(name, path):\n    pass\n"
    )
    (tmp_path / "fakefw" / "base.py").write_text(
        textwrap.dedent(
            """
            class Backend:
                def forward(self, q, kv_cache, *, layer):
                    raise NotImplementedError

                @staticmethod
                def get_name():
                    return "base"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [
        m for m in sys.modules if m.split(".")[0] in ("fakefw", "rocm_mla_fakefw_backend")
    ]:
        del sys.modules[name]


def write_integration(folder, forward_signature):
    (folder / "rocm_mla_fakefw_backend.py").write_text(
        textwrap.dedent(
            f"""
            from fakefw.base import Backend

            class Ours(Backend):
                def forward{forward_signature}:
                    return q

                @staticmethod
                def get_name():
                    return "ours"
            """
        )
    )


NEEDS = {"fakefw.registry": ("register_backend",), "rocm_mla_fakefw_backend": ("Ours",)}
UNTESTED = ReleasesTested("FakeFW", "no_such_framework", (1, 0, 0), (1, 0))


def records_of(logger):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    return records


def test_inside_the_range_nothing_is_imported_or_logged(monkeypatch):
    logger = logging.getLogger("test.rocm_mla.common.inside")
    records = records_of(logger)
    monkeypatch.setattr(ReleasesTested, "installed", lambda self: ("fakefw", "1.0.3"))
    assert check_release(UNTESTED, {"no.such.module": ("x",)}, logger)
    assert records == []


def test_untested_release_with_everything_there_registers_saying_so(framework):
    write_integration(framework, "(self, q, kv_cache, *, layer, extra=None)")
    logger = logging.getLogger("test.rocm_mla.common.ok")
    records = records_of(logger)
    assert check_release(UNTESTED, NEEDS, logger)
    (line,) = [r.getMessage() for r in records]
    assert line == (
        "rocm-mla: no_such_framework (version unknown) is not a release rocm-mla is tested "
        "with (FakeFW 1.0.0 to 1.0.x); checked: the 2 names rocm-mla imports from 2 modules "
        "and the 2 FakeFW methods it overrides: all there, registering"
    )


@pytest.mark.parametrize(
    ("signature", "problem"),
    [
        ("(self, q, *, layer)", "Ours.forward cannot be called as fakefw.base.Backend.forward"),
        ("(self, q, kv_cache, *, layer, scale)", "missing a required argument: 'scale'"),
    ],
)
def test_an_override_the_framework_cannot_call_leaves_it_in_charge(framework, signature, problem):
    write_integration(framework, signature)
    logger = logging.getLogger("test.rocm_mla.common.mismatch")
    records = records_of(logger)
    assert not check_release(UNTESTED, NEEDS, logger)
    (line,) = [r.getMessage() for r in records]
    assert problem in line
    assert line.endswith("registering nothing, FakeFW's own attention backends stay in charge")


def test_a_missing_module_or_name_leaves_the_framework_in_charge(framework):
    write_integration(framework, "(self, q, kv_cache, *, layer)")
    logger = logging.getLogger("test.rocm_mla.common.missing")
    records = records_of(logger)
    needs = {**NEEDS, "fakefw.registry": ("register_backend", "AttentionBackendEnum")}
    assert not check_release(UNTESTED, needs, logger)
    assert "fakefw.registry has no AttentionBackendEnum" in records[-1].getMessage()
    assert not check_release(UNTESTED, {"fakefw.gone": ("x",), **NEEDS}, logger)
    assert "import fakefw.gone: ModuleNotFoundError: No module named 'fakefw.gone'" in (
        records[-1].getMessage()
    )


@pytest.mark.parametrize("framework_name", ["vllm", "sglang"])
def test_plugins_without_their_framework_register_nothing(monkeypatch, framework_name):
    """The real plugins where their framework is not installed (this venv): the version
    cannot be read, the check's imports fail, one line, nothing registered, no exception."""
    if framework_name == "vllm":
        from rocm_mla.integrations.vllm import plugin
    else:
        from rocm_mla.integrations.sglang import plugin
    try:
        __import__(framework_name)
    except ImportError:
        pass
    else:
        pytest.skip(f"{framework_name} is installed here; tests/test_{framework_name}_plugin.py")
    for var in ("ROCM_MLA_BACKEND", "ROCM_MLA_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    records = records_of(plugin.logger)
    assert plugin.register() == []
    (line,) = [r.getMessage() for r in records]
    assert line.startswith(f"rocm-mla: {framework_name} (version unknown) is not a release")
    assert f"import {next(iter(plugin.NEEDS))}: ModuleNotFoundError" in line


def test_the_checks_name_what_the_plugins_import():
    from rocm_mla.integrations.sglang import plugin as sglang_plugin
    from rocm_mla.integrations.vllm import plugin as vllm_plugin

    assert vllm_plugin.NEEDS["vllm.v1.attention.backends.registry"] == (
        "AttentionBackendEnum",
        "register_backend",
    )
    assert "rocm_mla.integrations.vllm.backend" in vllm_plugin.NEEDS
    assert "rocm_mla.integrations.sglang.backend" in sglang_plugin.NEEDS
    assert common.check_release is vllm_plugin.check_release is sglang_plugin.check_release
