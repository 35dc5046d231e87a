"""The benchmarks' result lines: their contract, and met or missed from the line alone.

Every `bench/*.py` prints one JSON object per line on stdout:

    {"bench", "metric", "unit", "ours", "baseline", "ratio", "target",
     "better": "lower" | "higher", "target_on": "ratio" | "ours" | <field>, ...}

* `ratio` is ours / baseline (null when the baseline is 0 and ours is not, or
  when either side is missing);
* `better` says which way is good, for `ours`, for `ratio` and for the target;
* `target_on` says what the target bounds: the ratio against the baseline, our
  own number (an absolute goal such as "a scan under 100 ms"), or, for a target
  that is not a number, the field that must equal it (`"state": "SUCCEEDED"`);
* `target` null means informative: nothing to meet;
* `error` names why a side is missing; a line with one is `failed`.
Optional fields: `spread` ({"ours": [min, max], "baseline": [min, max]} over
the repeats), `runs` ({"ours": n, "baseline": n}), `failed_runs`, `settings`,
`notes`.

`verdict(line)` is "met", "missed", "informative" or "failed"; `problems(line)`
lists what makes a line malformed. Used by `harness.emit`, by the tests that
run every script's quick mode, and by `make bench`:

    python bench/check.py RESULTS.jsonl [--markdown OUT.md]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

REQUIRED = ("bench", "metric", "unit", "ours", "baseline", "ratio", "target", "better", "target_on")
BETTER = ("lower", "higher")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def ratio_of(ours: float | None, baseline: float | None) -> float | None:
    """ours / baseline; 0/0 is 0 (both sides at the ideal, e.g. nothing lost)."""
    if ours is None or baseline is None:
        return None
    if baseline == 0:
        return 0.0 if ours == 0 else None
    return ours / baseline


def problems(line: Any) -> list[str]:
    """What is wrong with a result line; empty when it is well formed."""
    if not isinstance(line, dict):
        return [f"a result line is a JSON object, got {type(line).__name__}"]
    out = [f"missing field {k!r}" for k in REQUIRED if k not in line]
    if out:
        return out
    for k in ("bench", "metric", "unit"):
        if not isinstance(line[k], str) or not line[k]:
            out.append(f"{k!r} must be a non-empty string")
    if line["better"] not in BETTER:
        out.append(f"'better' must be 'lower' or 'higher', got {line['better']!r}")
    for k in ("ours", "baseline", "ratio"):
        if line[k] is not None and not _number(line[k]):
            out.append(f"{k!r} must be a finite number or null, got {line[k]!r}")
    if line["ours"] is None and not line.get("error"):
        out.append("'ours' is null without an 'error' saying why")
    on, target = line["target_on"], line["target"]
    if target is not None:
        if on in ("ratio", "ours"):
            if not _number(target):
                out.append(f"a target on {on!r} must be a number, got {target!r}")
        elif not isinstance(on, str) or on not in line:
            out.append(f"'target_on' names {on!r}, which is not a field of the line")
    elif on not in ("ratio", "ours") and not isinstance(on, str):
        out.append(f"'target_on' must be 'ratio', 'ours' or a field name, got {on!r}")
    if _number(line["ours"]) and _number(line["baseline"]) and _number(line["ratio"]):
        want = ratio_of(line["ours"], line["baseline"])
        if want is not None and not math.isclose(want, line["ratio"], rel_tol=1e-3, abs_tol=1e-6):
            out.append(f"'ratio' {line['ratio']} is not ours / baseline ({want:.6g})")
    return out


def verdict(line: dict[str, Any]) -> str:
    """'met', 'missed', 'informative' (no target) or 'failed' (a side or the value is missing)."""
    if line.get("error") or problems(line):
        return "failed"
    on, target = line["target_on"], line["target"]
    if target is None:
        return "informative"
    value = line[on]
    if on not in ("ratio", "ours"):
        return "met" if value == target else "missed"
    if value is None:
        return "failed"
    ok = value <= target if line["better"] == "lower" else value >= target
    return "met" if ok else "missed"


def read_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        if raw.strip():
            try:
                out.append(json.loads(raw))
            except ValueError as exc:
                raise SystemExit(f"{path}:{n}: not a JSON line ({exc}); every line of a results "
                                 "file is one benchmark result") from None
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown(lines: list[dict[str, Any]]) -> str:
    """The table a reader sees first: one row a metric."""
    rows = ["| bench | metric | unit | ours | baseline | ratio | target | met |",
            "|---|---|---|---|---|---|---|---|"]
    for ln in lines:
        target = ln.get("target")
        if target is not None:
            sign = "<=" if ln.get("better") == "lower" else ">="
            on = ln.get("target_on")
            target = f"{on} {sign} {_fmt(target)}" if on in ("ratio", "ours") else f"{on} = {target}"
        v = verdict(ln)
        why = f" ({ln['error'][:80]})" if v == "failed" and ln.get("error") else ""
        rows.append(f"| {ln.get('bench')} | {ln.get('metric')} | {ln.get('unit')} | "
                    f"{_fmt(ln.get('ours'))} | {_fmt(ln.get('baseline'))} | {_fmt(ln.get('ratio'))} | "
                    f"{_fmt(target)} | {v}{why} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check benchmark result lines: met or missed.")
    ap.add_argument("results", type=Path, help="a JSON-lines file of benchmark results")
    ap.add_argument("--markdown", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    if not args.results.is_file():
        print(f"error: {args.results} is not a file; pass the JSON-lines file a benchmark wrote",
              file=sys.stderr)
        return 2
    lines = read_lines(args.results)
    bad = [(ln.get("metric"), p) for ln in lines for p in problems(ln)]
    table = markdown(lines)
    print(table, end="")
    if args.markdown:
        args.markdown.write_text(table)
    for metric, p in bad:
        print(f"malformed line {metric}: {p}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
