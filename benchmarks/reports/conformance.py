"""The conformance matrix's table (docs/reliability.md): entry points down, classes across, each
cell counting the configurations that equal the single-process reference and those refused on
every rank, from the JSON that ``tests/conformance`` writes."""

from __future__ import annotations

__all__ = ["conformance_table"]


def _cell_text(rows: list[dict]) -> str:
    if not rows:
        return ""
    broken = sum(1 for row in rows if not row["holds"])
    equal = sum(1 for row in rows if row["holds"] and row["expects"] == "equals reference")
    refused = sum(1 for row in rows if row["holds"] and row["expects"] == "refused")
    parts = [
        f"{equal} =" if equal else "",
        f"{refused} refused" if refused else "",
        f"**{broken} broken**" if broken else "",
    ]
    return ", ".join(part for part in parts if part)


def conformance_table(reports: list[dict]) -> str:
    """Entry point × class: per cell, how many configurations equal the reference (``=``) and how
    many are refused on every rank; a configuration that broke its promise is counted in bold."""
    cells = [row for report in reports for row in report["cells"]]
    classes = [name for name in reports[0]["classes"] if any(row["class"] == name for row in cells)]
    entries = list(dict.fromkeys(row["entry"] for row in sorted(cells, key=lambda row: row["entry"])))
    lines = ["| entry point | " + " | ".join(classes) + " |", "|---|" + "---|" * len(classes)]
    for entry in entries:
        texts = [_cell_text([r for r in cells if r["entry"] == entry and r["class"] == name]) for name in classes]
        lines.append(f"| {entry} | " + " | ".join(texts) + " |")
    held = sum(row["holds"] for row in cells)
    lines.append("")
    lines.append(
        f"{len(cells)} configurations, {held} holding their promise "
        f"({sum(row['expects'] == 'refused' for row in cells)} of them refusals); ranks per spawn: "
        + ", ".join(str(n) for n in sorted({row["ranks"] for row in cells}))
        + "."
    )
    return "\n".join(lines)
