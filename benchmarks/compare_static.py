"""Compare two ``bench static`` result files case by case: the launched configs and every
gate's verdict, on the targets both hold.

A change that should not move the compiled decode (a refactor, a new target) is checked with
it against the committed results::

    python -m benchmarks.compare_static OLD.json NEW.json [--targets sm90 gfx942 gfx950]

It prints, per target, the cases compared, those whose configs (per batch) or gate verdicts
differ, and each difference; it exits 1 when any case differs or is missing from either file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _by_case(payload: dict, targets: set[str] | None) -> dict[tuple[str, str], dict]:
    return {
        (r["target"], r["case"]["name"]): r
        for r in payload["results"]
        if targets is None or r["target"] in targets
    }


def _configs(result: dict) -> dict[int, dict]:
    return {b["batch"]: b["config"] for b in result["per_batch"]}


def _verdicts(result: dict) -> dict[str, bool | None]:
    return {name: gate["pass"] for name, gate in result["gates"].items()}


def compare(old: dict, new: dict, targets: set[str] | None = None) -> dict:
    """Per target: cases compared, configs differing, verdicts differing, and the missing
    cases; ``differences`` lists each as text."""
    if targets is None:
        targets = {r["target"] for r in old["results"]} & {r["target"] for r in new["results"]}
    before, after = _by_case(old, targets), _by_case(new, targets)
    summary = {
        t: {"cases": 0, "configs_differ": 0, "gates_differ": 0, "missing": 0}
        for t in sorted(targets)
    }
    differences = []
    for key in sorted(before.keys() | after.keys()):
        target, name = key
        if key not in before or key not in after:
            summary[target]["missing"] += 1
            side = "old" if key not in before else "new"
            differences.append(f"{target} {name}: not in the {side} file")
            continue
        summary[target]["cases"] += 1
        a, b = before[key], after[key]
        if _configs(a) != _configs(b):
            summary[target]["configs_differ"] += 1
            differences.append(f"{target} {name}: configs {_configs(a)} -> {_configs(b)}")
        if _verdicts(a) != _verdicts(b):
            summary[target]["gates_differ"] += 1
            differences.append(f"{target} {name}: gates {_verdicts(a)} -> {_verdicts(b)}")
    return {"targets": summary, "differences": differences}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--targets", nargs="+", help="registry keys (default: those in both)")
    args = parser.parse_args(argv)
    old, new = (json.loads(p.read_text()) for p in (args.old, args.new))
    report = compare(old, new, set(args.targets) if args.targets else None)
    for target, counts in report["targets"].items():
        print(
            f"{target}: {counts['cases']} cases compared, {counts['configs_differ']} with other "
            f"configs, {counts['gates_differ']} with other gate verdicts, {counts['missing']} "
            "missing"
        )
    for line in report["differences"]:
        print(line)
    return 1 if report["differences"] else 0


if __name__ == "__main__":
    sys.exit(main())
