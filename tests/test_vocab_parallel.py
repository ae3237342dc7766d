"""Vocab-parallel embedding and LM head: gloo TP 2 equals TP 1 (a vocabulary that does not
divide, tied embeddings, logit_scale), PP stages with tied embeddings, the shard layout."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rocm_mla.distributed import launch
from rocm_mla.models.kimi_k3.config import KimiK3Config
from rocm_mla.models.kimi_k3.loader import CheckpointError, load_model, make_tiny
from rocm_mla.models.kimi_k3.ops import vocab_shard
from tests.model_helpers import contiguous_metadata

VOCAB = 255  # odd: TP 2 pads the last shard by one row
IDS = [0, 254, 127, 128, 5, 200, 64]


def _config(**over) -> KimiK3Config:
    fields = {"vocab_size": VOCAB, "tie_word_embeddings": True, "logit_scale": 0.5, **over}
    return dataclasses.replace(KimiK3Config.tiny("kimi_k3"), **fields)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return make_tiny("kimi_k3", tmp_path_factory.mktemp("tied") / "k3", seed=8, config=_config())


def _logits(model, ids=IDS):
    with torch.no_grad():
        caches = model.make_caches(8, 4, 1)
        pre = model(contiguous_metadata([0], [len(ids)], 4, 8), caches,
                    input_ids=torch.tensor(ids))  # fmt: skip
        dec = model(contiguous_metadata([len(ids)], [1], 4, 8), caches,
                    input_ids=torch.tensor([VOCAB - 1]))  # fmt: skip
    return torch.cat([pre, dec])


def tp_worker(state, path):
    """One gloo TP rank: its embedding / head shard shapes and its full logits."""
    model = load_model(path, tp_rank=state.tp_rank, tp_size=2, all_reduce=state.tp_group)
    emb = model.model.embed_tokens.weight
    return {
        "logits": _logits(model),
        "rows": emb.shape[0],
        "tied": model.lm_head.weight is emb,
        "last_row": emb[-1].clone(),
    }


def test_vocab_shard_layout():
    assert vocab_shard(255, 0, 2) == (0, 128) and vocab_shard(255, 1, 2) == (128, 128)
    assert vocab_shard(163840, 7, 8) == (143360, 20480)
    assert vocab_shard(10, 0, 1) == (0, 10)


def test_gloo_tp2_equals_tp1_with_padding_tying_and_logit_scale(tied_dir):
    ref = _logits(load_model(tied_dir))
    assert ref.shape == (len(IDS) + 1, VOCAB)
    results = launch(tp_worker, 2, args=(str(tied_dir),), backend="gloo", timeout_s=120)
    full = load_file(str(tied_dir / "model.safetensors"))
    emb = full["language_model.model.embed_tokens.weight"]
    for rank, out in enumerate(results):
        assert out["rows"] == 128 and out["tied"]
        assert (out["logits"] - ref).abs().max() <= 1e-5 * ref.abs().max(), rank
        assert out["logits"].argmax(-1).tolist() == ref.argmax(-1).tolist()
    assert torch.equal(results[0]["last_row"], emb[127])
    assert not results[1]["last_row"].any()  # the pad row past token 254


def test_tied_checkpoint_has_no_head_and_a_stored_head_is_ignored(tied_dir, tmp_path):
    keys = load_file(str(tied_dir / "model.safetensors"))
    assert "language_model.lm_head.weight" not in keys
    assert json.loads((tied_dir / "config.json").read_text())["tie_word_embeddings"] is True
    model = load_model(tied_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # transformers may save the tied head too; the embedding tensor is the weight.
    extra = tmp_path / "with_head"
    extra.mkdir()
    (extra / "config.json").write_text((tied_dir / "config.json").read_text())
    keys["language_model.lm_head.weight"] = torch.zeros(VOCAB, model.config.hidden_size)
    save_file(keys, str(extra / "model.safetensors"))
    with_head = load_model(extra)
    assert with_head.lm_head.weight is with_head.model.embed_tokens.weight
    ours, theirs = model.state_dict(), with_head.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    # The same weights, but the extra key moves every tensor's offset in the mapped file, and
    # the BLAS may take another path for another alignment: the logits agree to rounding
    # (the stored head, all zeros, would make them all 0).
    ref = _logits(model)
    got = _logits(with_head)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_logit_scale_multiplies_the_logits(tied_dir, tmp_path):
    unscaled = tmp_path / "unscaled"
    unscaled.mkdir()
    raw = json.loads((tied_dir / "config.json").read_text())
    raw["text_config"]["logit_scale"] = 1.0
    (unscaled / "config.json").write_text(json.dumps(raw))
    # A copy, not a link: the loader refuses files that resolve outside the model directory.
    shutil.copyfile(tied_dir / "model.safetensors", unscaled / "model.safetensors")
    # Exact: the same file bytes at the same offsets run the same code path, and a scale of
    # 0.5 is a power of two (multiplying by it rounds nothing).
    torch.testing.assert_close(
        _logits(load_model(tied_dir)), 0.5 * _logits(load_model(unscaled)), rtol=0, atol=0
    )


def test_pp_stages_with_tied_embeddings_equal_one_stage(tied_dir):
    ref = _logits(load_model(tied_dir))
    first, last = (load_model(tied_dir, pp_rank=r, pp_size=2) for r in range(2))
    assert not hasattr(first, "lm_head") and not hasattr(last.model, "embed_tokens")
    torch.testing.assert_close(last.lm_head.weight, first.model.embed_tokens.weight)
    caches = [first.make_caches(8, 4, 1), last.make_caches(8, 4, 1)]
    outs = []
    with torch.no_grad():
        for ctx, ids in (([0], IDS), ([len(IDS)], [VOCAB - 1])):
            meta = contiguous_metadata(ctx, [len(ids)], 4, 8)
            io = first(meta, caches[0], input_ids=torch.tensor(ids))
            outs.append(last(meta, caches[1], intermediate=io))
    assert (torch.cat(outs) - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_untied_head_is_still_required(tmp_path):
    path = make_tiny(
        "kimi_k3", tmp_path / "untied", seed=8, config=_config(tie_word_embeddings=False)
    )
    assert "language_model.lm_head.weight" in load_file(str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("language_model.lm_head.weight")
    save_file(tensors, str(path / "model.safetensors"))
    assert raw["tie_word_embeddings"] is False
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        load_model(path)
