"""The titles of a report's markdown tables, for tests that every table the bench commands write names its card."""

from __future__ import annotations


def table_titles(text: str) -> list[str]:
    """Each markdown table's title in `text`: the nearest non-empty line above its header row ("" for none)."""
    lines = text.splitlines()
    titles = []
    for index, line in enumerate(lines):
        if not line.startswith("|") or (index > 0 and lines[index - 1].startswith("|")):
            continue
        above = [previous for previous in lines[:index] if previous.strip()]
        titles.append(above[-1] if above else "")
    return titles


def assert_every_table_names(text: str, device: str, tables: int) -> None:
    """`text` holds `tables` tables, each titled with 'on DEVICE'."""
    titles = table_titles(text)
    assert len(titles) == tables and all(f"on {device}" in title for title in titles), titles
