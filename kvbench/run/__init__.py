"""The run layer: settings parsed once (settings), the Hydra side (config), run assembly and run directories (app),
the per-task loop (loop), names of runs (labels) and `kvbench-score` (score)."""
