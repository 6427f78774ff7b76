"""Regenerate the performance table of docs/benchmarks.md: ``python -m bench.readme``.

The protocol: a module ``bench/bench_*.py`` that publishes rows defines

    def readme_rows() -> list[tuple[str, str, str]]:
        '''(goal, measured, reference) per row, from one run at the module's defaults.'''

where ``goal`` states the target (``... ≤ 2x ...``), ``measured`` the figure and its ratio, and
``reference`` the physical reference the ratio is taken against, measured in the same run and
interleaved with what it is compared to. This command imports every such module (in name order),
calls ``readme_rows()`` once, and rewrites the table between docs/benchmarks.md's
``<!-- bench:table:start -->`` and ``<!-- bench:table:end -->`` markers, one row per figure,
the module named in the first column. Above the table each module has its stamp: the date of its
last run and the load average at the end of that run (the machine may be shared: the ratios are
the point); a module not rerun keeps its rows and its stamp.

    python -m bench.readme                       # every module with readme_rows
    python -m bench.readme --only bench_restore  # rerun some; the other modules' rows are kept
    python -m bench.readme --print               # print the table, leave the page alone

A benchmark that fails keeps its earlier rows (the command then exits non-zero, naming it). Some
read the shared trajectories beside the repository (``COMPACTD_SHARED`` names that ``shared``
folder, as for ``bench_pressure``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The page that holds the table (``readme`` in the names is from when the README held it).
PAGE = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- bench:table:start -->", "<!-- bench:table:end -->"
HEADER = "| benchmark | goal | measured | reference (same run) |\n|---|---|---|---|"

Row = tuple[str, str, str]


def publishers() -> list[str]:
    """The ``bench/bench_*.py`` modules that define ``readme_rows``."""
    found = []
    for path in sorted((ROOT / "bench").glob("bench_*.py")):
        if re.search(r"^def readme_rows\(", path.read_text(encoding="utf-8"), re.MULTILINE):
            found.append(path.stem)
    return found


def run(name: str) -> list[Row]:
    """One module's rows."""
    module = importlib.import_module(f"bench.{name}")
    rows: Callable[[], list[Row]] = module.readme_rows
    return rows()


def table(rows: Sequence[tuple[str, Row]], note: str) -> str:
    """The markdown between the markers. A ``|`` in a cell would split it (and ``kept_rows``
    would drop the row on the next run): it is written as ``/``."""
    lines = [note, "", HEADER]
    for name, row in rows:
        goal, measured, reference = (cell.replace("|", "/") for cell in row)
        lines.append(f"| `{name}` | {goal} | {measured} | {reference} |")
    return "\n".join(lines)


def kept_rows(text: str) -> list[tuple[str, Row]]:
    """The rows the page's table holds now."""
    if START not in text or END not in text:
        return []
    body = text[text.index(START) + len(START) : text.index(END)]
    found = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            found.append((cells[0].strip("`"), (cells[1], cells[2], cells[3])))
    return found


#: One module's stamp as the note writes it: `` `bench_x` 2026-12-05, load average 1.0, 0.9, 0.8``.
_STAMP = re.compile(r"`(bench_\w+)` (\d{4}-\d{2}-\d{2}, load average \d+\.\d, \d+\.\d, \d+\.\d)")


def kept_stamps(text: str) -> dict[str, str]:
    """Each module's stamp (its date and load average) in the page's note now."""
    if START not in text or END not in text:
        return {}
    body = text[text.index(START) + len(START) : text.index(END)]
    return {name: stamp for name, stamp in _STAMP.findall(body.split("\n|", 1)[0])}


def stamp_now() -> str:
    """A stamp for a module whose run just ended: today, and the load average now."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{datetime.date.today().isoformat()}, load average {load}"


def note(stamps: dict[str, str], names: Sequence[str]) -> str:
    """The line above the table: every module's stamp, in ``names``' order."""
    listed = "; ".join(f"`{n}` {stamps[n]}" for n in names if n in stamps)
    return (
        f"Last regenerated on {os.cpu_count()} cores (each benchmark's date, and the load average "
        f"at the end of its run): {listed}. Regenerate with `python -m bench.readme`."
    )


def rewrite(text: str, rendered: str) -> str:
    """``text`` with the table between the markers replaced (the markers appended if absent)."""
    if START not in text or END not in text:
        raise SystemExit(f"{PAGE.relative_to(ROOT)} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{rendered}\n{END}{tail}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="modules to rerun")
    parser.add_argument("--print", action="store_true", help="print, leave the page alone")
    args = parser.parse_args(argv)
    names = publishers()
    chosen = names if not args.only else [n for n in names if n in args.only]
    text = PAGE.read_text(encoding="utf-8")
    fresh: dict[str, list[Row]] = {}
    stamps = kept_stamps(text)
    failed: list[str] = []
    for name in chosen:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            fresh[name] = run(name)
        except Exception:  # one benchmark's failure keeps its old rows, not the others' new ones
            traceback.print_exc()
            failed.append(name)
            continue
        stamps[name] = stamp_now()
    kept = [(n, r) for n, r in kept_rows(text) if n not in fresh and n in names]
    rows = kept + [(n, r) for n in chosen if n in fresh for r in fresh[n]]
    rows.sort(key=lambda item: names.index(item[0]))
    rendered = table(rows, note(stamps, names))
    if args.print:
        print(rendered)
    else:
        PAGE.write_text(rewrite(text, rendered), encoding="utf-8")
        print(rendered)
    if failed:
        raise SystemExit(f"failed (their earlier rows kept): {', '.join(failed)}")


if __name__ == "__main__":
    main()
