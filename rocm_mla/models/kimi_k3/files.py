"""Opening a checkpoint's files: only inside the model directory, JSON only as what it must be.

``checkpoint_file`` refuses names that lead out of the model directory (an index that points
at ``/etc/passwd``); ``read_json_object`` reads a config/index file and fails with one line
naming the file for anything that is not a JSON object: invalid JSON, a top-level list or
null, or nesting deep enough to exhaust the parser's recursion; and naming the file and key
for an integer too long to be any config value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class UnsafeCheckpointPath(ValueError):
    """A checkpoint file name that points outside the model directory."""


def checkpoint_file(root: str | Path, name: str) -> Path:
    """``root / name``, refused unless it resolves inside ``root`` (symlinks followed).

    ``name`` must be a relative path without ``..``. A Hugging Face cache snapshot
    (``.../snapshots/<rev>/``) may also link into its repository's ``blobs/``: that is how
    the hub stores every file.
    """
    root = Path(root)
    if not isinstance(name, str) or not name or "\0" in name:
        raise UnsafeCheckpointPath(f"{root}: checkpoint file name {name!r} is not a file name")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise UnsafeCheckpointPath(
            f"{root}: checkpoint file {name!r} must be a relative path inside the model "
            "directory (no absolute paths, no '..'); refusing to open it"
        )
    base = root.resolve()
    allowed = [base]
    if base.parent.name == "snapshots":
        allowed.append(base.parent.parent / "blobs")
    target = (root / relative).resolve()
    if not any(target == a or target.is_relative_to(a) for a in allowed):
        raise UnsafeCheckpointPath(
            f"{root / relative}: resolves to {target}, outside the model directory {base}; "
            "refusing to open it (copy the file into the directory instead of linking it)"
        )
    return root / relative


#: Digits a JSON integer of a config or index may have. Every real value has far fewer (a
#: byte count has 20 at most); past Python's own limit (4300) ``json`` would fail naming
#: neither file nor key, and a long one below it would fill the error of its range check.
MAX_JSON_INT_DIGITS = 100


class _LongInt:
    """A JSON integer of more than ``MAX_JSON_INT_DIGITS`` digits, kept unconverted until
    ``_refuse_long_ints`` names its key."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))


def _parse_int(text: str) -> int | _LongInt:
    return _LongInt(text) if len(text.lstrip("-")) > MAX_JSON_INT_DIGITS else int(text)


def _refuse_long_ints(value: Any, key: str) -> None:
    """``ValueError`` naming the key (``text_config.vocab_size``, ``a.b[2]``) of the first
    ``_LongInt`` in ``value``."""
    if isinstance(value, _LongInt):
        raise ValueError(
            f"{key}: expected a number of at most {MAX_JSON_INT_DIGITS} digits, got an integer "
            f"of {value.digits} digits"
        )
    if isinstance(value, dict):
        for name, item in value.items():
            _refuse_long_ints(item, f"{key}.{name}" if key else name)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_long_ints(item, f"{key}[{i}]")


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``; ``ValueError`` naming the file when it is anything else,
    or naming the file and key of an integer longer than ``MAX_JSON_INT_DIGITS``."""
    try:
        raw = json.loads(file.read_bytes(), parse_int=_parse_int)
        _refuse_long_ints(raw, "")
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{file}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
        ) from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{file}: not valid JSON (not UTF-8 text: {err.reason})") from None
    except RecursionError:
        # Python's parser recurses once per nesting level; no real config nests past ~5.
        raise ValueError(f"{file}: JSON nested too deeply to be a config") from None
    except ValueError as err:
        raise ValueError(f"{file}: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object at the top level, got {json_kind(raw)}")
    return raw


def json_kind(value: Any) -> str:
    """How JSON would name ``value``'s type, for error messages (``null``, ``a list of 2``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"an object of {len(value)} key(s)"
