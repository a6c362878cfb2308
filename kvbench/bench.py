"""`kvbench-bench`: prefill/decode speed, eviction cost and memory of the policies on a random-weight model.

The model has real attention geometry (default: Llama-3.2-3B's head_dim 128 and 24/8 GQA heads in two small layers,
`TINY_ARCHS["tiny-llama3"]`) and random weights: speed and memory do not depend on what the weights say. Every
(policy, budget, prompt length) configuration runs `runner.generate` on a random prompt, configurations are
interleaved inside one process round after round (machine drift hits all of them alike) and each number is the
median over rounds.

Two baselines are always measured with the policies asked for:
- `full`: one forward over the whole prompt, no eviction (the plain model);
- `streamingllm`: the same block loop as every evicting policy with the cheapest eviction there is (keep the
  sinks and the most recent tokens; its score is the slot positions), i.e. the cost floor of block processing.
So `evict_share` (eviction time / prefill time), `vs_floor` (prefill time / the floor's - 1) and `kv_vs_full`
(peak KV bytes / full's) are ratios between configurations of the same run.

Peak RSS per configuration (Linux): before each measured call the process returns freed heap memory to the OS
(`malloc_trim(0)`) and resets its resident-set high-water mark by writing 5 to /proc/self/clear_refs; VmHWM from
/proc/self/status after the call is that configuration's peak. Without a resettable high-water mark (not Linux) the
column is the process's lifetime peak (`getrusage`), marked in `rss_method`. On CUDA, `peak_gpu_mib` is
`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`; `runner.generate` synchronises around its timers.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

FLOOR = "streamingllm"
FULL = "full"
DEFAULT_POLICIES = ("keydiff", "h2o", "tova", "snapkv")
ROW_FIELDS = ("policy", "prompt_tokens", "budget", "block", "prefill_s", "prefill_tokens_per_s",
              "decode_tokens_per_s", "evict_s", "peak_kv_tokens", "kv_bytes_peak", "peak_rss_mib")
# --quick runs single-threaded unless told otherwise: on a shared CI machine a second torch thread that is not
# scheduled stalls every parallel operator (see docs/bench.md); one thread takes ~75 CPU-seconds for this run.
QUICK = {"lengths": [512, 1024, 2048], "budgets": [256], "block": 64, "new_tokens": 8, "repeats": 3,
         "policies": ["keydiff"], "threads": 1}
FULL_RUN = {"lengths": [2048, 8192, 32768], "budgets": [1024], "block": 128, "new_tokens": 16, "repeats": 3,
            "policies": list(DEFAULT_POLICIES), "threads": None}


class BenchError(ValueError):
    """Bad bench input (unknown policy or architecture, unreadable config); printed as one line."""


# ---------------------------------------------------------------------------------------------------------------
# Peak memory of one measured call.

class PeakMemory:
    """Peak resident set (MiB) of the next measured call, and peak CUDA memory when the model is on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        libc = ctypes.util.find_library("c")
        self._libc = ctypes.CDLL(libc) if libc else None
        self.method = "vmhwm_reset" if self._can_reset() else "lifetime_maxrss"

    @staticmethod
    def _can_reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _status_kib("VmHWM") is not None
        except OSError:
            return False

    def start(self) -> float | None:
        """Release freed memory, reset the high-water marks; returns the resident set (MiB) the call starts from."""
        gc.collect()
        if self._libc is not None and hasattr(self._libc, "malloc_trim"):
            self._libc.malloc_trim(0)  # freed heap of earlier configurations would otherwise count as resident
        if self.method == "vmhwm_reset":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        rss = _status_kib("VmRSS")
        return rss / 1024 if rss is not None else None

    def rss_peak_mib(self) -> float:
        if self.method == "vmhwm_reset":
            return _status_kib("VmHWM") / 1024  # type: ignore[operator]
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux

    def gpu_peak_mib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device) / 2**20


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------------------------------------------
# Model.

