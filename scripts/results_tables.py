"""The results' tables, written from their data.

Each benchmark's measured output is kept as data in docs/results/data/<page>.json: a table's name, then its column
headers, its alignment (one letter a column: l or r) and its rows, every cell the text as measured and printed. In
any markdown file under docs/, a table stands between two markers,

    <!-- table: NAME -->
    | ... the table ... |
    <!-- /table -->

and is written from the data's table NAME (names are unique over the data files).

    python scripts/results_tables.py           # rewrite every marked table from its data
    python scripts/results_tables.py --check   # change nothing; exit 1 naming each table that differs from its data
"""

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKED = re.compile(r"(<!-- table: (\S+) -->\n)(.*?)(<!-- /table -->)", re.S)


def load_tables(data: Path) -> dict[str, dict]:
    tables, found_in = {}, {}
    for path in sorted(data.glob("*.json")):
        for name, table in json.loads(path.read_text()).items():
            if name in tables:
                raise SystemExit(f"table {name!r} is in both {found_in[name]} and {path.name}")
            tables[name], found_in[name] = table, path.name
    return tables


def render(table: dict) -> str:
    columns, align, rows = table["columns"], table["align"], table["rows"]
    assert len(align) == len(columns) and all(len(row) == len(columns) for row in rows), table

    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"

    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return "\n".join([line(columns), rule, *map(line, rows)]) + "\n"


def check_or_write(docs: Path, write: bool) -> list[str]:
    """Every marked table under `docs` against its data: what differs (rewritten from the data if `write`)."""
    tables = load_tables(docs / "results" / "data")
    problems, shown = [], set()
    for page in sorted(docs.rglob("*.md")):
        text = new_text = page.read_text()
        for match in MARKED.finditer(text):
            start, name, old, end = match.groups()
            shown.add(name)
            where = f"{page.relative_to(docs)}: table {name!r}"
            if name not in tables:
                problems.append(f"{where} has no data")
            elif old != render(tables[name]):
                problems.append(f"{where} {'rewritten from' if write else 'differs from'} its data")
                new_text = new_text.replace(match.group(0), start + render(tables[name]) + end)
        if write and new_text != text:
            page.write_text(new_text)
    problems += [f"table {name!r} is in the data but on no page" for name in sorted(tables.keys() - shown)]
    return problems


def main(argv: list[str] | None = None, docs: Path = ROOT / "docs") -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from its data")
    args = parser.parse_args(argv)
    problems = check_or_write(docs, write=not args.check)
    for problem in problems:
        print(problem, file=sys.stderr)
    failed = problems if args.check else [problem for problem in problems if "rewritten" not in problem]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
