"""A benchmark's results as a Markdown report with PNG plots, from Python or the command line.

    python -m loadtest.report_md --out report/ --title "chat, 4 engines" \\
        round_robin=rr.jsonl prefix_aware=pa.jsonl

writes ``report/report.md`` with a summary table (requests, failures, hit ratio, TTFT
quantiles, each as a ratio against the first contender, the baseline) and, next to it,
``ttft_cdf.png``, ``hit_ratio.png``, ``backend_share.png`` and ``queue_depth.png`` (each only
when the results hold what it shows). Benchmarks call :func:`write_report` with their own
:class:`~loadtest.results.Contender` s and any extra tables of their own.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from loadtest import plots
from loadtest.help_format import DefaultsHelpFormatter
from loadtest.results import Contender, load_records

Table = tuple[str, Sequence[str], Sequence[Sequence[object]]]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; the first column left-aligned, the others right-aligned."""
    align = ["---", *["---:"] * (len(headers) - 1)]
    lines = [headers, align, *[[str(c) for c in row] for row in rows]]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.0f} ms"


def _ratio(value: float, base: float) -> str:
    if math.isnan(value) or math.isnan(base) or base == 0:
        return "n/a"
    return f"{value / base:.2f}x"


def summary_table(contenders: Sequence[Contender]) -> Table:
    """One row per contender; ratios are against the first contender (the baseline)."""
    base = contenders[0]
    rows = []
    for c in contenders:
        share = " / ".join(f"{name} {v:.0%}" for name, v in c.share().items())
        rows.append(
            [
                c.name,
                len(c.requests),
                c.failed,
                f"{c.hit_ratio:.1%}",
                _ms(c.ttft_quantile(0.5)),
                _ms(c.ttft_quantile(0.9)),
                _ms(c.ttft_quantile(0.99)),
                _ratio(c.ttft_quantile(0.5), base.ttft_quantile(0.5)),
                _ratio(c.ttft_quantile(0.99), base.ttft_quantile(0.99)),
                share or "n/a",
            ]
        )
    headers = [
        "contender",
        "requests",
        "failed",
        "hit ratio",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        f"p50 vs {base.name}",
        f"p99 vs {base.name}",
        "backend share",
    ]
    return ("Summary", headers, rows)


def write_report(
    contenders: Sequence[Contender],
    out_dir: str | Path,
    title: str,
    *,
    intro: str = "",
    tables: Sequence[Table] = (),
    window: float | None = None,
) -> Path:
    """Write ``out_dir/report.md`` and its PNGs; returns the Markdown file's path.

    ``tables`` are extra ``(heading, headers, rows)`` sections placed after the summary;
    with no contenders, the report is just those tables (e.g. the router overhead benchmark).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections = [f"# {title}"]
    if intro:
        sections.append(intro.strip())
    all_tables = ([summary_table(contenders)] if contenders else []) + list(tables)
    for heading, headers, rows in all_tables:
        sections.append(f"## {heading}\n\n{markdown_table(headers, rows)}")
    if contenders:
        sections.append("## Plots")
        figures = [("TTFT CDF", plots.ttft_cdf(contenders, out / "ttft_cdf.png"))]
        if any(r.prompt_tokens for c in contenders for r in c.ok):
            figures.append(
                ("Hit ratio over time", plots.hit_ratio_over_time(contenders, out / "hit_ratio.png", window))
            )
        if any(r.backend for c in contenders for r in c.ok):
            figures.append(
                (
                    "Per-backend request share",
                    plots.backend_share_over_time(contenders, out / "backend_share.png", window),
                )
            )
        if any(c.queue for c in contenders):
            figures.append(("Queue depth", plots.queue_depth_over_time(contenders, out / "queue_depth.png")))
        sections.extend(f"![{alt}]({path.name})" for alt, path in figures)
    report = out / "report.md"
    report.write_text("\n\n".join(sections) + "\n")
    return report


def _contender_arg(value: str) -> Contender:
    name, sep, path = value.partition("=")
    return load_records(path, name) if sep else load_records(value)


def main(argv: list[str] | None = None, prog: str = "python -m loadtest.report_md") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=DefaultsHelpFormatter,
        description="Turn benchmark records (JSON lines, e.g. locust --records) into a Markdown report.",
    )
    parser.add_argument(
        "records", nargs="+", help="NAME=PATH or PATH (named after the file); the first is the baseline"
    )
    parser.add_argument("--out", required=True, help="directory for report.md and the PNGs")
    parser.add_argument("--title", default="Benchmark report")
    parser.add_argument(
        "--window", type=float, default=None, help="seconds per time bucket (default: ~30 buckets)"
    )
    args = parser.parse_args(argv)
    try:
        contenders = [_contender_arg(value) for value in args.records]
    except (OSError, ValueError) as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    print(write_report(contenders, args.out, args.title, window=args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
