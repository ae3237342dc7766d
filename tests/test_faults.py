"""The out-of-bounds contract at the public API, on the aiter path, under ROCM_MLA_DEBUG.

A planned call reads no value on the host, so a bad block id or length must be handled on
the device: the key is never read, the rows that may see it come out NaN (out and lse),
every other row is exact, and the call ORs ``FAULT_*`` bits into an optional ``fault_flag``.
The aiter backend runs here through ``tests/aiter_interface_model.py``, which refuses any
``kv_indices`` outside the cache and any ``kv_indptr`` past its buffer, as the real kernel
would read them unchecked.
"""

from __future__ import annotations

import math

import pytest
import torch

import rocm_mla
from rocm_mla import inputs
from rocm_mla.backends import aiter as aiter_backend
from rocm_mla.backends import backend_class
from rocm_mla.inputs import (
    DEBUG_ENV_VAR,
    FAULT_BEYOND_PLAN,
    FAULT_BEYOND_TABLE,
    FAULT_BLOCK_ID,
    KVBoundsError,
)
from tests import aiter_interface_model
from tests.reference import make_paged_problem
from tests.test_plan import HostReadCounter, _cpu_aiter_capabilities

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def zero_flag() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32)


def plan_for(q, kv, lengths, backend, **kwargs):
    return rocm_mla.plan_decode(
        lengths,
        q_len=q.shape[1],
        num_heads=q.shape[2],
        kv_dtype=kv.dtype,
        q_dtype=q.dtype,
        backend=backend,
        **kwargs,
    )


@pytest.fixture
def aiter_model(monkeypatch):
    """The aiter backend routed to the interface model on a pretend MI300X (as test_plan)."""
    aiter_interface_model.use_in_backend(monkeypatch)
    monkeypatch.setattr(aiter_backend, "_torch_build", lambda: "rocm")
    monkeypatch.setattr(aiter_backend, "_gpu_arch", lambda: "gfx942")
    monkeypatch.setattr(aiter_backend.AiterMLAImpl, "capabilities", _cpu_aiter_capabilities())
    monkeypatch.delenv(DEBUG_ENV_VAR, raising=False)


def require_triton():
    pytest.importorskip("triton")
    from rocm_mla.backends.triton import TritonMLAImpl

    if TritonMLAImpl.unavailable_reason():
        pytest.skip(TritonMLAImpl.unavailable_reason())


# ---- the public surface ------------------------------------------------------------------


def test_fault_names_are_exported_from_the_package():
    assert rocm_mla.KVBoundsError is KVBoundsError and issubclass(KVBoundsError, ValueError)
    assert rocm_mla.raise_on_fault is inputs.raise_on_fault
    bits = (rocm_mla.FAULT_BLOCK_ID, rocm_mla.FAULT_BEYOND_TABLE, rocm_mla.FAULT_BEYOND_PLAN)
    assert bits == (FAULT_BLOCK_ID, FAULT_BEYOND_TABLE, FAULT_BEYOND_PLAN)
    assert set(rocm_mla.__all__) >= {"KVBoundsError", "raise_on_fault", "FAULT_BLOCK_ID"}


@pytest.mark.parametrize("planned", [False, True], ids=["one-shot", "planned"])
@pytest.mark.parametrize(
    ("flag", "match"),
    [
        (torch.zeros(1, dtype=torch.int64), r"fault_flag must be an int32 tensor of shape \[1\]"),
        (torch.zeros(2, dtype=torch.int32), r"fault_flag must be an int32 tensor of shape \[1\]"),
        (torch.zeros((), dtype=torch.int32), r"fault_flag must be an int32 tensor of shape \[1\]"),
        (torch.zeros(1, dtype=torch.int32, device="meta"), r"fault_flag must be on q's device"),
        ([0], r"fault_flag must be an int32 tensor \[1\] or None, got list"),
    ],
    ids=["int64", "shape-2", "scalar", "other-device", "list"],
)
def test_malformed_fault_flag_is_refused_before_any_work(planned, flag, match):
    q, kv, bt, lens = make_paged_problem([20, 9], num_heads=4, seed=1)
    plan = plan_for(q, kv, [20, 9], "torch") if planned else None
    with pytest.raises(ValueError, match=match):
        rocm_mla.mla_decode(q, kv, bt, lens, plan=plan, fault_flag=flag)
    impl = backend_class("torch")(num_heads=4)
    with pytest.raises(ValueError, match=match):
        impl.forward(q, kv, bt, lens, plan=plan, fault_flag=flag)


