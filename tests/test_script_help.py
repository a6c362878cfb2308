"""Every result script with an argparse command line prints its --help (argparse formats each option's help with
%-formatting, so a bare "%" in a help text breaks --help, and only --help)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers import load_script

SCRIPTS = ("batch_identity", "engine_ab", "logit_margin", "reproduce", "verdicts")


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_prints_and_exits_0(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        load_script(name).main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")



def test_every_kvbench_name_a_script_imports_exists() -> None:
    """A script that regenerates a committed result imports kvbench inside its functions (after its argument checks),
    where --help never reaches: every `from kvbench... import name` and `import kvbench...` in scripts/*.py must
    resolve against today's package (an engine module renamed under a script broke peer_kvpress.py unseen)."""
    import ast
    import importlib.util

    missing = []
    for path in sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvbench"):
                module = importlib.import_module(node.module)  # type: ignore[arg-type]
                missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)
                            and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            elif isinstance(node, ast.Import):
                missing += [f"{path.name}: {a.name}" for a in node.names
                            if a.name.startswith("kvbench") and importlib.util.find_spec(a.name) is None]
    assert missing == []


def test_engine_ab_verdicts_by_hand() -> None:
    """scripts/engine_ab.py's goal lines: ratios 1, 1, 1 (no spread: the mean decides) PASS against 1.10x; 1.2,
    1.2, 1.2 MISS; 0.9, 1.1, 1.2 (log ratios' mean 0.058, standard error 0.085: t = -0.44 against log 1.1 = 0.095,
    one-sided p 0.35) not resolved, in both measures."""
    ab = load_script("engine_ab")

    def runs(then: list[float], now: list[float]) -> dict:
        return {side: {"prefill_s": v, "decode_ms_per_token": v} for side, v in (("ref", then), ("now", now))}

    result = {"policies": {"same": runs([10.0] * 3, [10.0] * 3), "slower": runs([10.0] * 3, [12.0] * 3),
                           "noisy": runs([10.0] * 3, [9.0, 11.0, 12.0])}}
    got = {(line["policy"], line["measure"]): line["verdict"] for line in ab.lines(result)}
    for measure in ("prefill_s", "decode_ms_per_token"):
        assert got[("same", measure)] == "PASS" and got[("slower", measure)] == "MISS"
        assert got[("noisy", measure)] == "not resolved"


def test_engine_ab_goal_as_a_whole_by_hand() -> None:
    """The goal over every line (intersection-union): two lines at ratios 1.0, 1.01, 0.99 (log mean ~0, well under
    log 1.1, each p < 0.05) are met together; add 0.9, 1.1, 1.2 (one-sided p 0.35, not resolved) and the whole is not
    resolved; add 1.2, 1.2, 1.2 (MISS) and it is not met."""
    ab = load_script("engine_ab")

    def policy(now: list[float]) -> dict:
        return {side: {"prefill_s": v, "decode_ms_per_token": v} for side, v in (("ref", [10.0] * 3), ("now", now))}

    tight = {"a": policy([10.0, 10.1, 9.9])}
    assert ab.overall(ab.lines({"policies": tight})) == "met"
    assert ab.overall(ab.lines({"policies": {**tight, "b": policy([9.0, 11.0, 12.0])}})) == "not resolved"
    assert ab.overall(ab.lines({"policies": {**tight, "c": policy([12.0] * 3)}})) == "not met"


def test_bench_gpu_parts_are_commands_kvbench_bench_takes(tmp_path: Path) -> None:
    """scripts/bench_gpu.sh runs only where a GPU is lent, for minutes that cannot be spent on a typo: each part's
    command (DRY=1) parses, names policies that exist, and writes under OUT; an unknown part is one line, exit 2."""
    from kvbench.bench import cli
    from kvbench.bench.setup import make_policy

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpu.sh"
    done = subprocess.run(["bash", str(script), str(tmp_path / "out"), str(tmp_path)], capture_output=True, text=True,
                          env=dict(os.environ, DRY="1"), check=True)
    commands = [line.split() for line in done.stdout.splitlines()]
    assert [c[-1] for c in commands] == [str(tmp_path / "out" / f"{part}.json")
                                         for part in ("llama3b-16k", "compiled", "batch8", "compiled-attention", "smollm2-4k")]
    for command in commands:
        assert command[:3] == ["python3", "-m", "kvbench.bench"]
        a = cli._parser().parse_args(command[3:])
        assert a.device == "cuda" and a.clock == "wall"
        for name in a.policies.split(","):
            make_policy(name, 1024, 0)
    assert "--compiled" in commands[1] and "--compiled" in commands[3]
    bad = subprocess.run(["bash", str(script), str(tmp_path / "bad"), str(tmp_path), "llama3b"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and not (tmp_path / "bad").exists()
