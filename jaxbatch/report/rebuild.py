"""`jaxbatch-report DIR`: summary.csv and the standard figures of a sweep directory (or of one
run's directory), rebuilt from the files its runs wrote: a finished sweep, an interrupted one, or
one run on another machine and copied here. Runs nothing; says which job directories it skipped
and why, and fails with one message when DIR holds no run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxbatch.report.sweep import AGAINST, COLUMNS, summarize_sweep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jaxbatch-report", description=__doc__)
    ap.add_argument("dir", type=Path, help="a multirun's sweep directory, or one run's directory")
    ap.add_argument(
        "--against", default=",".join(AGAINST),
        help="summary.csv columns that by_<field>.png plots against each swept field",
    )  # fmt: skip
    args = ap.parse_args(argv)
    against = tuple(args.against.split(","))
    bad = [m for m in against if m not in COLUMNS]
    if bad:
        return _fail(f"--against: {', '.join(bad)} is not a summary.csv column; use any of "
                     + ", ".join(COLUMNS[4:]))  # fmt: skip
    if not args.dir.is_dir():
        return _fail(f"{args.dir} is not a directory")
    rows, skipped = summarize_sweep(args.dir, against)
    for job, why in skipped:
        print(f"jaxbatch-report: skipped {job}: {why}", file=sys.stderr)
    if not rows:
        return _fail(f"no runs in {args.dir}: no job directory with metrics.json or error.json "
                     "(give a multirun's sweep directory, or one run's directory)")  # fmt: skip
    failed = sum(r["status"] == "failed" for r in rows)
    figures = sorted(p.name for p in args.dir.glob("*.png"))
    print(f"jaxbatch-report: {len(rows)} runs ({failed} failed) summarised in "
          f"{args.dir}/summary.csv; figures: {', '.join(figures)}")  # fmt: skip
    return 0


def _fail(message: str) -> int:
    print(f"jaxbatch-report: error: {message}", file=sys.stderr)
    return 2


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
