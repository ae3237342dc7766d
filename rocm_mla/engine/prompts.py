"""What a prompt is: a sequence of token ids, checked against the model before any work.

``LLM.generate`` / ``score`` and the stage workers take ``prompt_token_ids``, a non-empty list
(or tuple) of prompts. A prompt is a sequence of ids: a list, tuple or range, or a 1-D numpy
array or torch tensor. A mapping or a set is not one (its order is not the prompt's, and a
dict would give its keys), nor an iterator (it would be used up), a string, or anything
nested deeper. An id is a Python int or a numpy/torch integer scalar, never a bool, a float
or a string, which would be silently read as some other token.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from rocm_mla.models.kimi_k3 import KimiK3Config


def token_id(value: object, where: str) -> int:
    """``value`` as a token id; ``ValueError`` naming ``where`` for anything but an int."""
    is_bool = isinstance(value, bool) or getattr(value, "dtype", None) in (torch.bool, "bool")
    # A one-element array or tensor also has __index__; it is a nested prompt, not an id.
    is_scalar = getattr(value, "ndim", 0) == 0
    if is_scalar and not is_bool and not isinstance(value, (float, str, bytes)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{where}: expected an int token id, got {value!r} ({type(value).__name__})")


def _prompt_ids(prompt: object, where: str) -> list[int]:
    ndim = getattr(prompt, "ndim", None)
    if ndim is not None:
        if ndim != 1:
            raise ValueError(
                f"{where}: expected a list of ints, got a {ndim}-D {type(prompt).__name__}"
            )
    elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise ValueError(f"{where}: expected a list of ints, got a {type(prompt).__name__}")
    return [token_id(t, f"{where}[{j}]") for j, t in enumerate(prompt)]


def check_prompts(
    config: KimiK3Config, prompt_token_ids: list[list[int]], max_new_tokens: int = 0
) -> list[list[int]]:
    """``prompt_token_ids`` as lists of ints, each id in the vocabulary and each prompt plus
    ``max_new_tokens`` within the model's positions; ``ValueError`` naming the entry."""
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        got = (
            "an empty list"
            if isinstance(prompt_token_ids, (list, tuple))
            else f"a {type(prompt_token_ids).__name__}"
        )
        raise ValueError(
            f"prompt_token_ids: expected a non-empty list of token-id lists, got {got}"
        )
    vocab = config.vocab_size
    limit = config.max_position_embeddings
    prompts = []
    for i, prompt in enumerate(prompt_token_ids):
        ids = _prompt_ids(prompt, f"prompt_token_ids[{i}]")
        if not ids:
            raise ValueError(f"prompt_token_ids[{i}]: a prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt_token_ids[{i}]: token ids must lie in [0, {vocab}), got {bad[:5]}"
            )
        if len(ids) + max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens: prompt {i} has {len(ids)} tokens, + max_new_tokens="
                f"{max_new_tokens} passes the model's max_position_embeddings={limit}"
                if max_new_tokens
                else f"prompt_token_ids[{i}]: {len(ids)} tokens pass the model's "
                f"max_position_embeddings={limit}"
            )
        prompts.append(ids)
    return prompts
