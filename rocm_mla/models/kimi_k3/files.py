"""Opening a checkpoint's files: only inside the model directory, JSON only as what it must be.

``checkpoint_file`` refuses names that lead out of the model directory (an index that points
at ``/etc/passwd``); ``read_json_object`` reads a config/index file and fails with one line
naming the file for anything that is not a JSON object: invalid JSON, a top-level list or
null, or nesting deep enough to exhaust the parser's recursion.
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


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``; ``ValueError`` naming the file when it is anything else."""
    try:
        raw = json.loads(file.read_bytes())
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{file}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
        ) from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{file}: not valid JSON (not UTF-8 text: {err.reason})") from None
    except RecursionError:
        # Python's parser recurses once per nesting level; no real config nests past ~5.
        raise ValueError(f"{file}: JSON nested too deeply to be a config") from None
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