def build_model(arch: str = "tiny-llama3", config: str | None = None, layers: int | None = None,
                dtype: str = "float32", device: str = "cpu", seed: int = 0) -> tuple[Any, str]:
    """A random-weight causal LM with the attention geometry of `arch` (a built-in tiny architecture) or of
    `config` (an HF config.json, a model directory, a hub id, or a conf/model preset name); `layers` overrides the
    number of layers. Returns (model on `device` with the kvbench attention installed, a short description)."""
    from kvbench.attention import install
    from kvbench.models import DTYPES, TINY_ARCHS, build_tiny_model, resolve_device

    if dtype not in DTYPES or dtype == "auto":
        raise BenchError(f"unknown dtype '{dtype}'; choose one of: float32, bfloat16, float16")
    torch_dtype = DTYPES[dtype]
    over: dict[str, Any] = {"num_hidden_layers": layers} if layers else {}
    if config is not None:
        tiny = _preset_builtin(config)
        if tiny is not None:
            arch, config = tiny, None
    if config is None:
        if arch not in TINY_ARCHS:
            raise BenchError(f"unknown architecture '{arch}'; choose one of: {', '.join(sorted(TINY_ARCHS))}")
        model, _ = build_tiny_model(arch, seed=seed, dtype=torch_dtype, **over)
        name = arch
    else:
        model, name = _model_from_config(config, layers, torch_dtype, seed)
    model.to(resolve_device(device)).eval()
    install(model)
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    desc = (f"{name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads}/"
            f"{cfg.num_key_value_heads} heads, head_dim {head_dim}, {dtype}")
    return model, desc


def _preset_builtin(config: str) -> str | None:
    """The tiny architecture a conf/model preset names (`path: builtin:<arch>`), or None."""
    from kvbench.config import CONF_DIR

    preset = CONF_DIR / "model" / f"{config}.yaml"
    if "/" in config or not preset.is_file():
        return None
    for line in preset.read_text().splitlines():
        if line.startswith("path:") and "builtin:" in line:
            return line.split("builtin:", 1)[1].split("#")[0].strip()
    return None


def _model_from_config(config: str, layers: int | None, dtype: torch.dtype, seed: int) -> tuple[Any, str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvbench.config import CONF_DIR

    src = config
    preset = CONF_DIR / "model" / f"{config}.yaml"
    if "/" not in config and preset.is_file():  # a preset: its path is a hub id or a local directory
        for line in preset.read_text().splitlines():
            if line.startswith("path:"):
                src = line.split(":", 1)[1].split("#")[0].strip()
    p = Path(src)
    try:
        cfg = AutoConfig.from_pretrained(str(p.parent if p.is_file() else src))
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BenchError(f"cannot read model config '{config}': {first}") from None
    text = cfg.get_text_config(decoder=True)
    if layers:
        text.num_hidden_layers = layers
        if isinstance(getattr(text, "layer_types", None), list):
            text.layer_types = text.layer_types[:layers]
    # Random prompts need no real vocabulary; a 128k-entry embedding would only add memory that is not the cache's.
    text.vocab_size = 1024
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(text, k, None), int) and getattr(text, k) >= 1024:
            setattr(text, k, 1)
    text.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(text, dtype=dtype, attn_implementation="sdpa")
    return model, src


# ---------------------------------------------------------------------------------------------------------------
# One configuration, measured.

@dataclass(frozen=True)
class Config:
    policy: str
    budget: int | None  # None for full
    block: int | None  # None for full (single-pass prefill)
    prompt_tokens: int


