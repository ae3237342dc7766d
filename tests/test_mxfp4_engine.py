"""Engine acceptance for MXFP4 routed experts: greedy outputs of a tiny MXFP4 Kimi-K3 split
over pp 2 x tp 2 x dcp 2 (8 gloo processes) equal the single-process run."""

from __future__ import annotations

import pytest

from rocm_mla.engine import LLM
from rocm_mla.models.kimi_k3 import make_tiny

PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 60, 12, 3, 77], [100, 4, 8], [250], list(range(40, 66))]
NEW = 6


@pytest.fixture(scope="module")
def mx_dir(tmp_path_factory):
    return str(make_tiny("kimi_k3", tmp_path_factory.mktemp("mxeng") / "k3", seed=3,
                         experts="mxfp4"))  # fmt: skip


def test_mxfp4_pp2_tp2_dcp2_greedy_equals_single_process(mx_dir):
    with LLM(mx_dir, block_size=4) as llm:
        want = llm.generate(PROMPTS, NEW)
        want_logits = llm.score(PROMPTS)
    with LLM(mx_dir, pp=2, tp=2, dcp=2, dcp_interleave=4, backend="torch", block_size=4) as llm:
        assert llm.generate(PROMPTS, NEW) == want
        for got, ref in zip(llm.score(PROMPTS), want_logits, strict=True):
            assert (got - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max())
