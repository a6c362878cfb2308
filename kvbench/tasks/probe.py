"""task=probe: key -> value retrieval in the probe model's vocabulary (needs model=probe or model=probe-b).

A prompt is token-exact: `<s>`, a body of random filler words with `num_needles` needle pairs `k_i v_j`
inserted, then one more filler and the queried key `k_i` as the last token. The answer is `v_j`, the first
generated word; the probe model answers `</s>` (decoded as "") when the needle's evidence was evicted.

Depth = where the queried needle sits in the filler body: slot round((F - 1) * depth / 100) of the F fillers,
so depth 0 puts the needle at positions 1-2 (right after `<s>`) and depth 100 right before the final
filler + query. Other needles (distinct keys and values) go to random other slots. Scores per
(length, depth) cell as `L{length}_D{depth}` plus `avg` (mean of the cells), like NIAH, with a heatmap.

The probe model's key geometry is synthetic, so finalize() attaches a note: only retention, position-based and
random policies are meaningful on it (docs/probe-model.md).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Iterator, Sequence

from kvbench.metrics.aggregate import aggregate_scores
from kvbench.tasks.base import Sample, Task, TaskEnv, TaskError, grid_layout, group_ids, read_text

META_FILE = "probe_meta.json"  # written next to the weights by kvbench.models.probe
HEATMAP_FILE = "probe_heatmap.png"
NOTE = ("probe model: synthetic key geometry. Scores only say whether the needle's KV entries survived; "
        "results for retention, position-based (sinks / recent window) and random policies are meaningful, "
        "but rankings of key- or attention-scored policies (K-norm, KeyDiff, H2O, SnapKV, ...) mean nothing "
        "here: variants A and B retrieve identically yet give K-norm and KeyDiff 0% vs 100%. "
        "See docs/probe-model.md.")


def cell_key(length: int, depth: float) -> str:
    """Score name of a (length, depth) cell, e.g. `L1024_D50` or `L4096_D12.5`."""
    d = float(depth)
    return f"L{int(length)}_D{int(d) if d.is_integer() else format(d, 'g')}"


def read_probe_meta(model_dir: str | Path) -> dict[str, Any]:
    """The probe model's metadata (token ids of fillers, keys, values); TaskError if the model is not a probe."""
    path = Path(str(model_dir)) / META_FILE
    if not path.is_file():
        raise TaskError(f"task=probe needs the probe model (model=probe or model=probe-b): "
                        f"tokenizer directory '{model_dir}' has no {META_FILE}")
    try:
        meta = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise TaskError(f"{path}: not valid JSON ({e.msg})") from None
    missing = [k for k in ("filler_ids", "key_ids", "value_ids", "bos_id") if k not in meta]
    if not meta.get("probe_model") or missing:
        raise TaskError(f"{path}: not probe model metadata (missing: {', '.join(missing) or 'probe_model'})")
    return meta


