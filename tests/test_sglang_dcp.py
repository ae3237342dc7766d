"""SGLang decode context parallelism through our backend (``make test-sglang``, CPU).

SGLang 0.5.23 stripes each request's KV over the DCP ranks by token: its allocator hands out
pages of ``page_size * N`` KV ids, an id's owner is ``id % N`` and its row there ``id // N``,
so position ``p`` lives on rank ``p % N`` as a dense prefix of that rank's pages (rocm_mla's
layout with interleave 1). Its DeepSeek layer gathers the DCP group's query heads before the
backend and merges the ranks' ``(out, lse)`` after it; the backend decodes the gathered heads
over its shard with the rank-local lengths.

Here SGLang's MLA kit (its real ``MLATokenToKVPool`` writes, ``req_to_token`` of striped ids,
shuffled pages, kv_lora_rank 512, rope 64, fp32) runs on 2 gloo ranks, each step as SGLang's
layer runs it (its own q gather and LSE merge, ``tests/sglang_kit.py``), against the same
fixture at DCP 1: decode and causal verify windows, ragged lengths with rows shorter than
``N``, the named backend (base-2 LSE for SGLang's merge) and the drop-in's ``aiter`` slot
(natural log), the step's KV written by the layer or by the backend, torch and Triton
(interpreter). In one process: the rank-local lengths equal
SGLang's own and address the rows SGLang wrote, the graph-state metadata decodes as the eager
one, and every layout rocm_mla cannot read is refused at start-up by name.
"""

from __future__ import annotations

import pytest
import torch

from tests.sglang_kit import (
    DCP_TOLERANCE,
    DCP_WORLD,
    TOLERANCE,
    DcpCase,
    call_log,
    dcp_attention,
    dcp_backend,
    dcp_fixture,
    dcp_runner,
    import_kit,
)

pytestmark = pytest.mark.sglang

