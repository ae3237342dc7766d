"""Load released Kimi-K3 / Kimi-Linear safetensors checkpoints for one PP stage and TP rank.

Key names: K3 under ``language_model.model.`` / ``language_model.lm_head.`` (vision tower,
projector and MTP layers skipped); Kimi-Linear under ``model.`` / ``lm_head.``. Only this
stage's layers are read, and through ``get_slice`` only this TP rank's rows/columns, so memory
stays proportional to the shard. ``make_tiny`` writes a random checkpoint in the same format.

The embedding and LM head are vocab-parallel: each TP rank reads its ``ceil(V / tp)`` rows
(zero padding past the vocabulary). With ``tie_word_embeddings`` the head is the embedding
tensor (a stored ``lm_head.weight`` is then ignored). MXFP4 routed experts (config.json
``quantization_config``) are read as ``weight_packed`` / ``weight_scale`` uint8 and stay packed.
Short-conv weights may be stored ``[C, 1, K]`` or ``[C, K]``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from rocm_mla.models.kimi_k3.config import KimiK3Config
from rocm_mla.models.kimi_k3.files import UnsafeCheckpointPath, checkpoint_file, read_json_object
from rocm_mla.models.kimi_k3.limits import check_memory
from rocm_mla.models.kimi_k3.model import KimiK3ForCausalLM
from rocm_mla.models.kimi_k3.mxfp4 import quantization_config_block, quantize_mxfp4
from rocm_mla.models.kimi_k3.ops import AllReduce, shard_range

# Module names whose weight rows (dim 0) are split across TP ranks (heads / intermediate),
# and those whose columns (dim 1) are: the row-parallel outputs that the all-reduce completes.
_COLUMN_PARALLEL = {
    "q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "g_proj", "g_b_proj", "f_b_proj",
    "b_proj", "q_conv1d", "k_conv1d", "v_conv1d", "w1", "w3", "gate_proj", "up_proj",
}  # fmt: skip
_ROW_PARALLEL = {"o_proj", "w2", "down_proj"}
_HEAD_PARAMS = {"dt_bias": 0, "A_log": 0}
# Kept in fp32 whatever the model dtype: the router and the KDA decay parameters.
_FP32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias", "gate.weight")
_SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_LIST_LIMIT = 10
_DENSE_ALIAS = re.compile(r"(layers\.\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.)")
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
_EXPERT_WEIGHT = re.compile(r"block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
EXPERT_FORMATS = ("plain", "mxfp4")
#: Safetensors dtypes a floating-point parameter may be stored in (cast to the load dtype).
FLOAT_DTYPES = ("BF16", "F16", "F32")
#: ``load_model(dtype=)`` values: what the kernels and layers compute in.
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model (missing, unexpected, mis-shaped, unreadable)."""


def tp_shard_dim(name: str) -> int | None:
    """The dim of parameter ``name`` split across TP ranks, or None when replicated."""
    parts = name.split(".")
    if parts[-1] in _HEAD_PARAMS:
        return _HEAD_PARAMS[parts[-1]]
    module = parts[-2] if len(parts) > 1 else ""
    if module in _COLUMN_PARALLEL:
        return 0
    if module in _ROW_PARALLEL:
        return 1
    return None


def _model_name(key: str, arch: str) -> str | None:
    """Checkpoint key -> our parameter name; None for keys this text model never uses."""
    if key.startswith(_SKIPPED_PREFIXES) or "rotary_emb." in key:
        return None
    if arch == "kimi_k3":
        if not key.startswith("language_model."):
            return key  # reported as unexpected
        key = key.removeprefix("language_model.")
        if key.startswith("layers."):
            key = "model." + key
    # transformers' save_pretrained renames every ``.mlp.`` back to ``.block_sparse_moe.``,
    # dense layers included; the released checkpoints keep dense layers under ``mlp``.
    return _DENSE_ALIAS.sub(r"\1.mlp.\2", key)