@pytest.mark.parametrize("backend", ["torch", "triton", "aiter"])
def test_the_flag_reaches_the_backend_and_a_clean_call_leaves_it_alone(request, backend):
    """The flag travels in DecodeProblem.fault_flag on both paths; nothing clears it."""
    if backend == "triton":
        require_triton()
    if backend == "aiter":
        request.getfixturevalue("aiter_model")
    q, kv, bt, lens = make_paged_problem([20, 9], num_heads=4, seed=2)
    seen = []
    impl_cls = backend_class(backend)
    decode = impl_cls._decode

    def spy(self, problem, plan):
        seen.append(problem.fault_flag)
        return decode(self, problem, plan)

    request.getfixturevalue("monkeypatch").setattr(impl_cls, "_decode", spy)
    flag = torch.tensor([8], dtype=torch.int32)  # a bit no backend sets: must survive
    rocm_mla.mla_decode(q, kv, bt, lens, backend=backend, fault_flag=flag)
    rocm_mla.mla_decode(q, kv, bt, lens, plan=plan_for(q, kv, [20, 9], backend), fault_flag=flag)
    assert len(seen) == 2 and all(f is flag for f in seen)
    assert flag.tolist() == [8]


# ---- the aiter path: a planned call with bad values ----------------------------------------


def aiter_case(bad_id=None, *, lengths=(17, 40, 0), q_len=2, seed=3):
    """A [17, 40, 0] batch with a verify window of 2 and 16-token blocks: request 0's rows
    see 16 and 17 keys, so a bad id in its column 1 is seen by its second row only.

    Block 0 is a free block (all NaN, as every unused slot here): a stand-in that reads it
    for a causally masked key would turn an exact row NaN through its 0 weight."""
    q, kv, bt, lens = make_paged_problem(list(lengths), num_heads=8, q_len=q_len, seed=seed)
    used = set(bt[bt >= 0].tolist())
    free = next(b for b in range(kv.shape[0]) if b not in used)
    swap = torch.arange(kv.shape[0])
    swap[0], swap[free] = free, 0
    kv, bt = kv[swap], torch.where(bt >= 0, swap[bt.clamp(min=0).long()], bt).to(torch.int32)
    assert torch.isnan(kv[0]).all()
    bad = bt.clone()
    if bad_id is not None:
        bad[0, 1] = bad_id
    return q, kv, bt, bad, lens


def reference(q, kv, bt, lens):
    return rocm_mla.mla_decode(q, kv, bt, lens, backend="torch")


