"""Reports: one timestamped JSON (for tools) and one Markdown file (for people) per run.

Each run gets new files instead of overwriting a fixed name, so a report attached to an issue
or compared across commits stays what it was when it was written.
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from llama_base.paths import reports_dir


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        return str(v).replace("|", "\\|").replace("\n", "\\n")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def token_label(tokenizer, token: int) -> str:
    """A token as `'text' (id)`, quoted so whitespace and newlines stay visible in a table."""
    return f"{tokenizer.decode([token])!r} ({token})"


def report_paths(kind: str) -> tuple[Path, Path]:
    """New `<kind>-<UTC time>.json` and `.md` paths under `reports_dir()`, the JSON created
    empty so that no other run takes the same name; files that go with the report (a plot)
    can then be named after it before it is written."""
    folder = reports_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base, n = f"{kind}-{stamp}", 1
    while True:
        jpath, mpath = folder / f"{base}.json", folder / f"{base}.md"
        if not mpath.exists():
            try:
                jpath.open("x").close()
                return jpath, mpath
            except FileExistsError:
                pass
        n += 1
        base = f"{kind}-{stamp}-{n}"


def write_report(kind: str, data: dict, markdown: str, paths: tuple[Path, Path] | None = None) -> tuple[Path, Path]:
    """Write `<kind>-<UTC time>.json` and `.md` under `reports_dir()` (or at `paths`, from
    `report_paths`); returns both paths."""
    jpath, mpath = paths or report_paths(kind)
    jpath.write_text(json.dumps(data, indent=2) + "\n")
    mpath.write_text(markdown.rstrip() + "\n")
    return jpath, mpath
