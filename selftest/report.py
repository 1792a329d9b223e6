"""One row per check of the self-test, and the table they print as."""

from __future__ import annotations

from dataclasses import dataclass

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Row:
    key: str  # unique, the table's first column: "workflow:<name>", "decode:fusion=<level>", "kernel:<op>:<impl>"
    impl: str = ""  # the implementation that ran (what the registry chose)
    result: str = ""  # "exact", "max|diff| 1.2e-07 (tol 2e-05)", "video 64x64 5 fr 16 fps", or what went wrong
    seconds: float | None = None
    ratio: float | None = None  # our time / the twin's (core VAE Decode, the torch twin)
    status: str = PASS
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL


COLUMNS = ("workflow / op", "implementation", "exact / max |diff|", "seconds", "ratio", "status", "note")


def _cell(row: Row) -> tuple[str, ...]:
    seconds = "" if row.seconds is None else f"{row.seconds:.2f}"
    ratio = "" if row.ratio is None else f"{row.ratio:.2f}x"
    return (row.key, row.impl, row.result, seconds, ratio, row.status, row.note)


def table(rows: list[Row], max_result: int = 80) -> str:
    """A plain-text table (one line per row); long results are cut to `max_result` characters."""
    cells = [COLUMNS] + [_cell(r) for r in rows]
    cells = [
        tuple(c if i != 2 or len(c) <= max_result else c[: max_result - 3] + "..." for i, c in enumerate(row))
        for row in cells
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    right = {3, 4}
    lines = []
    for n, row in enumerate(cells):
        parts = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in (PASS, FAIL, SKIP)}
    verdict = "FAILED" if counts[FAIL] else "OK"
    return f"omnivideo selftest {verdict}: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped"