def assert_rows(out, lse, ref_out, ref_lse, poisoned):
    """Rows in ``poisoned`` ([(b, i)]) NaN in every head and column; the rest as ``ref``."""
    mask = torch.zeros(out.shape[:2], dtype=torch.bool)
    for b, i in poisoned:
        mask[b, i] = True
    assert torch.isnan(out[mask]).all() and torch.isnan(lse[mask]).all()
    torch.testing.assert_close(out[~mask], ref_out[~mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[~mask], ref_lse[~mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad_id", [None, "num_blocks", -1, 10**6, -(10**6), INT32_MIN, INT32_MAX])
def test_aiter_bad_block_id_is_never_read_and_poisons_only_the_rows_that_see_it(
    aiter_model, bad_id
):
    q, kv, bt, bad, lens = aiter_case()
    bad_value = kv.shape[0] if bad_id == "num_blocks" else bad_id
    if bad_value is not None:
        bad[0, 1] = bad_value
    plan = plan_for(q, kv, lens.tolist(), "aiter")
    flag = zero_flag()
    out, lse = rocm_mla.mla_decode(q, kv, bad, lens, plan=plan, fault_flag=flag)
    ref_out, ref_lse = reference(q, kv, bt, lens)
    poisoned = [] if bad_value is None else [(0, 1)]
    assert_rows(out, lse, ref_out, ref_lse, poisoned)
    assert flag.tolist() == [0 if bad_value is None else FAULT_BLOCK_ID]
    # Without a flag the answer is the same: the flag only reports. Exact on purpose: the same
    # code on the same data, the flag's OR touches no output arithmetic.
    again = rocm_mla.mla_decode(q, kv, bad, lens, plan=plan)
    assert torch.equal(again[0].nan_to_num(7.0), out.nan_to_num(7.0))


def test_aiter_bad_id_past_a_request_s_length_is_ignored(aiter_model):
    q, kv, bt, bad, lens = aiter_case()
    bad[0, 2:] = INT32_MIN  # columns request 0 (17 tokens) never uses
    bad[2, :] = INT32_MAX  # the empty request
    flag = zero_flag()
    out, lse = rocm_mla.mla_decode(
        q, kv, bad, lens, plan=plan_for(q, kv, lens.tolist(), "aiter"), fault_flag=flag
    )
    assert_rows(out, lse, *reference(q, kv, bt, lens), [])
    assert flag.tolist() == [0]


def test_aiter_length_beyond_the_table_never_reads_past_it(aiter_model):
    """A table cut to 2 columns (32 tokens): request 1's 40 keys run past it. A graph plan
    (any lengths up to 64) has room for them, so only request 1's rows are poisoned."""
    q, kv, bt, _, lens = aiter_case()
    plan = plan_for(q, kv, lens.tolist(), "aiter", graph_max_seqlen=64)
    flag = zero_flag()
    out, lse = rocm_mla.mla_decode(q, kv, bt[:, :2], lens, plan=plan, fault_flag=flag)
    assert flag.tolist() == [FAULT_BEYOND_TABLE]
    assert_rows(out, lse, *reference(q, kv, bt, lens), [(1, 0), (1, 1)])


@pytest.mark.parametrize("columns", [2, None], ids=["cut-table", "full-table"])
def test_aiter_length_of_2_pow_31_minus_1_stays_inside_the_plan_s_buffer(aiter_model, columns):
    """Request 0 claims 2^31 - 1 keys: past its table and past the plan's budget of
    3 x 64 tokens, which it uses up, so request 1 is cut too. In the full table request 0's
    columns past its 17 tokens hold -1, a bad block id as well."""
    q, kv, bt, _, lens = aiter_case()
    table = bt if columns is None else bt[:, :columns]
    huge = lens.clone()
    huge[0] = INT32_MAX
    plan = plan_for(q, kv, lens.tolist(), "aiter", graph_max_seqlen=64)
    flag = zero_flag()
    out, lse = rocm_mla.mla_decode(q, kv, table, huge, plan=plan, fault_flag=flag)
    want = FAULT_BEYOND_TABLE | FAULT_BEYOND_PLAN | (FAULT_BLOCK_ID if columns is None else 0)
    assert flag.tolist() == [want]
    assert_rows(out, lse, *reference(q, kv, bt, lens), [(0, 0), (0, 1), (1, 0), (1, 1)])


def test_aiter_lengths_past_the_plan_s_token_budget_poison_their_requests(aiter_model):
    """A plan from [17, 40, 0] has room for 57 tokens; [17, 40, 30] does not fit: the last
    request is cut (FAULT_BEYOND_PLAN), the first two stay exact."""
    q, kv, bt, _, lens = aiter_case(lengths=(17, 40, 30))
    plan = plan_for(q, kv, [17, 40, 0], "aiter")
    flag = zero_flag()
    out, lse = rocm_mla.mla_decode(q, kv, bt, lens, plan=plan, fault_flag=flag)
    assert flag.tolist() == [FAULT_BEYOND_PLAN]
    assert_rows(out, lse, *reference(q, kv, bt, lens), [(2, 0), (2, 1)])


def test_aiter_all_empty_plan_with_real_lengths_poisons_instead_of_returning_zeros(aiter_model):
    q, kv, bt, _, lens = aiter_case()
    plan = plan_for(q, kv, [0, 0, 0], "aiter")
    flag = zero_flag()
    out, lse = rocm_mla.mla_decode(q, kv, bt, lens, plan=plan, fault_flag=flag)
    assert flag.tolist() == [FAULT_BEYOND_PLAN]
    assert torch.isnan(lse[:2]).all() and torch.isnan(out[:2]).all()
    assert (lse[2] == -math.inf).all() and (out[2] == 0).all()


def test_aiter_negative_lengths_are_faults_not_empty_rows(aiter_model):
    q, kv, bt, _, lens = aiter_case()
    neg = lens.clone()
    neg[0], neg[2] = -5, INT32_MIN
    flag = zero_flag()
    out, lse = rocm_mla.mla_decode(
        q, kv, bt, neg, plan=plan_for(q, kv, lens.tolist(), "aiter"), fault_flag=flag
    )
    assert flag.tolist() == [inputs.FAULT_NEGATIVE_LENGTH]
    assert torch.isnan(lse[[0, 2]]).all() and torch.isnan(out[[0, 2]]).all()
    ref_out, ref_lse = reference(q, kv, bt, lens)
    torch.testing.assert_close(out[1], ref_out[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[1], ref_lse[1], atol=1e-5, rtol=1e-5)


def test_aiter_fault_handling_reads_nothing_back(aiter_model, monkeypatch):
    q, kv, _, bad, lens = aiter_case(bad_id=-7)
    plan = plan_for(q, kv, lens.tolist(), "aiter")
    counter = HostReadCounter()
    kernel = aiter_interface_model.mla_decode_fwd

    def paused_kernel(*args, **kwargs):
        counter.paused = True
        try:
            return kernel(*args, **kwargs)
        finally:
            counter.paused = False

    monkeypatch.setattr(aiter_interface_model, "mla_decode_fwd", paused_kernel)
    flag = zero_flag()
    with counter:
        rocm_mla.mla_decode(q, kv, bad, lens, plan=plan, fault_flag=flag)
    assert counter.reads == [], f"planned aiter call read tensors back: {counter.reads}"
    assert flag.tolist() == [FAULT_BLOCK_ID]


def test_aiter_metadata_of_bad_values_stays_inside_the_cache():
    """The metadata alone, for every kind of bad value at once: indices in the cache,
    kv_indptr non-decreasing and within the plan's buffer."""
    bt = torch.tensor([[2, -1, INT32_MAX], [INT32_MIN, 0, 1], [1, 1, 1]], dtype=torch.int32)
    lens = torch.tensor([INT32_MAX, 40, -3], dtype=torch.int32)
    meta = aiter_backend.build_decode_metadata(bt, lens, 16, 1, 100, num_blocks=3)
    assert meta.kv_indices.shape == (100,)
    assert int(meta.kv_indices.min()) >= 0 and int(meta.kv_indices.max()) < 3 * 16
    indptr = meta.kv_indptr.tolist()
    assert indptr == sorted(indptr) and indptr[0] == 0 and indptr[-1] <= 100
    # Request 0's readable first block (2) is where its bad tokens and those past its
    # table read, each at its own offset.
    assert meta.kv_indices[:100].tolist() == [32 + t % 16 for t in range(100)]
    empty_table = torch.zeros(2, 0, dtype=torch.int32)
    meta = aiter_backend.build_decode_metadata(
        empty_table, torch.tensor([5, 0], dtype=torch.int32), 16, 1, 8, num_blocks=3
    )
    assert meta.kv_indices[:5].tolist() == list(range(5))  # block 0 stands in
    assert int(meta.kv_indices.min()) >= 0 and int(meta.kv_indices.max()) < 3 * 16


# ---- ROCM_MLA_DEBUG: lengths outside the plan are a named error ---------------------------


@pytest.mark.parametrize("backend", ["torch", "triton", "aiter"])
@pytest.mark.parametrize(
    ("plan_lengths", "graph_max", "call_lengths", "match"),
    [
        ([20, 30], None, [20, 31], r"span \[20, 31\], outside the plan's range \[20, 30\]"),
        ([20, 30], None, [5, 30], r"span \[5, 30\], outside the plan's range \[20, 30\]"),
        ([0, 0], 24, [25, 3], r"span \[3, 25\], outside the graph plan's bound \[0, 24\]"),
        ([10, 30], None, [30, 30], r"sum to 60, more than the 40 tokens the \w+ plan"),
    ],
    ids=["above-max", "below-min", "above-graph-bound", "above-total"],
)
def test_debug_mode_names_lengths_outside_the_plan(
    request, monkeypatch, backend, plan_lengths, graph_max, call_lengths, match
):
    if backend == "triton":
        require_triton()
    if backend == "aiter":
        request.getfixturevalue("aiter_model")
    q, kv, bt, _ = make_paged_problem([40, 40], num_heads=16, seed=4)
    lens = torch.tensor(call_lengths, dtype=torch.int32)
    plan = plan_for(q, kv, plan_lengths, backend, graph_max_seqlen=graph_max)
    monkeypatch.setenv(DEBUG_ENV_VAR, "1")
    with pytest.raises(KVBoundsError, match=match):
        rocm_mla.mla_decode(q, kv, bt, lens, plan=plan)


def test_debug_mode_accepts_the_lengths_a_graph_plan_covers(monkeypatch):
    q, kv, bt, _ = make_paged_problem([40, 40], num_heads=16, seed=5)
    plan = plan_for(q, kv, [0, 0], "torch", graph_max_seqlen=40)
    monkeypatch.setenv(DEBUG_ENV_VAR, "1")
    for lengths in ([0, 40], [40, 1]):
        rocm_mla.mla_decode(q, kv, bt, torch.tensor(lengths, dtype=torch.int32), plan=plan)


# ---- the engine: one flag per worker, read at the step's existing sync ---------------------

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 4, 8]]


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    from rocm_mla.models.kimi_k3.loader import make_tiny

    return str(make_tiny("kimi_k3", tmp_path_factory.mktemp("faults") / "k3", seed=11))


def tiny_worker(path):
    from rocm_mla.engine.worker import EngineOptions, StageWorker

    return StageWorker.load(path, EngineOptions(num_blocks=64, max_num_seqs=4, backend="torch"))


def test_runner_zeroes_its_flag_each_step_and_hands_it_on(tiny_k3):
    worker = tiny_worker(tiny_k3)
    runner = worker.runner
    flag = runner.fault_flag
    assert flag.dtype == torch.int32 and flag.shape == (1,)
    requests = runner.admit(PROMPTS, 4)
    flag.fill_(FAULT_BLOCK_ID)
    meta, _ = runner.prefill(requests)
    assert meta.fault_flag is flag and flag.tolist() == [0]
    for req in requests:
        req.tokens.append(1)
    flag.fill_(FAULT_BEYOND_TABLE)
    meta, _ = runner.decode(requests)
    assert meta.fault_flag is flag and flag.tolist() == [0]


class FaultingDecode:
    """``mla_decode`` as the MLA layers call it, recording each call's ``fault_flag`` and
    ORing ``bits`` into it when the longest request has ``fault_at`` keys (as a backend
    would on a bad id). PROMPTS' longest has 7 tokens: 9 keys is decode step 2."""

    def __init__(self, real, fault_at: int | None, bits: int) -> None:
        self.real, self.fault_at, self.bits = real, fault_at, bits
        self.flags: list[torch.Tensor | None] = []

    def __call__(self, q, kv_cache, block_table, cache_seqlens, **kwargs):
        flag = kwargs.get("fault_flag")
        self.flags.append(flag)
        out = self.real(q, kv_cache, block_table, cache_seqlens, **kwargs)
        if flag is not None and int(cache_seqlens.max()) == self.fault_at:
            flag.bitwise_or_(torch.tensor([self.bits], dtype=torch.int32))
        return out


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-replay"])
def test_a_fault_in_any_layer_raises_at_the_step_s_sync_naming_the_step(
    tiny_k3, monkeypatch, graphs
):
    from rocm_mla.models.kimi_k3 import mla as mla_module
    from tests.test_engine_hotpath import _with_cpu_graphs

    worker = tiny_worker(tiny_k3)
    if graphs:
        _with_cpu_graphs(worker)
    clean = FaultingDecode(mla_module.mla_decode, None, 0)
    monkeypatch.setattr(mla_module, "mla_decode", clean)
    want = worker.generate(PROMPTS, 4)
    # Eager layers get the runner's flag; replayed ones the graph's static flag, which the
    # replay ORs into the runner's.
    assert clean.flags and all(
        isinstance(f, torch.Tensor) and (graphs or f is worker.runner.fault_flag)
        for f in clean.flags
    )

    faulty = FaultingDecode(clean.real, 9, FAULT_BLOCK_ID | FAULT_BEYOND_TABLE)
    monkeypatch.setattr(mla_module, "mla_decode", faulty)
    match = (
        r"generate, decode step 2: the decode skipped keys outside the KV cache \(a block "
        r"id a row may see is outside \[0, num_blocks\); a length exceeds the block table"
    )
    with pytest.raises(KVBoundsError, match=match):
        worker.generate(PROMPTS, 4)
    # The step that faulted does not poison the next generate: the runner zeroes the flag.
    monkeypatch.setattr(mla_module, "mla_decode", clean)
    assert worker.generate(PROMPTS, 4) == want


@pytest.mark.parametrize("as_impl", [False, True], ids=["backend-name", "impl"])
def test_dcp_decode_passes_the_flag_to_its_kernel_call(monkeypatch, as_impl):
    """dcp_mla_decode hands fault_flag to the kernel call (validated there, reaching the
    backend), whether the layer holds a backend name or an impl."""
    from rocm_mla.dcp import DecodeMetadata, dcp_mla_decode

    q, kv, bt, lens = make_paged_problem([20, 9], num_heads=4, seed=6)
    meta = DecodeMetadata.build(bt, lens, 1)
    backend = backend_class("torch")(num_heads=4) if as_impl else "torch"
    with pytest.raises(ValueError, match="fault_flag must be an int32 tensor of shape"):
        dcp_mla_decode(q, kv, meta, None, backend, fault_flag=torch.zeros(1))
    seen = []
    cls = backend_class("torch")
    real = cls._decode

    def spy(self, problem, plan):
        seen.append(problem.fault_flag)
        return real(self, problem, plan)

    flag = zero_flag()
    monkeypatch.setattr(cls, "_decode", spy)
    dcp_mla_decode(q, kv, meta, None, backend, fault_flag=flag)
    assert len(seen) == 1 and seen[0] is flag


def expected_faults(bt, lens, num_blocks, block_size, q_len, total):
    """The contract, in plain Python loops: per row, poisoned or not, and the flag's bits.

    A request's keys are readable up to its first column that is past the table or holds a
    bad id; aiter also cuts requests past the plan's token budget ``total`` (kv_indptr is a
    running sum capped at it), and a cut request answers none of its rows.
    """
    batch, max_blocks = bt.shape
    capacity = max_blocks * block_size
    poisoned, bits, running = set(), 0, 0
    for b in range(batch):
        length = int(lens[b])
        start, running = min(running, total), running + max(length, 0)
        cut = min(running, total) - start < max(length, 0)
        columns = [c for c in range(max_blocks) if not 0 <= int(bt[b, c]) < num_blocks]
        readable = min([c * block_size for c in columns] + [capacity])
        if length < 0:  # a broken contract: every row of the request
            bits |= inputs.FAULT_NEGATIVE_LENGTH
            poisoned.update((b, i) for i in range(q_len))
            continue
        for i in range(q_len):
            seen = max(0, length - q_len + 1 + i)
            if seen == 0:
                continue
            if seen > readable and readable < capacity:
                bits |= FAULT_BLOCK_ID
            if seen > capacity:
                bits |= FAULT_BEYOND_TABLE
            if cut:
                bits |= FAULT_BEYOND_PLAN
            if cut or seen > readable:
                poisoned.add((b, i))
    return poisoned, bits


@pytest.mark.parametrize("seed", range(12))
def test_aiter_random_bad_tables_and_lengths_match_the_contract(aiter_model, seed):
    """Random block ids (some anywhere in int32) and lengths (negative, past the table, up to
    2^31 - 1), planned from other lengths: the interface model is never handed an index
    outside the cache, the flag and the NaN rows are the contract's, and every other row
    equals a one-shot torch call over just the keys it sees."""
    gen = torch.Generator().manual_seed(seed)
    batch, q_len, block = 4, 1 + seed % 2, 8
    plan_lengths = torch.randint(1, 40, (batch,), generator=gen).tolist()
    q, kv, bt, _ = make_paged_problem(
        plan_lengths, num_heads=4, q_len=q_len, block_size=block, seed=seed, nan_fill=False
    )
    bad = bt.clone()
    spots = torch.rand(bad.shape, generator=gen) < 0.2
    wild = torch.randint(INT32_MIN, INT32_MAX, bad.shape, generator=gen, dtype=torch.int64)
    bad[spots] = wild[spots].to(torch.int32)
    lens = torch.randint(-3, bt.shape[1] * block + 8, (batch,), generator=gen, dtype=torch.int32)
    if seed % 4 == 3:
        lens[seed % batch] = INT32_MAX
    graph = seed % 3 == 0
    plan = plan_for(q, kv, plan_lengths, "aiter", graph_max_seqlen=48 if graph else None)
    flag = zero_flag()
    out, lse = rocm_mla.mla_decode(q, kv, bad, lens, plan=plan, fault_flag=flag)
    poisoned, bits = expected_faults(bad, lens, kv.shape[0], block, q_len, plan.total_seqlen)
    assert flag.tolist() == [bits]
    for b in range(batch):
        for i in range(q_len):
            if (b, i) in poisoned:
                assert torch.isnan(out[b, i]).all() and torch.isnan(lse[b, i]).all()
                continue
            seen = max(0, int(lens[b]) - q_len + 1 + i)
            ref_out, ref_lse = rocm_mla.mla_decode(
                q[b : b + 1, i : i + 1],
                kv,
                bad[b : b + 1],
                torch.tensor([seen], dtype=torch.int32),
                causal=False,
                backend="torch",
            )
            torch.testing.assert_close(out[b, i], ref_out[0, 0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[b, i], ref_lse[0, 0], atol=1e-5, rtol=1e-5)