def _layer_of(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _inside(path: Path, name: str) -> Path:
    """``path / name``, as a ``CheckpointError`` when it leads out of the model directory."""
    try:
        return checkpoint_file(path, name)
    except UnsafeCheckpointPath as err:
        raise CheckpointError(str(err)) from None


def _files(path: Path) -> dict[str, list[str]]:
    """Checkpoint file -> keys in it (index.json or the single model.safetensors); every
    file named resolves inside ``path``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        _inside(path, index.name)
        try:
            weight_map = read_json_object(index).get("weight_map")
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map: expected an object of name -> file")
        files: dict[str, list[str]] = {}
        for key, file in weight_map.items():
            if not isinstance(key, str) or not isinstance(file, str):
                raise CheckpointError(
                    f"{index}: weight_map entry {key!r}: {file!r} must map a name to a file name"
                )
            _inside(path, file)
            files.setdefault(file, []).append(key)
        return files
    single = _inside(path, "model.safetensors")
    if not single.is_file():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json found")
    with _open(single) as f:
        return {single.name: list(f.keys())}


def _open(file: Path):
    if not file.is_file():
        raise CheckpointError(f"{file}: checkpoint shard listed in the index is missing")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as err:  # safetensors raises its own SafetensorError / OSError
        raise CheckpointError(
            f"{file}: cannot read safetensors header ({err}); the file is truncated or corrupt, "
            "re-download or re-save it"
        ) from err


def _summary(title: str, items: list[str]) -> str:
    shown = items[:_LIST_LIMIT]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"  {title} ({len(items)}):\n    " + "\n    ".join(shown) + more


def load_model(
    path: str | Path,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
    all_reduce: AllReduce | torch.distributed.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    backend: str | None = None,
    dcp_group: torch.distributed.ProcessGroup | None = None,
) -> KimiK3ForCausalLM:
    """Build this stage/rank's model and fill it from the checkpoint directory ``path``.

    Args:
        path: directory with ``config.json`` and safetensors (single or sharded + index).
        pp_rank, pp_size, tp_rank, tp_size, all_reduce, backend, dcp_group: as
            ``KimiK3ForCausalLM``.
        dtype: parameter dtype (default: the checkpoint's); the router and KDA decay
            parameters stay fp32.
        device: where the parameters live.

    Raises:
        CheckpointError: missing, unexpected or mis-shaped tensors, or tensors holding NaN
            or inf (or values beyond ``dtype``'s range), each listed by checkpoint key; or an
            unreadable (e.g. truncated) file.
    """
    if dtype is not None and dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype: expected one of {MODEL_DTYPES} or None, got {dtype!r}")
    path = Path(path)
    config = KimiK3Config.from_pretrained(path)
    check_memory(
        config,
        device=device,
        pp=pp_size,
        tp=tp_size,
        param_itemsize=dtype.itemsize if dtype is not None else None,
    )
    files = _files(path)  # a malformed index fails here, before anything is allocated
    with torch.device("meta"):
        model = KimiK3ForCausalLM(
            config, pp_rank=pp_rank, pp_size=pp_size, tp_rank=tp_rank, tp_size=tp_size,
            all_reduce=all_reduce, backend=backend, dcp_group=dcp_group,
        )  # fmt: skip
    model.to_empty(device=device)
    model.tie_weights()
    params = dict(model.named_parameters())
    start, end = model.layer_range
    loaded: set[str] = set()
    unexpected: list[str] = []
    misshaped: dict[str, str] = {}  # checkpoint key -> what is wrong with it
    non_finite: list[str] = []
    for file, keys in files.items():
        with _open(_inside(path, file)) as f:
            for key in keys:
                name = _tied_name(_model_name(key, config.arch), config, model)
                if name is None:
                    continue
                layer = _layer_of(name)
                if layer is not None and layer >= config.num_hidden_layers:
                    continue  # MTP / speculative layers after the main stack
                if layer is not None and not start <= layer < end:
                    continue
                if name not in params:
                    if not _stage_skips(name, model):
                        unexpected.append(key)
                    continue
                if name in _VOCAB_PARALLEL:
                    problem = _read_vocab_rows(
                        f, key, params[name], tp_rank, config.vocab_size, dtype, file
                    )
                else:
                    problem = _read_into(f, key, name, params[name], tp_rank, tp_size, dtype, file)
                if problem:
                    misshaped[key] = f"{key}: {problem} (in {file})"
                    continue
                loaded.add(name)
                problem = _non_finite(f, key, params[name])
                if problem:
                    non_finite.append(f"{key}: {problem} (in {file})")
    missing = [_ckpt_name(n, config.arch) for n in params if n not in loaded]
    missing = [m for m in missing if m not in misshaped]
    if missing or unexpected or misshaped or non_finite:
        parts = [f"checkpoint {path} does not match the {config.arch} model:"]
        if missing:
            parts.append(_summary("missing tensors", missing))
        if unexpected:
            parts.append(_summary("unexpected tensors", unexpected))
        if misshaped:
            parts.append(_summary("wrong shapes or dtypes", list(misshaped.values())))
        if non_finite:
            parts.append(_summary("non-finite values (NaN or inf)", non_finite))
        hint = _format_hint(config, unexpected)
        if hint:
            parts.append(hint)
        raise CheckpointError("\n".join(parts))
    model.absorb_weights()
    return model


def _stage_skips(name: str, model: KimiK3ForCausalLM) -> bool:
    """Whether ``name`` is a real parameter that only another PP stage holds."""
    first_only = name.startswith("model.embed_tokens.")
    last_only = name.startswith(("lm_head.", "model.norm.", "model.output_attn_res_"))
    return (first_only and not model.is_first) or (last_only and not model.is_last)


def _tied_name(name: str | None, config: KimiK3Config, model: KimiK3ForCausalLM) -> str | None:
    """With tied embeddings: a stored head copy is ignored, and a last stage that does not
    embed reads its head from the embedding tensor."""
    if name is None or not config.tie_word_embeddings:
        return name
    if name == "lm_head.weight":
        return None
    if name == "model.embed_tokens.weight" and model.is_last and not model.is_first:
        return "lm_head.weight"
    return name


def _format_hint(config: KimiK3Config, unexpected: list[str]) -> str | None:
    """Why routed-expert tensors did not match: the checkpoint and config.json disagree on
    the expert format."""
    if config.routed_expert_quant is None and any(
        k.endswith((".weight_packed", ".weight_scale")) for k in unexpected
    ):
        return (
            "  hint: the checkpoint stores MXFP4 expert tensors (weight_packed/weight_scale) "
            "but config.json has no compressed-tensors quantization_config"
        )
    if config.routed_expert_quant == "mxfp4" and any(_EXPERT_WEIGHT.search(k) for k in unexpected):
        return (
            "  hint: config.json declares MXFP4 routed experts but the checkpoint stores "
            "plain expert .weight tensors"
        )
    return None


def _read_vocab_rows(
    f,
    key: str,
    param: nn.Parameter,
    tp_rank: int,
    vocab_size: int,
    dtype: torch.dtype | None,
    file: str,
) -> str | None:
    """Copy this rank's vocabulary rows of ``key [V, D]`` into ``param [ceil(V/tp), D]``
    (pad rows past ``V`` zero); return a shape problem or None."""
    rows, dim = param.shape
    try:
        sl = f.get_slice(key)
        shape = list(sl.get_shape())
        if sl.get_dtype() not in FLOAT_DTYPES:
            return f"expected a floating-point dtype {FLOAT_DTYPES}, got {sl.get_dtype()}"
        if shape != [vocab_size, dim]:
            return f"expected shape {[vocab_size, dim]}, got {shape}"
        start = tp_rank * rows
        end = min(start + rows, vocab_size)
        tensor = sl[start:end]
    except Exception as err:  # safetensors raises SafetensorError on a short data section
        raise CheckpointError(
            f"{file}: cannot read tensor {key} ({err}); the file is truncated or corrupt"
        ) from err
    full = torch.zeros(rows, dim, dtype=dtype or tensor.dtype, device=param.device)
    full[: end - start] = tensor.to(device=param.device, dtype=full.dtype)
    with torch.no_grad():
        param.data = full
    return None


def _non_finite(f, key: str, param: nn.Parameter) -> str | None:
    """What is not finite in floating-point ``param``, just read from ``key``; None when all
    of it is (one ``isfinite`` pass). A NaN or inf weight makes every logit it reaches
    garbage, with no error anywhere later."""
    if not param.is_floating_point():
        return None
    finite = torch.isfinite(param)
    if bool(finite.all()):
        return None
    count = f"{int(finite.numel() - finite.sum())} of {param.numel()} values"
    # Told apart only on this failure path: read the stored tensor again.
    if bool(torch.isfinite(f.get_tensor(key)).all()):
        return f"{count} overflow {param.dtype} (finite as stored; load it in a wider dtype)"
    return f"{count} are NaN or inf"


def _ckpt_name(name: str, arch: str) -> str:
    return ("language_model." if arch == "kimi_k3" else "") + name


def _read_into(
    f,
    key: str,
    name: str,
    param: nn.Parameter,
    tp_rank: int,
    tp_size: int,
    dtype: torch.dtype | None,
    file: str,
) -> str | None:
    """Copy this rank's slice of ``key`` into ``param``; return a shape problem or None."""
    try:
        sl = f.get_slice(key)
        shape = list(sl.get_shape())
        got = sl.get_dtype()
        if param.dtype == torch.uint8 and got != "U8":
            return f"expected dtype uint8 (MXFP4 packed codes / e8m0 scales), got {got}"
        if param.dtype != torch.uint8 and got not in FLOAT_DTYPES:
            return f"expected a floating-point dtype {FLOAT_DTYPES}, got {got}"
        dim = tp_shard_dim(name)
        local = list(param.shape)
        if name.endswith("A_log"):
            # Kimi-Linear stores [1, 1, H, 1]; K3 releases may store more entries than heads,
            # of which the first H are used.
            full = sl[:].reshape(-1)
            heads = local[0] * tp_size
            if full.numel() < heads:
                return f"has {full.numel()} entries, need >= {heads}"
            lo, hi = shard_range(heads, tp_rank, tp_size)
            tensor = full[lo:hi]
        else:
            expected = list(local)
            if dim is not None:
                expected[dim] *= tp_size
            if shape != expected and not _is_2d_conv(name, shape, expected):
                return f"expected shape {expected}, got {shape}"
            if dim is None:
                tensor = sl[:]
            else:
                lo, hi = shard_range(shape[dim], tp_rank, tp_size)
                tensor = sl[lo:hi] if dim == 0 else sl[:, lo:hi]
    except Exception as err:  # safetensors raises SafetensorError on a short data section
        raise CheckpointError(
            f"{file}: cannot read tensor {key} ({err}); the file is truncated or corrupt"
        ) from err
    if param.dtype == torch.uint8:
        target = torch.uint8
    elif name.endswith(_FP32_PARAMS):
        target = torch.float32
    else:
        target = dtype or tensor.dtype
    with torch.no_grad():
        param.data = tensor.to(device=param.device, dtype=target).reshape(param.shape).contiguous()
    return None


def _is_2d_conv(name: str, shape: list[int], expected: list[int]) -> bool:
    """A depthwise short-conv weight saved ``[C, K]`` instead of ``[C, 1, K]`` (same data)."""
    return (
        "conv1d" in name
        and len(expected) == 3
        and expected[1] == 1
        and shape == [expected[0], expected[2]]
    )


# ---------------------------------------------------------------------------- tiny checkpoints
def random_init_(model: KimiK3ForCausalLM, seed: int = 0) -> None:
    """Fill every parameter with deterministic random values of a sensible scale.

    Linear weights ~ N(0, 1/fan_in); norm scales ~ 1 + N(0, 0.1); AttnRes depth queries
    ~ N(0, 1/D) (unit-scale logits, so the mixture is far from uniform); KDA decay
    parameters as FLA initializes them; a small random router correction bias.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            randn = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("A_log"):
                value = torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                dt = torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
                dt = dt.exp()
                value = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
            elif name.endswith("e_score_correction_bias"):
                value = 0.05 * randn
            elif "norm" in name.split(".")[-2] and p.dim() == 1:
                value = 1.0 + 0.1 * randn
            elif "conv1d" in name:
                value = 0.3 * randn
            elif name.endswith("embed_tokens.weight"):
                value = randn
            else:
                value = randn * p.shape[-1] ** -0.5
            p.copy_(value.to(p.dtype))
    model.absorb_weights()


def _checkpoint_tensors(model: KimiK3ForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    arch = model.config.arch
    for name, p in model.named_parameters():
        t = p.detach()
        if name.endswith("A_log") and arch == "kimi_linear":
            t = t.view(1, 1, -1, 1)
        yield _ckpt_name(name, arch), t.contiguous()


def make_tiny(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    config: KimiK3Config | None = None,
    dtype: torch.dtype = torch.float32,
    experts: str = "plain",
) -> Path:
    """Write a random checkpoint (config.json + model.safetensors) in the released format.

    Args:
        arch: "kimi_k3" (nested text_config, ``language_model.`` keys) or "kimi_linear".
        out_dir: directory to create/fill.
        seed: weight seed.
        config: defaults to ``KimiK3Config.tiny(arch)``.
        dtype: tensor dtype on disk (router / decay parameters stay fp32).
        experts: "plain" or "mxfp4": routed experts quantized with ``quantize_mxfp4`` and
            stored as compressed-tensors ``weight_packed`` / ``weight_scale`` plus the
            ``quantization_config`` block. Without ``config``, "mxfp4" widens the tiny
            ``moe_intermediate_size`` to 64 so tp 2 still splits whole groups of 32.

    Returns:
        ``out_dir`` as a Path.
    """
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts: expected one of {EXPERT_FORMATS}, got {experts!r}")
    if config is None:
        config = KimiK3Config.tiny(arch)
        if experts == "mxfp4":
            config = dataclasses.replace(config, moe_intermediate_size=64)
    if config.arch != arch:
        raise ValueError(f"arch: {arch!r} does not match config.arch {config.arch!r}")
    if config.routed_expert_quant is not None:
        raise ValueError(
            "config: pass a plain-expert config and experts='mxfp4'; the quantizer makes the "
            "MXFP4 tensors from random plain weights"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = KimiK3ForCausalLM(config)
    random_init_(model, seed)
    tensors = {}
    for key, t in _checkpoint_tensors(model):
        if experts == "mxfp4" and _EXPERT_WEIGHT.search(key):
            packed, scale = quantize_mxfp4(t)
            stem = key.removesuffix(".weight")
            tensors[stem + ".weight_packed"], tensors[stem + ".weight_scale"] = packed, scale
        else:
            tensors[key] = t if key.endswith(_FP32_PARAMS) else t.to(dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    text = config.to_dict()
    text.pop("tie_word_embeddings")  # a top-level key of the released config.json
    top: dict = {"tie_word_embeddings": config.tie_word_embeddings}
    if experts == "mxfp4":
        top["quantization_config"] = quantization_config_block()
    if arch == "kimi_k3":
        raw = {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            **top,
            "text_config": text,
        }
    else:
        raw = {**text, **top, "architectures": ["KimiLinearForCausalLM"]}
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out
