"""Paper-shaped result tables from run directories (`kvbench-report DIR`), and the table `kvbench` prints.

Every directory below DIR that holds a `metrics.json` is one run. Runs whose configurations differ only in
`shard` are merged into one entry: their predictions are put back in sample order (shard i holds samples
i, i+n, i+2n, ...) and the scores are recomputed from the merged records by the recipe in metrics.json `layout`,
through kvbench.metrics.aggregate, the function the task aggregated the run with (runs without a recipe: the scores
metrics.json `composition` traces to samples are the records' means, any other the sample-weighted mean of the
shards' values, with a note). No task is ever built: the report imports nothing from kvbench.tasks. Speed and
memory are recomputed from the merged records by `run.records.summarize`.

Tables (KeyDiff Table 1 and HashEvict Tables 1-2 shape):
- scores: one row per (model, policy, budget, block, protocol, any other setting that varies), grouped by model
  with the full-cache row first; block and protocol are always shown ("-" where they do not apply: the block
  under a prefill_once* protocol, both for the full cache), so two protocols never share a table unlabelled;
  one column per score in the order and under the categories of the tasks' metrics.json `layout` (LongBench
  dataset categories, NIAH context lengths, else the task), then `Avg` (the mean of the row's task averages). Scores are printed as
  stored (0-100).
- summary scores: the tasks' own summary numbers (LongBench category means, RULER per-length means, ...).
- speed and memory: prefill/decode tokens/s, eviction time, peak KV tokens and bytes, compression ratio.
- provenance: code and library versions, models, task data sources and checksums, metric backends (notes).
With per-sample data every score cell is `mean ± se` with its n, a `degenerate` column counts collapsed outputs,
"Against the full cache" gives token agreement and the graded score, and "Paired comparisons" the paired
differences (95 % bootstrap interval, exact McNemar or sign-flip p) of runs on the same samples.
Files: DIR/table.md, DIR/table.csv (scores, with `_se` / `_n`), DIR/runs.csv (one line per entry: stats,
diagnostics (mean and max), provenance, run dirs), DIR/paired.csv, and when there is something to draw,
DIR/heatmap_<task>_<model>.png and DIR/score_vs_budget.png (95 % error bars).

Modules: collect (runs, entries, shard merge), layout (metrics.json `layout`), samples (composition, records: se, strata, agreement), tables (rows and columns), paired (paired.csv),
output (markdown, CSV), plots, cli (`report`, the printed table, `main`); family (a design's planned comparisons,
`--design`) and the analyses beside a folder's tables: budgets (`--budget-choice`), plan (`--plan`), claims
(`--claims`, `--beside`), validity (`--graded-validity`). The numbers come from
kvbench.metrics.stats and kvbench.metrics.aggregate.
"""