class _EvictTimer:
    """Times a policy's evictions, split into prefill and decode: `generate` calls `on_logits` for the first time
    right after the last prefill block's eviction, which is where the split is."""

    def __init__(self, policy: Any, device: torch.device) -> None:
        self.prefill_s = 0.0
        self.decoding = False
        inner = policy.evict

        def evict(layer: Any, *args: Any, **kwargs: Any) -> bool:
            if self.decoding:
                return inner(layer, *args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = inner(layer, *args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.prefill_s += time.perf_counter() - t0
            return out

        policy.evict = evict  # this instance only, built for this one measurement

    def on_logits(self, logits: torch.Tensor) -> None:
        self.decoding = True


def _make_policy(name: str, budget: int | None, seed: int) -> Any:
    from kvbench.app import build_policy
    from kvbench.config import load_group

    try:
        spec = load_group("policy", name)
    except ValueError as e:
        raise BenchError(str(e)) from None
    if "_target_" not in spec:
        raise BenchError(f"'{name}' is not a single policy; name policies from conf/policy/")
    return build_policy(spec, budget if name != FULL else None, seed)


def measure(model: Any, cfg: Config, new_tokens: int, mem: PeakMemory, seed: int = 0) -> dict[str, Any]:
    """One `generate` call of configuration `cfg` on a random prompt; raw numbers for one round."""
    from kvbench.runner import generate

    policy = _make_policy(cfg.policy, cfg.budget, seed)
    policy.start_sample(seed)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator().manual_seed(seed * 7919 + cfg.prompt_tokens)
    ids = torch.randint(2, vocab, (cfg.prompt_tokens,), generator=g).tolist()
    timer = _EvictTimer(policy, model.device)
    rss0 = mem.start()
    res = generate(model, policy, ids, cfg.block, new_tokens, stop_ids=(), on_logits=timer.on_logits)
    return {"prefill_s": res.prefill_s, "decode_s": res.decode_s, "decode_steps": res.decode_steps,
            "evict_s": timer.prefill_s, "peak_kv_tokens": res.peak_kv_tokens, "kv_bytes_peak": res.kv_bytes_peak,
            "peak_rss_mib": mem.rss_peak_mib(), "rss_start_mib": rss0, "peak_gpu_mib": mem.gpu_peak_mib()}


def configurations(policies: Sequence[str], budgets: Sequence[int], lengths: Sequence[int], block: int,
                   baselines: Sequence[str] = (FULL, FLOOR), full_max_tokens: int | None = None) -> list[Config]:
    """Every (policy, budget) at every length, with the baselines added: full once per length (up to
    `full_max_tokens`: its attention is quadratic), the floor at every budget."""
    names = [b for b in (FULL, FLOOR) if b in baselines or b in policies]
    names += [p for p in policies if p not in (FULL, FLOOR)]
    out = []
    for n in lengths:
        for name in names:
            if name == FULL:
                if full_max_tokens is None or n <= full_max_tokens:
                    out.append(Config(FULL, None, None, n))
            else:
                out.extend(Config(name, b, block, n) for b in budgets)
    return out


def run_bench(model: Any, configs: Sequence[Config], new_tokens: int, repeats: int, seed: int = 0,
              model_desc: str = "", log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Measure every configuration `repeats` times, interleaved (round r runs them all, in an order rotated by r),
    after one unmeasured warm-up call per policy; returns one row per configuration with medians."""
    mem = PeakMemory(model.device)
    for name in dict.fromkeys(c.policy for c in configs):  # warm-up: kernels, thread pools, allocator
        c = next(c for c in configs if c.policy == name)
        warm = min(c.prompt_tokens, (c.budget or 0) + 2 * (c.block or 64))
        measure(model, Config(c.policy, c.budget, c.block, warm), min(new_tokens, 2), mem, seed)
    raw: dict[Config, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(repeats):
        k = r % len(configs)
        for c in list(configs[k:]) + list(configs[:k]):
            m = measure(model, c, new_tokens, mem, seed)
            raw[c].append(m)
            if log:
                log(f"round {r + 1}/{repeats} {c.policy:>12} N={c.budget} B={c.block} T={c.prompt_tokens}: "
                    f"prefill {m['prefill_s']:.3f} s, evict {m['evict_s']:.3f} s, peak RSS {m['peak_rss_mib']:.0f} MiB")
    rows = [_row(c, raw[c], model, model_desc, mem.method) for c in configs]
    _add_ratios(rows)
    return rows


def _row(c: Config, ms: list[dict[str, Any]], model: Any, model_desc: str, rss_method: str) -> dict[str, Any]:
    med = {k: statistics.median(m[k] for m in ms) for k in ("prefill_s", "decode_s", "evict_s")}
    steps = ms[0]["decode_steps"]
    gpu = [m["peak_gpu_mib"] for m in ms if m["peak_gpu_mib"] is not None]
    row: dict[str, Any] = {
        "policy": c.policy, "prompt_tokens": c.prompt_tokens, "budget": c.budget, "block": c.block,
        "prefill_s": round(med["prefill_s"], 6),
        "prefill_tokens_per_s": round(c.prompt_tokens / med["prefill_s"], 1),
        "decode_tokens_per_s": round(steps / med["decode_s"], 2) if steps and med["decode_s"] else None,
        "evict_s": round(med["evict_s"], 6),
        # deterministic across rounds; max() guards against a round that differs
        "peak_kv_tokens": max(m["peak_kv_tokens"] for m in ms),
        "kv_bytes_peak": max(m["kv_bytes_peak"] for m in ms),
        "peak_rss_mib": round(max(m["peak_rss_mib"] for m in ms), 1),
        "rss_start_mib": round(statistics.median(m["rss_start_mib"] for m in ms), 1)
        if all(m["rss_start_mib"] is not None for m in ms) else None,
        "peak_gpu_mib": round(max(gpu), 1) if gpu else None,
        "evict_share": round(med["evict_s"] / med["prefill_s"], 4),
        "prefill_s_rounds": [round(m["prefill_s"], 6) for m in ms],
        "repeats": len(ms), "decode_steps": steps, "device": str(model.device), "model": model_desc,
        "rss_method": rss_method,
    }
    return row


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """vs_floor: prefill time over the floor's (same length, budget) - 1; policy_share: the part of the prefill
    not spent in bare block processing (the floor's prefill minus its eviction); kv_vs_full: KV bytes over full's."""
    floor = {(r["prompt_tokens"], r["budget"]): r for r in rows if r["policy"] == FLOOR}
    full = {r["prompt_tokens"]: r for r in rows if r["policy"] == FULL}
    for r in rows:
        f = floor.get((r["prompt_tokens"], r["budget"]))
        r["vs_floor"] = round(r["prefill_s"] / f["prefill_s"] - 1, 4) if f and r["policy"] != FULL else None
        r["policy_share"] = (round(1 - (f["prefill_s"] - f["evict_s"]) / r["prefill_s"], 4)
                             if f and r["policy"] != FULL else None)
        fu = full.get(r["prompt_tokens"])
        r["kv_vs_full"] = round(r["kv_bytes_peak"] / fu["kv_bytes_peak"], 4) if fu else None


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    from tabulate import tabulate

    def pct(v: float | None) -> str:
        return "" if v is None else f"{100 * v:+.1f} %" if v < 0 else f"{100 * v:.1f} %"

    head = ["policy", "prompt", "N", "B", "prefill s", "prefill tok/s", "decode tok/s", "evict s", "evict %",
            "vs floor", "peak KV tok", "KV MiB", "KV vs full", "peak RSS MiB"]
    body = []
    for r in rows:
        body.append([r["policy"], r["prompt_tokens"], r["budget"] if r["budget"] is not None else "-",
                     r["block"] if r["block"] is not None else "all", f"{r['prefill_s']:.3f}",
                     f"{r['prefill_tokens_per_s']:.0f}",
                     "" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}",
                     f"{r['evict_s']:.3f}", pct(r["evict_share"]) if r["policy"] != FULL else "",
                     pct(r["vs_floor"]) if r["policy"] not in (FULL, FLOOR) else "", r["peak_kv_tokens"],
                     f"{r['kv_bytes_peak'] / 2**20:.1f}", pct(r["kv_vs_full"]) if r["policy"] != FULL else "",
                     f"{r['peak_rss_mib']:.0f}"])
    return tabulate(body, headers=head, tablefmt="github", disable_numparse=True)


# ---------------------------------------------------------------------------------------------------------------
# Command line.

def _int_list(s: str) -> list[int]:
    try:
        vals = [int(x.lower().replace("k", "")) * (1024 if x.lower().endswith("k") else 1)
                for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (e.g. 2k,8k or 1024), got '{s}'")
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got '{s}'")
    return vals


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbench-bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"CI-sized run: lengths {QUICK['lengths']}, N={QUICK['budgets'][0]}, B={QUICK['block']}, "
                        f"policies {QUICK['policies']} + baselines, {QUICK['repeats']} rounds, 1 thread")
    p.add_argument("--arch", default="tiny-llama3", help="built-in tiny architecture (kvbench.models.TINY_ARCHS)")
    p.add_argument("--config", default=None,
                   help="take the architecture from an HF config.json / model directory / hub id / conf/model preset")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: the architecture's)")
    p.add_argument("--lengths", type=_int_list, default=None, help="prompt lengths, e.g. 2k,8k,32k")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated conf/policy names (default: {','.join(DEFAULT_POLICIES)}); "
                        f"the baselines (--baselines) are added")
    p.add_argument("--baselines", default=f"{FULL},{FLOOR}",
                   help=f"baselines added to the policies: {FULL},{FLOOR} (default), one of them, or none")
    p.add_argument("--full-max-tokens", type=lambda v: _int_list(v)[0], default=None,
                   help="run the full baseline only up to this prompt length (one quadratic forward)")
    p.add_argument("--budgets", type=_int_list, default=None, help="budgets N, e.g. 512,1024")
    p.add_argument("--block", type=int, default=None, help="block size B")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens decoded per configuration")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds; medians are reported")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--dtype", default=None, help="float32 (default on CPU) | bfloat16 (default on CUDA) | float16")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's; 1 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench.json", help="rows as a JSON list")
    p.add_argument("--markdown", default=None, help="markdown table file (default: --out with .md)")
    p.add_argument("--quiet", action="store_true", help="no per-measurement log lines")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    preset = QUICK if a.quick else FULL_RUN
    lengths = a.lengths or preset["lengths"]
    budgets = a.budgets or preset["budgets"]
    block = a.block or preset["block"]
    new_tokens = a.new_tokens if a.new_tokens is not None else preset["new_tokens"]
    repeats = a.repeats or preset["repeats"]
    policies = [s.strip() for s in a.policies.split(",") if s.strip()] if a.policies else preset["policies"]
    if block <= 0 or new_tokens < 1 or repeats < 1:
        p.error("--block, --new-tokens and --repeats must be positive")
    baselines = [] if a.baselines.strip() == "none" else [s.strip() for s in a.baselines.split(",") if s.strip()]
    if any(b not in (FULL, FLOOR) for b in baselines):
        p.error(f"--baselines takes {FULL}, {FLOOR}, both (comma-separated) or none, got '{a.baselines}'")
    a.baselines = baselines
    threads = torch.get_num_threads()
    if a.threads or preset["threads"]:
        torch.set_num_threads(a.threads or preset["threads"])
    try:
        return _main(a, lengths, budgets, block, new_tokens, repeats, policies)
    finally:
        torch.set_num_threads(threads)  # main() is also called in-process (tests)


def _main(a: argparse.Namespace, lengths: list[int], budgets: list[int], block: int, new_tokens: int, repeats: int,
          policies: list[str]) -> int:
    from kvbench.models import resolve_device
    from kvbench.policies.base import PolicyError

    device = resolve_device(a.device)
    dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    log = None if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        for name in policies:  # fail on bad names and budgets before anything is built
            for b in budgets:
                _make_policy(name, b, a.seed)
        model, desc = build_model(a.arch, a.config, a.layers, dtype, str(device), a.seed)
        if log:
            log(f"kvbench-bench: {desc} on {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
        t0 = time.perf_counter()
        rows = run_bench(model, configurations(policies, budgets, lengths, block, a.baselines, a.full_max_tokens),
                         new_tokens,
                         repeats, a.seed, desc, log)
    except (BenchError, PolicyError) as e:
        print(f"kvbench-bench: error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    table = markdown_table(rows)
    md = Path(a.markdown) if a.markdown else out.with_suffix(".md")
    md.write_text(f"{desc} on {device} ({platform.processor() or platform.machine()}, torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads); medians of {repeats} interleaved rounds, "
                  f"{new_tokens} new tokens.\n\n{table}\n", encoding="utf-8")
    print(table)
    if log:
        log(f"kvbench-bench: {len(rows)} configurations in {time.perf_counter() - t0:.0f} s -> {out}, {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
