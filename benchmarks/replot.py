"""Redraw the committed figures and results pages from the committed JSON, measuring nothing.

Usage: python -m benchmarks.replot [FOLDER]   (default docs/performance)

Reads ``results.json`` and ``bulk.json`` in ``FOLDER``; writes the bus-bandwidth figures
(``busbw.png``, ``busbw-2.png``, ...), ``bulk.png``, ``results.md`` and ``bulk.md`` there,
as the runs that made the JSON would with today's plotting and wording. The figures draw
the memory-bandwidth bound where ``results.json`` records the machine's memory bandwidth;
``python -m benchmarks.membw --json FOLDER/results.json`` measures it and adds it to a
file that lacks it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks import bulk, goals, plots, report


def main(argv: list[str] | None = None) -> list[Path]:
    """Redraw what ``FOLDER`` holds; return the files written."""
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0] if args else "docs/performance")
    written = []
    results_json = folder / "results.json"
    if results_json.is_file():
        data = json.loads(results_json.read_text())
        membw = data["meta"].get("membw")
        figures = plots.busbw(folder / "busbw.png", data["results"], membw)
        verdicts = goals.evaluate(data["results"], data.get("latency", []))
        names = [(path.name, ops) for path, ops in figures]
        (folder / "results.md").write_text(report.markdown(data, goals.text(verdicts), names))
        written += [path for path, _ in figures] + [folder / "results.md"]
    bulk_json = folder / "bulk.json"
    if bulk_json.is_file():
        data = json.loads(bulk_json.read_text())
        plots.bulk(folder / "bulk.png", data["results"])
        text = (
            bulk.table(data["results"]) + "\n\n" + bulk.goals_text(bulk.evaluate(data["results"]))
        )
        (folder / "bulk.md").write_text(bulk.page(data["meta"], text, folder / "bulk.png"))
        written += [folder / "bulk.png", folder / "bulk.md"]
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
