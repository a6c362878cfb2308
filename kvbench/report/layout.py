"""How a task's scores are laid out, read from metrics.json `layout` (written by the task: kvbench.tasks.base
Task.layout), so the report knows nothing of any task: the score columns in order with their category headers and
sort keys, the summary scores, the length x depth cells of heatmaps, the average's score, and the recipe a shard
merge recomputes the scores with (kvbench.metrics.aggregate). A run without `layout` (an older kvbench) is skipped
with a note.
"""

from __future__ import annotations

from typing import Any

Layout = dict[str, Any]

def stored_layout(metrics: dict[str, Any]) -> Layout | None:
    """metrics.json `layout` with its parts checked for shape (anything malformed is dropped, not trusted), or None
    when it is missing or not an object."""
    lay = metrics.get("layout")
    if not isinstance(lay, dict):
        return None
    columns = [c for c in lay.get("columns") or [] if isinstance(c, dict) and isinstance(c.get("score"), str)]
    cells = {k: tuple(float(x) for x in v) for k, v in (lay.get("cells") or {}).items()
             if isinstance(v, (list, tuple)) and len(v) == 2 and all(_num(x) for x in v)}
    recipe = lay.get("recipe")
    return {"columns": [{"score": c["score"], "category": c["category"] if isinstance(c.get("category"), str) else None,
                         **({"sort": c["sort"]} if isinstance(c.get("sort"), list) else {})} for c in columns],
            "summary": [s for s in lay.get("summary") or [] if isinstance(s, str)],
            "cells": cells,
            "average": lay.get("average") if isinstance(lay.get("average"), str) else None,
            "recipe": recipe if isinstance(recipe, dict) and recipe else None}


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# -- the columns of several runs of one task ---------------------------------------------------------------------


def merge_layouts(layouts: list[Layout], names: list[str], task: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The detail columns and summary scores of one task over its runs' layouts: the columns of every layout (the
    first one's category where they differ; the task's name where none is given), only scores some run has
    (`names`, in first-seen order), sorted by their sort keys when every column has one (and the keys compare);
    scores no layout places are detail columns under the task's name at the end."""
    present = set(names)
    summary = [s for s in dict.fromkeys(s for lay in layouts for s in lay["summary"]) if s in present]
    placed: dict[str, dict[str, Any]] = {}
    for lay in layouts:
        for c in lay["columns"]:
            if c["score"] in present and c["score"] not in summary:
                placed.setdefault(c["score"], {**c, "category": c["category"] or task})
    cols = list(placed.values())
    if cols and all("sort" in c for c in cols):
        try:
            cols = sorted(cols, key=lambda c: c["sort"])
        except TypeError:  # keys of different shapes (hand-written layouts): keep the runs' order
            pass
    cols += [{"score": n, "category": task} for n in names if n not in placed and n not in summary]
    return cols, summary


def cells_of(layouts: list[Layout]) -> dict[str, tuple[float, float]]:
    """Score name -> (context length, depth) over the layouts."""
    out: dict[str, tuple[float, float]] = {}
    for lay in layouts:
        for k, v in lay["cells"].items():
            out.setdefault(k, (float(v[0]), float(v[1])))
    return out
