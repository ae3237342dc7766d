"""The SGLang plugin against the real SGLang 0.5.23 (``make test-sglang``, its own venv):
entry-point discovery, the ``--attention-backend rocm_mla`` choice, the drop-in over SGLang's
MLA backends, ``ROCM_MLA_DISABLE``, start-up refusals and the first-decode log line.

Every test is marked ``sglang``: in the main venv (no SGLang) they are collected and skipped,
so nothing at module level imports SGLang. The ``sglang_state`` fixture saves and restores
SGLang's registries around each test.
"""

from __future__ import annotations

import argparse
import logging
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

from tests.sglang_kit import mla_case, run_fixture

pytestmark = pytest.mark.sglang

PLUGIN = "rocm_mla.integrations.sglang.plugin:register"


@pytest.fixture
def sglang_state(monkeypatch):
    from tests.sglang_kit import SGLangState

    for var in ("ROCM_MLA_BACKEND", "ROCM_MLA_DISABLE", "SGLANG_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    state = SGLangState()
    yield state
    state.restore()


def _parse_backend(name: str) -> str:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(["--model-path", "m", "--attention-backend", name]).attention_backend


def test_entry_point_is_installed():
    (ours,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "rocm_mla"]
    assert ours.value == PLUGIN


def test_loader_registers_the_named_backend_only(sglang_state):
    from sglang.srt.plugins import load_plugins

    originals = {name: sglang_state.backends[name] for name in ("triton", "torch_native")}
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        _parse_backend("rocm_mla")
    load_plugins()
    assert "rocm_mla" in sglang_state.backends
    assert "rocm_mla" in sglang_state.choices
    assert "rocm_mla" in sglang_state.handlers
    assert _parse_backend("rocm_mla") == "rocm_mla"
    for name, factory in originals.items():
        assert sglang_state.backends[name] is factory


def test_sglang_plugins_filter_skips_it(sglang_state, monkeypatch):
    from sglang.srt.plugins import load_plugins

    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    load_plugins()
    assert "rocm_mla" not in sglang_state.backends


def test_drop_in_takes_over_the_mla_backends(sglang_state, monkeypatch):
    from rocm_mla.integrations.sglang import plugin

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    originals = dict(sglang_state.backends)
    names = plugin.register()
    present = [name for name in plugin.DROP_IN_BACKENDS if name in originals]
    assert {"aiter", "triton", "torch_native", "flashinfer", "trtllm_mla"} <= set(present)
    assert names == ["rocm_mla", *present]
    for name in present:
        assert sglang_state.backends[name].rocm_mla_original is originals[name]
    # Re-entrant: a second run wraps the originals again, not its own wrappers.
    assert plugin.register() == names
    for name in present:
        assert sglang_state.backends[name].rocm_mla_original is originals[name]
    untouched = set(originals) - set(present) - {"rocm_mla"}
    assert untouched and all(sglang_state.backends[n] is originals[n] for n in untouched)


def test_drop_in_leaves_non_mla_runners_alone():
    from rocm_mla.integrations.sglang.plugin import _drop_in_factory

    built = object()
    factory = _drop_in_factory("triton", lambda runner: built)
    assert factory(SimpleNamespace(use_mla_backend=False)) is built


def test_disable_registers_nothing(sglang_state, monkeypatch):
    from sglang.srt.plugins import load_plugins

    from rocm_mla.integrations.sglang import plugin

    monkeypatch.setenv("ROCM_MLA_DISABLE", "1")
    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    before = dict(sglang_state.backends)
    load_plugins()
    assert plugin.register() == []
    assert sglang_state.backends == before
    assert "rocm_mla" not in sglang_state.choices


@pytest.fixture
def registered(sglang_state):
    from rocm_mla.integrations.sglang import plugin

    plugin.register()
    return sglang_state


def test_named_backend_that_cannot_run_is_refused(registered, monkeypatch):
    monkeypatch.setenv("ROCM_MLA_BACKEND", "aiter")
    case = mla_case("rocm_mla", "DECODE", heads=16, page=16, prefix=(7,))
    with pytest.raises(RuntimeError) as refused:
        run_fixture(case)
    message = str(refused.value)
    assert "ROCM_MLA_BACKEND=aiter cannot run on this machine" in message
    assert "Backends that can: triton, torch" in message


def test_unknown_backend_name_is_refused_at_build(registered, monkeypatch):
    from rocm_mla.integrations.sglang import plugin

    monkeypatch.setenv("ROCM_MLA_BACKEND", "flashy")
    plugin.register()  # the drop-in is registered; the name is checked by the runner
    case = mla_case("torch_native", "DECODE", heads=16, page=16, prefix=(7,))
    with pytest.raises(ValueError, match=r"unknown MLA backend 'flashy'.*valid names: auto"):
        run_fixture(case)


def test_decode_context_parallelism_is_refused(registered, monkeypatch):
    """DCP over the kit's runner, whose allocator pages are not SGLang's DCP ones (widened by
    the DCP size), is refused at start-up (tests/test_sglang_dcp.py serves SGLang's layout)."""
    from sglang.srt.runtime_context import get_parallel

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    case = mla_case("rocm_mla", "DECODE", heads=16, page=16, prefix=(7,))
    dcp = get_parallel().override(attn_dcp_size=2, attn_dcp_rank=0)
    refused = r"decode context parallelism \(dcp 2\) in a layout rocm_mla cannot read: the alloc"
    with dcp, pytest.raises(RuntimeError, match=refused):
        run_fixture(case)


def test_one_line_says_what_decodes(registered, monkeypatch, caplog):
    from rocm_mla.integrations import common

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    monkeypatch.setattr(common, "ANNOUNCED", set())
    case = mla_case("rocm_mla", "DECODE", heads=16, page=16, prefix=(7, 20))
    with caplog.at_level(logging.INFO, logger="sglang.srt.plugins.rocm_mla"):
        run_fixture(case)
        run_fixture(case)
    lines = [r.getMessage() for r in caplog.records if "decode with" in r.getMessage()]
    assert lines == ["rocm-mla: decode with torch (cpu) for 16 heads, q_len 1, kv float32"]


# --- releases (issue 43): registration under an untested SGLang ------------------------------


def _untested(monkeypatch, plugin):
    from rocm_mla.integrations.common import SGLANG, ReleasesTested

    untested = ReleasesTested("SGLang", SGLANG.package, (9, 0, 0), (9, 0))
    monkeypatch.setattr(plugin, "SGLANG", untested)


def _log_of(plugin, run):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    level = plugin.logger.level
    plugin.logger.addHandler(handler)
    plugin.logger.setLevel(logging.INFO)
    try:
        result = run()
    finally:
        plugin.logger.removeHandler(handler)
        plugin.logger.setLevel(level)
    return result, [r.getMessage() for r in records]


def test_a_tested_release_registers_without_checking(sglang_state):
    from rocm_mla.integrations.common import SGLANG
    from rocm_mla.integrations.sglang import plugin

    distribution, version = SGLANG.installed()
    assert SGLANG.covers(version), f"make test-sglang's {distribution} {version} is not {SGLANG}"
    names, lines = _log_of(plugin, plugin.register)
    assert names == ["rocm_mla"] and len(lines) == 1
    assert "not a release rocm-mla is tested with" not in lines[0]


def test_an_untested_release_is_checked_and_registers(sglang_state, monkeypatch):
    from rocm_mla.integrations.sglang import plugin

    _untested(monkeypatch, plugin)
    names, (check, _) = _log_of(plugin, plugin.register)
    assert names == ["rocm_mla"] and "rocm_mla" in sglang_state.backends
    assert "is not a release rocm-mla is tested with (SGLang 9.0.0 to 9.0.x)" in check
    assert check.endswith("it overrides: all there, registering")


def test_an_untested_release_lacking_a_need_leaves_sglang_in_charge(sglang_state, monkeypatch):
    from rocm_mla.integrations.sglang import plugin

    _untested(monkeypatch, plugin)
    backend_module = "rocm_mla.integrations.sglang.backend"
    needs = {**plugin.NEEDS, backend_module: (*plugin.NEEDS[backend_module], "gone")}
    monkeypatch.setattr(plugin, "NEEDS", needs)
    monkeypatch.setenv("ROCM_MLA_BACKEND", "auto")
    triton = sglang_state.backends["triton"]
    names, (line,) = _log_of(plugin, plugin.register)
    assert names == []
    assert f"{backend_module} has no gone" in line
    assert line.endswith("registering nothing, SGLang's own attention backends stay in charge")
    assert "rocm_mla" not in sglang_state.backends
    assert sglang_state.backends["triton"] is triton