#: Every case holds a row shorter than DCP_WORLD (a rank with no key for it), and each case's
#: call-log line (backend, rows, window, mode) is its own.
CASES = [
    DcpCase("torch", "DECODE", page=16, heads=16, prefix=(0, 1, 15, 40, 100)),
    DcpCase("torch", "DECODE", page=1, heads=12, prefix=(0, 3, 63), slot="aiter", writer="split"),
    DcpCase(
        "torch",
        "TARGET_VERIFY",
        page=16,
        heads=16,
        prefix=(0, 1, 30, 77),
        window=4,
        slot="aiter",
        writer="split",
    ),
    DcpCase("torch", "TARGET_VERIFY", page=64, heads=16, prefix=(0, 45), window=3, writer="row"),
    DcpCase("triton", "DECODE", page=16, heads=16, prefix=(0, 1, 40, 90), writer="split"),
    DcpCase("triton", "TARGET_VERIFY", page=32, heads=16, prefix=(0, 50), window=2, slot="aiter"),
]
LAUNCH_TIMEOUT_S = 540.0


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    for var in (
        "ROCM_MLA_BACKEND",
        "ROCM_MLA_DISABLE",
        "SGLANG_PLUGINS",
        "ROCM_MLA_SGLANG_CALL_LOG",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def dcp_ranks(tmp_path_factory):
    """Every case on DCP_WORLD gloo ranks in one launch: (per-rank results, call-log dir)."""
    from rocm_mla.distributed import launch
    from tests.sglang_kit import dcp_rank_main

    log = tmp_path_factory.mktemp("dcp-call-log")
    ranks = launch(
        dcp_rank_main,
        DCP_WORLD,
        args=(CASES, str(log)),
        dcp=DCP_WORLD,
        backend="gloo",
        timeout_s=LAUNCH_TIMEOUT_S,
    )
    return ranks, log


def _kit_reference(fixture, case: DcpCase) -> torch.Tensor:
    """The kit's float reference output of the layer for the fixture's step."""
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit
    from sglang.test.kits.attention_unittest.runner_modes import (
        speculative_target_verify_runner as verify,
    )

    if case.mode == "DECODE":
        return kit.expected_mla_fixture_output(fixture)
    masks, _ = verify._make_custom_masks(fixture.case, topk=1, device="cpu")
    return kit.mla_attention_reference_with_custom_mask(
        fixture.reference_module,
        fixture.case,
        fixture.prefix_hidden,
        fixture.input_hidden,
        masks,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dcp2_equals_dcp1_on_sglangs_kit(case, dcp_ranks, monkeypatch):
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
        MLA_ATOL,
        MLA_RTOL,
    )

    ranks, log = dcp_ranks
    monkeypatch.setenv("ROCM_MLA_BACKEND", case.rocm_backend)
    fixture = dcp_fixture(case, 1)
    dcp1 = dcp_attention(fixture, case, 1)
    # Rank r returns the rows of its heads [r * H / N, (r + 1) * H / N).
    dcp2 = torch.cat([rank[case.name] for rank in ranks], dim=1)
    assert not dcp2.isnan().any()
    torch.testing.assert_close(dcp2, dcp1, atol=DCP_TOLERANCE, rtol=DCP_TOLERANCE)
    output = fixture.reference_module.reconstruct_output(dcp2)
    torch.testing.assert_close(output, _kit_reference(fixture, case), atol=MLA_ATOL, rtol=MLA_RTOL)
    assert min(case.prefix) + 1 < DCP_WORLD  # a row some rank holds no key of
    rows = len(case.prefix) * case.window
    line = f"decode {case.rocm_backend} {rows} {case.window} {case.mode}"
    assert call_log(log)[line] == DCP_WORLD  # each rank decoded through our kernel


def test_every_rank_decoded_every_case_and_nothing_else(dcp_ranks):
    _, log = dcp_ranks
    lines = call_log(log)
    assert sum(lines.values()) == DCP_WORLD * len(CASES)
    assert all(line.startswith("decode ") for line in lines)


def _rank_fixture(case: DcpCase, rank: int):
    """``case``'s fixture on DCP rank ``rank`` of DCP_WORLD in this process (no group: our
    backend's part of the step has no collective), its step metadata made."""
    from sglang.srt.runtime_context import get_parallel

    import_kit()
    with get_parallel().override(attn_dcp_size=DCP_WORLD, attn_dcp_rank=rank):
        fixture = dcp_fixture(case, DCP_WORLD)
        fixture.backend.init_forward_metadata(fixture.forward_batch)
    return fixture


@pytest.mark.parametrize("rank", range(DCP_WORLD))
@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=lambda c: c.name)
def test_rank_local_lengths_are_sglangs_and_address_its_rows(case, rank, monkeypatch):
    """The lengths the backend made are SGLang's own (``get_dcp_chain_spec_lens``) and the
    count of ids SGLang put on this rank (``id % N``); through our block table the rank-local
    position ``p // N`` of every such token lands on the row SGLang wrote it to (``id // N``).
    """
    from sglang.srt.layers.dcp.layout import get_dcp_chain_spec_lens

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    fixture = _rank_fixture(case, rank)
    meta = fixture.backend.forward_metadata.dcp
    page = fixture.runner.page_size
    seq_lens = torch.tensor(fixture.case.seq_lens, dtype=torch.int32)
    local = meta.dcp_local_seq_lens
    assert local.shape == (len(case.prefix), case.window)
    sglang = get_dcp_chain_spec_lens(seq_lens, case.window, DCP_WORLD, rank)
    assert local.reshape(-1).tolist() == sglang.tolist()
    req_to_token = fixture.runner.req_to_token_pool.req_to_token
    for b, seq_len in enumerate(fixture.case.seq_lens):
        ids = req_to_token[b, :seq_len].to(torch.int64)
        for i in range(case.window):
            visible = seq_len - (case.window - 1) + i
            assert int(local[b, i]) == int((ids[:visible] % DCP_WORLD == rank).sum())
        for p in range(seq_len):
            if int(ids[p]) % DCP_WORLD != rank:
                continue
            position = p // DCP_WORLD
            row = int(meta.block_table[b, position // page]) * page + position % page
            assert row == int(ids[p]) // DCP_WORLD


@pytest.mark.parametrize("rank", range(DCP_WORLD))
def test_graph_state_metadata_decodes_as_eager(rank, monkeypatch):
    """Graph buffers under DCP hold each request's local length and every query row's
    local bound: captured and replayed metadata (planned for the pool's context length,
    re-planned on the step's local lengths) give this rank's partial and LSE exactly as the
    eager plan."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    case = CASES[2]
    fixture = _rank_fixture(case, rank)
    backend, batch = fixture.backend, fixture.forward_batch
    heads = backend.num_heads
    layer = RadixAttention(heads, 576, 576**-0.5, num_kv_heads=1, layer_id=0, v_head_dim=512)
    q = torch.randn(
        len(case.prefix) * case.window, heads, 576, generator=torch.Generator().manual_seed(rank)
    )

    def decode():
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            return backend.forward_extend(q, None, None, layer, batch, save_kv_cache=False)

    eager = decode()
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8 * case.window)
    backend.init_forward_metadata_out_graph(batch, in_capture=True)
    captured = backend.forward_metadata
    backend.init_forward_metadata_out_graph(batch)
    replayed = backend.forward_metadata
    assert replayed.plan is captured.plan
    assert replayed.cache_seqlens.data_ptr() == captured.cache_seqlens.data_ptr()
    assert replayed.row_seqlens.data_ptr() == captured.row_seqlens.data_ptr()
    local = replayed.dcp.dcp_local_seq_lens
    assert replayed.row_seqlens.tolist() == local.tolist()
    assert replayed.cache_seqlens.tolist() == local[:, -1].tolist()
    graph = decode()
    for got, want in zip(graph, eager, strict=True):
        torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)


def _not_striped(runner):
    runner.token_to_kv_pool_allocator.page_size = runner.page_size


def _translating(runner):
    runner.kv_index_translator.is_translating = True


def _resolved_writes(runner):
    runner.token_to_kv_pool.write_loc_is_dcp_resolved = True


def _replicated(runner):
    runner.token_to_kv_pool.dcp_replicated = True


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        (_not_striped, "the allocator's pages hold 16 KV ids, not page_size x dcp = 16 x 2"),
        (_translating, "req_to_token holds virtual KV ids that a page table maps"),
        (_resolved_writes, "MLATokenToKVPool takes write ids already resolved to its rows"),
        (_replicated, "MLATokenToKVPool is replicated on every DCP rank, not striped"),
    ],
    ids=lambda v: getattr(v, "__name__", "")[1:] or None,
)
def test_a_layout_rocm_mla_cannot_read_is_refused_at_start_up(layout, named, monkeypatch):
    from sglang.srt.runtime_context import get_parallel

    monkeypatch.setenv("ROCM_MLA_BACKEND", "torch")
    import_kit()
    case = CASES[0]
    with get_parallel().override(attn_dcp_size=DCP_WORLD, attn_dcp_rank=1):
        runner = dcp_runner(case.kit_case(), DCP_WORLD)
        layout(runner)
        with pytest.raises(RuntimeError) as refused:
            dcp_backend(runner, case.slot)
    message = str(refused.value)
    assert message.startswith(
        "rocm-mla: SGLang decode context parallelism (dcp 2) in a layout rocm_mla cannot read: "
    )
    assert named in message
    assert "token p on rank p % 2" in message
