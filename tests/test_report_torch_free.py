"""kvbench-report needs no torch: it reads committed runs (metrics.json, predictions.jsonl) on a machine where torch
or transformers cannot be imported, and writes the same tables."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Makes torch and transformers unimportable, as on a machine without them, then runs kvbench-report.
BLOCKED = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
from kvbench.report.cli import main
main(sys.argv[1:])
assert not any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules)
"""


def test_the_report_runs_on_committed_runs_without_torch(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    shutil.copytree(ROOT / "results" / "ruler_4k" / "runs", runs)
    r = subprocess.run([sys.executable, "-c", BLOCKED, str(runs), "--out", str(tmp_path / "out"), "-q"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    committed = (ROOT / "results" / "ruler_4k" / "table.csv").read_text()
    assert (tmp_path / "out" / "table.csv").read_text() == committed