class ProbeTask(Task):
    name = "probe"
    average_key = "avg"

    def __init__(self, context_lengths: Sequence[int] = (1024, 4096),
                 depths: Sequence[float] = (0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100),
                 num_needles: int = 1, samples_per_cell: int = 4, max_new_tokens: int = 1) -> None:
        self.context_lengths = [int(x) for x in context_lengths]
        self.depths = [float(d) for d in depths]
        self.num_needles = int(num_needles)
        self.samples_per_cell = int(samples_per_cell)
        self.max_new_tokens = int(max_new_tokens)
        if not self.context_lengths or not self.depths:
            raise TaskError("task.context_lengths and task.depths must not be empty")
        bad = [d for d in self.depths if not 0 <= d <= 100]
        if bad:
            raise TaskError(f"task.depths must lie in [0, 100], got {bad}")
        if self.num_needles < 1 or self.samples_per_cell < 1 or self.max_new_tokens < 1:
            raise TaskError("task.num_needles, task.samples_per_cell and task.max_new_tokens must be >= 1")
        # <s> + F fillers + 2 per needle + query key, with the needles in distinct slots before the last filler
        too_short = [n for n in self.context_lengths if n - 2 - 2 * self.num_needles < self.num_needles]
        if too_short:
            raise TaskError(f"task.context_lengths {too_short} too short for {self.num_needles} needle(s): "
                            f"need at least {2 + 3 * self.num_needles} tokens")

    def provenance(self) -> dict[str, Any]:
        from kvbench.models.probe import GENERATOR_VERSION

        return {"source": "generated in-process from the probe model vocabulary (seeded by env.seed)",
                "probe_generator_version": GENERATOR_VERSION, "context_lengths": self.context_lengths,
                "depths": self.depths, "num_needles": self.num_needles, "samples_per_cell": self.samples_per_cell}

    def samples(self, env: TaskEnv) -> Iterator[Sample]:
        meta = read_probe_meta(getattr(env.tokenizer, "name_or_path", ""))
        if self.num_needles > len(meta["key_ids"]):
            raise TaskError(f"task.num_needles={self.num_needles} exceeds the {len(meta['key_ids'])} probe keys")
        over = [n for n in self.context_lengths if n > env.max_prompt_tokens]
        if over:
            raise TaskError(f"task.context_lengths {over} exceed the model's max_prompt_tokens "
                            f"({env.max_prompt_tokens})")
        for length in self.context_lengths:
            for depth in self.depths:
                for s in range(self.samples_per_cell):
                    yield self._build(env, meta, length, depth, s)

    def _build(self, env: TaskEnv, meta: dict[str, Any], length: int, depth: float, s: int) -> Sample:
        n = self.num_needles
        # A string seed hashes with SHA-512, so the stream is the same in every process (resume, sharding).
        rng = random.Random(f"probe|{env.seed}|{length}|{cell_key(length, depth)}|{n}|{s}")
        n_fill = length - 2 - 2 * n
        body = rng.choices(meta["filler_ids"], k=n_fill)
        keys = rng.sample(meta["key_ids"], n)
        values = rng.sample(meta["value_ids"], n)
        # Slot j = the needle goes right before filler j, so a filler always separates the last needle from the
        # query key (a key there would give the query position a P code in the probe model).
        q_slot = math.floor((n_fill - 1) * depth / 100 + 0.5)
        others = rng.sample([j for j in range(n_fill) if j != q_slot], n - 1) if n > 1 else []
        slots = [q_slot] + others  # needle 0 is the queried one
        by_slot = {j: i for i, j in enumerate(slots)}
        ids = [meta["bos_id"]]
        key_pos = [0] * n
        for j, filler in enumerate(body):
            if j in by_slot:
                i = by_slot[j]
                key_pos[i] = len(ids)
                ids += [keys[i], values[i]]
            ids.append(filler)
        ids.append(keys[0])
        assert len(ids) == length
        words = env.tokenizer.convert_ids_to_tokens(ids)
        order = sorted(range(n), key=lambda i: key_pos[i])
        return Sample(
            id=f"probe_{cell_key(length, depth)}_n{n}_{s}",
            input_ids=ids,
            answers=[env.tokenizer.convert_ids_to_tokens(values[0])],
            max_new_tokens=self.max_new_tokens,
            context_tokens=length - 1,  # the final query key is the question
            prompt=" ".join(words),
            meta={
                "length": length,
                "depth": depth,
                "num_needles": n,
                "variant": meta.get("variant"),
                "key": words[key_pos[0]],
                "needle_key_pos": key_pos[0],
                "needle_value_pos": key_pos[0] + 1,
                "query_pos": length - 1,
                # every needle (queried one included), in prompt order
                "all_key_pos": [key_pos[i] for i in order],
                "all_value_pos": [key_pos[i] + 1 for i in order],
            },
        )

    def score(self, sample: Sample, prediction: str) -> float:
        # Exact: the first generated word must be the value (the abstain token decodes to "").
        words = prediction.split()
        return 100.0 if words and words[0] == sample.answers[0] else 0.0

    def _cells(self, records: list[dict[str, Any]]) -> dict[tuple[int, float], list[float]]:
        cells: dict[tuple[int, float], list[float]] = {}
        for r in records:
            m = r.get("meta") or {}
            if "length" not in m or "depth" not in m:
                raise TaskError(f"record {r.get('id')!r} has no meta.length/meta.depth (not a probe record)")
            cells.setdefault((int(m["length"]), float(m["depth"])), []).append(float(r["score"]))
        return cells

    def composition(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        self._cells(records)  # the same check of every record's meta as aggregate's
        out = group_ids(records, lambda r: cell_key(int(r["meta"]["length"]), float(r["meta"]["depth"])))
        if out:
            out["avg"] = {"mean_of": list(out)}  # avg is the mean of the cell means
        return out

    def _grid(self, records: list[dict[str, Any]]) -> list[tuple[int, float]]:
        """The configured cells in sample order (lengths, then depths), then any other cell the records hold: the
        same in every shard of a run."""
        grid = [(L, d) for L in self.context_lengths for d in self.depths]
        return list(dict.fromkeys(grid + list(self._cells(records))))

    def recipe(self, records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        # Each cell the mean of its samples, avg the mean of the cell means (unrounded).
        cells = {cell_key(L, d): {"mean": "score", "where": {"meta.length": L, "meta.depth": d}}
                 for L, d in self._grid(records)}
        return {**cells, "avg": {"mean_of": list(cells), "skip_missing": True}}

    def layout(self, records: list[dict[str, Any]], scores: dict[str, float]) -> dict[str, Any]:
        return grid_layout(self.name, self._grid(records), cell_key, self.average_key, self.recipe(records))

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, float]:
        self._cells(records)  # every record must be a probe record
        return aggregate_scores(records, self.recipe(records))

    def finalize(self, run_dir: Path, records: list[dict[str, Any]], scores: dict[str, float],
                 label: str = "") -> dict[str, Any]:
        cells = self._cells(records)
        if cells:
            title = f"probe retrieval ({scores.get('avg', float('nan')):.1f} avg)" + (f"\n{label}" if label else "")
            _heatmap(Path(run_dir) / HEATMAP_FILE, {k: sum(v) / len(v) for k, v in cells.items()}, title=title)
        return {"notes": [NOTE]}


def _heatmap(path: Path, cells: dict[tuple[int, float], float], title: str) -> None:
    """Depth (rows) x length (columns) heatmap of 0-100 scores; Agg canvas, no pyplot global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lengths = sorted({k[0] for k in cells})
    depths = sorted({k[1] for k in cells})
    grid = [[cells.get((n, d), float("nan")) for n in lengths] for d in depths]
    fig = Figure(figsize=(max(4.5, 1.2 + 0.9 * len(lengths)), 1.5 + 0.35 * len(depths)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [format(d, "g") for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (%)")
    ax.set_title(title, fontsize=8)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if not math.isnan(v):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
