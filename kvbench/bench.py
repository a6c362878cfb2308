"""`kvbench-bench`: prefill/decode speed, eviction cost and memory of the policies, side by side with HF's own loop.

Two kinds of model:
- `--model NAME|DIR`: a real model (a conf/model preset such as `smollm2-135m`, or a local HF directory) with its
  own weights and tokenizer; the prompt is kvbench's built-in filler prose, tokenized;
- otherwise a random-weight model with real attention geometry (default: Llama-3.2-3B's head_dim 128 and 24/8 GQA
  heads in two small layers, `TINY_ARCHS["tiny-llama3"]`, or `--config` for any architecture nobody ships) and a
  random prompt: speed and memory do not depend on what the weights say.
Every (policy, budget, prompt length) configuration runs `runner.generate` on the same prompt, configurations are
interleaved inside one process round after round (machine drift hits all of them alike) and each number is the
median over rounds.

Two baselines are always measured with the policies asked for:
- `full`: one forward over the whole prompt, no eviction (the plain model);
- `streamingllm`: the same block loop as every evicting policy with the cheapest eviction there is (keep the
  sinks and the most recent tokens; its score is the slot positions), i.e. the cost floor of block processing.
- `hf` (side by side with HF, the default with `--model`): two rows that run HF's own loop on the same model object
  outside kvbench (a plain `DynamicCache`, HF's sdpa attention, the same greedy hand loop as `runner.generate`):
  `hf-forward` = one forward over the whole prompt, then decoding at that cache size; `hf-decode` = a forward over
  the first N prompt tokens, then decoding at cache size N, the size every evicting policy decodes at.
So `evict_share` (eviction time / total run time), `vs_floor` (prefill time / the floor's - 1), `vs_hf_forward`,
`decode_vs_hf` and `kv_vs_full` (peak KV bytes / full's) are ratios between configurations of the same run, and
`goals()` turns them into the pass/fail lines of issue 14 (eviction share, decode vs HF, prefill vs HF, slowest
policy vs KeyDiff, flat memory).

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
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

FLOOR = "streamingllm"
FULL = "full"
HF_FORWARD = "hf-forward"  # HF's loop: one forward over the whole prompt, then greedy decoding at that cache size
HF_DECODE = "hf-decode"  # HF's loop: a forward over N prompt tokens, then greedy decoding at cache size N
HF = "hf"  # --baselines name for both HF rows
BASELINES = (FULL, FLOOR, HF)
DEFAULT_POLICIES = ("keydiff", "h2o", "tova", "snapkv")
ROW_FIELDS = ("policy", "prompt_tokens", "budget", "block", "prefill_s", "prefill_tokens_per_s",
              "decode_tokens_per_s", "decode_ms_per_token", "evict_s", "evict_prefill_s", "evict_decode_s",
              "total_s", "peak_kv_tokens", "kv_bytes_peak", "peak_rss_mib")
# Issue 14's goals (point 3). Eviction share of the whole run (prefill + decode): key-only and trivial scores get
# 5 %, policies that score with attention, hashes or two stages 12 %.
LIGHT_POLICIES = ("keydiff", "knorm", "streamingllm", "random")
EVICT_SHARE_LIGHT, EVICT_SHARE_OTHER = 0.05, 0.12
DECODE_VS_HF = 1.15  # decode per token with eviction every step / HF's plain decode at cache size N
PREFILL_VS_HF = 1.0  # block-wise prefill / HF's single full forward, at prompts of PREFILL_GOAL_TOKENS and more
PREFILL_GOAL_TOKENS = 8000
VS_KEYDIFF = 1.5  # end-to-end time of any policy / KeyDiff's, same N and B
FLAT_SLACK_MIB = 16.0  # peak RSS growth from the shortest to the longest prompt allowed beyond the KV bytes' growth
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


def load_real_model(name: str, dtype: str | None = None, device: str = "cpu") -> tuple[Any, Any, str]:
    """A model with its own weights: a conf/model preset name (`smollm2-135m`, a hub id preset, ...) or a local HF
    directory. Returns (model with the kvbench attention installed, tokenizer, a short description)."""
    from kvbench.attention import install
    from kvbench.config import CONF_DIR, load_group
    from kvbench.models import DTYPES, ModelError, load_model

    if "/" not in name and (CONF_DIR / "model" / f"{name}.yaml").is_file():
        spec = load_group("model", name)
    elif Path(name).is_dir():
        spec = {"name": "hf", "path": name}
    else:
        raise BenchError(f"unknown model '{name}': neither a conf/model preset nor a model directory")
    if dtype is not None and (dtype not in DTYPES or dtype == "auto"):
        raise BenchError(f"unknown dtype '{dtype}'; choose one of: float32, bfloat16, float16")
    try:
        loaded = load_model(name=str(spec.get("name", name)), path=str(spec["path"]),
                            dtype=dtype or str(spec.get("dtype") or "auto"), revision=spec.get("revision"),
                            attn_implementation=str(spec.get("attn_implementation", "sdpa")), device=device)
    except ModelError as e:
        raise BenchError(str(e)) from None
    model = loaded.model
    install(model)
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    desc = (f"{loaded.name} (real weights): {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, head_dim {head_dim}, "
            f"{str(model.dtype).replace('torch.', '')}")
    return model, loaded.tokenizer, desc


def prompt_ids(n: int, vocab: int, tokenizer: Any = None, seed: int = 0) -> list[int]:
    """`n` prompt token ids: built-in filler prose through `tokenizer` (real models), else uniform random ids."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed * 7919 + n)
        return torch.randint(2, vocab, (n,), generator=g).tolist()
    from kvbench.tasks.haystack import filler_text

    words = n
    while True:  # English prose is ~1.3 tokens per word; grow until the text is long enough
        ids = list(tokenizer(filler_text(words, seed), add_special_tokens=False)["input_ids"])
        if len(ids) >= n:
            return ids[:n]
        words *= 2


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


def all_policies() -> list[str]:
    """Every single policy in conf/policy/ (run modes such as `compare` and the no-eviction `full` left out)."""
    from kvbench.config import group_choices, load_group

    return [n for n in group_choices("policy") if n != FULL and "_target_" in load_group("policy", n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@torch.inference_mode()
def hf_generate(model: Any, ids: list[int], new_tokens: int,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """HF's own loop, no kvbench: one forward over `ids` into a plain `DynamicCache` (logits of the last token only,
    as HF's `generate` asks), then greedy decoding with the same hand loop as `runner.generate` (`new_tokens - 1`
    one-token forwards). The kvbench attention wrapper passes straight through to HF's sdpa outside a kvbench run."""
    from transformers import DynamicCache

    device = model.device
    cache = DynamicCache(config=model.config)
    _sync(device)
    t0 = clock()
    out = model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    _sync(device)
    prefill_s = clock() - t0
    logits = out.logits[:, -1].float()
    tokens, steps = [], 0
    t0 = clock()
    while True:
        tok = int(logits.argmax(dim=-1))
        tokens.append(tok)
        if len(tokens) >= new_tokens:
            break
        out = model(input_ids=torch.tensor([[tok]], device=device), past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1].float()
        steps += 1
    _sync(device)
    decode_s = clock() - t0
    kv = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
             for layer in cache.layers)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": steps, "tokens": tokens,
            "evict_prefill_s": 0.0, "evict_decode_s": 0.0, "peak_kv_tokens": cache.get_seq_length(),
            "kv_bytes_peak": kv}


def measure(model: Any, cfg: Config, new_tokens: int, mem: PeakMemory, seed: int = 0,
            prompt: Sequence[int] | None = None, clock: str = "wall") -> dict[str, Any]:
    """One call of configuration `cfg` on `prompt` (default: a random prompt); raw numbers for one round, timed by
    `clock` (CLOCKS: wall time, or the process's CPU time)."""
    from kvbench.runner import generate

    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = list(prompt[:cfg.prompt_tokens]) if prompt is not None else prompt_ids(cfg.prompt_tokens, vocab, seed=seed)
    if cfg.policy in (HF_FORWARD, HF_DECODE):
        rss0 = mem.start()
        c0, w0 = time.process_time(), time.perf_counter()
        m = hf_generate(model, ids, new_tokens, CLOCKS[clock])
    else:
        policy = _make_policy(cfg.policy, cfg.budget, seed)
        policy.start_sample(seed)
        rss0 = mem.start()
        c0, w0 = time.process_time(), time.perf_counter()
        res = generate(model, policy, ids, cfg.block, new_tokens, stop_ids=(), clock=CLOCKS[clock])
        m = {"prefill_s": res.prefill_s, "decode_s": res.decode_s, "decode_steps": res.decode_steps,
             "tokens": res.tokens, "evict_prefill_s": res.evict_prefill_s, "evict_decode_s": res.evict_decode_s,
             "peak_kv_tokens": res.peak_kv_tokens, "kv_bytes_peak": res.kv_bytes_peak}
    m["cpu_per_wall"] = (time.process_time() - c0) / max(time.perf_counter() - w0, 1e-9)
    m.update(peak_rss_mib=mem.rss_peak_mib(), rss_start_mib=rss0, peak_gpu_mib=mem.gpu_peak_mib())
    return m


def configurations(policies: Sequence[str], budgets: Sequence[int], lengths: Sequence[int], block: int,
                   baselines: Sequence[str] = (FULL, FLOOR), full_max_tokens: int | None = None) -> list[Config]:
    """Every (policy, budget) at every length, with the baselines added: full and hf-forward once per length (up
    to `full_max_tokens`: their attention is quadratic), the floor at every budget, hf-decode once per budget (its
    prompt is the first N tokens: decoding at cache size N does not depend on the prompt length)."""
    names = [b for b in (FULL, FLOOR) if b in baselines or b in policies]
    names += [p for p in policies if p not in (FULL, FLOOR)]
    out = []
    if HF in baselines:
        out.extend(Config(HF_DECODE, b, None, b) for b in budgets)
    for n in lengths:
        if HF in baselines and (full_max_tokens is None or n <= full_max_tokens):
            out.append(Config(HF_FORWARD, None, None, n))
        for name in names:
            if name == FULL:
                if full_max_tokens is None or n <= full_max_tokens:
                    out.append(Config(FULL, None, None, n))
            else:
                out.extend(Config(name, b, block, n) for b in budgets)
    return out


def run_bench(model: Any, configs: Sequence[Config], new_tokens: int, repeats: int, seed: int = 0,
              model_desc: str = "", log: Callable[[str], None] | None = None,
              prompt: Sequence[int] | None = None, clock: str = "wall") -> list[dict[str, Any]]:
    """Measure every configuration `repeats` times, interleaved (round r runs them all, in an order rotated by r),
    after one unmeasured warm-up call per policy; returns one row per configuration with medians. `prompt`: the
    token ids every configuration reads its first `prompt_tokens` from (default: random ids per length)."""
    mem = PeakMemory(model.device)
    for name in dict.fromkeys(c.policy for c in configs):  # warm-up: kernels, thread pools, allocator
        c = next(c for c in configs if c.policy == name)
        warm = min(c.prompt_tokens, (c.budget or 0) + 2 * (c.block or 64))
        measure(model, Config(c.policy, c.budget, c.block, warm), min(new_tokens, 2), mem, seed, prompt, clock)
    raw: dict[Config, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(repeats):
        k = r % len(configs)
        for c in list(configs[k:]) + list(configs[:k]):
            m = measure(model, c, new_tokens, mem, seed, prompt, clock)
            raw[c].append(m)
            if log:
                log(f"round {r + 1}/{repeats} {c.policy:>12} N={c.budget} B={c.block} T={c.prompt_tokens}: "
                    f"prefill {m['prefill_s']:.3f} s (evict {m['evict_prefill_s']:.3f}), decode {m['decode_s']:.3f} s "
                    f"(evict {m['evict_decode_s']:.3f}), peak RSS {m['peak_rss_mib']:.0f} MiB, "
                    f"cpu/wall {m['cpu_per_wall']:.2f}")
    rows = [{**_row(c, raw[c], model, model_desc, mem.method), "clock": clock} for c in configs]
    _add_ratios(rows)
    return rows


def _row(c: Config, ms: list[dict[str, Any]], model: Any, model_desc: str, rss_method: str) -> dict[str, Any]:
    keys = ("prefill_s", "decode_s", "evict_prefill_s", "evict_decode_s")
    med = {k: statistics.median(m[k] for m in ms) for k in keys}
    # The total and the eviction time are medians of per-round sums: a round's parts belong together.
    total = statistics.median(m["prefill_s"] + m["decode_s"] for m in ms)
    evict = statistics.median(m["evict_prefill_s"] + m["evict_decode_s"] for m in ms)
    steps = ms[0]["decode_steps"]
    gpu = [m["peak_gpu_mib"] for m in ms if m["peak_gpu_mib"] is not None]
    row: dict[str, Any] = {
        "policy": c.policy, "prompt_tokens": c.prompt_tokens, "budget": c.budget, "block": c.block,
        "prefill_s": round(med["prefill_s"], 6),
        "prefill_tokens_per_s": round(c.prompt_tokens / med["prefill_s"], 1),
        "decode_s": round(med["decode_s"], 6),
        "decode_tokens_per_s": round(steps / med["decode_s"], 2) if steps and med["decode_s"] else None,
        "decode_ms_per_token": round(1000 * med["decode_s"] / steps, 3) if steps else None,
        "evict_s": round(evict, 6),
        "evict_prefill_s": round(med["evict_prefill_s"], 6),
        "evict_decode_s": round(med["evict_decode_s"], 6),
        "total_s": round(total, 6),
        # deterministic across rounds; max() guards against a round that differs
        "peak_kv_tokens": max(m["peak_kv_tokens"] for m in ms),
        "kv_bytes_peak": max(m["kv_bytes_peak"] for m in ms),
        "peak_rss_mib": round(max(m["peak_rss_mib"] for m in ms), 1),
        "rss_start_mib": round(statistics.median(m["rss_start_mib"] for m in ms), 1)
        if all(m["rss_start_mib"] is not None for m in ms) else None,
        "peak_gpu_mib": round(max(gpu), 1) if gpu else None,
        "evict_share": round(evict / total, 4),
        "prefill_evict_share": round(statistics.median(m["evict_prefill_s"] / m["prefill_s"] for m in ms), 4),
        "prefill_s_rounds": [round(m["prefill_s"], 6) for m in ms],
        "decode_s_rounds": [round(m["decode_s"], 6) for m in ms],
        "cpu_per_wall": round(statistics.median(m["cpu_per_wall"] for m in ms), 3),
        "first_tokens": ms[0]["tokens"][:8],
        "repeats": len(ms), "decode_steps": steps, "device": str(model.device), "model": model_desc,
        "rss_method": rss_method,
    }
    return row


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """vs_floor: prefill time over the floor's (same length, budget) - 1; policy_share: the part of the prefill
    not spent in bare block processing (the floor's prefill minus its eviction); kv_vs_full: KV bytes over full's;
    vs_hf_forward: prefill time over HF's one forward (same length); decode_vs_hf: decode time per token over HF's
    at cache size N (same budget); vs_keydiff: total time over KeyDiff's (same length, budget)."""
    floor = {(r["prompt_tokens"], r["budget"]): r for r in rows if r["policy"] == FLOOR}
    full = {r["prompt_tokens"]: r for r in rows if r["policy"] == FULL}
    hf_fwd = {r["prompt_tokens"]: r for r in rows if r["policy"] == HF_FORWARD}
    hf_dec = {r["budget"]: r for r in rows if r["policy"] == HF_DECODE}
    keydiff = {(r["prompt_tokens"], r["budget"]): r for r in rows if r["policy"] == "keydiff"}
    for r in rows:
        evicting = r["policy"] not in (FULL, HF_FORWARD, HF_DECODE)
        f = floor.get((r["prompt_tokens"], r["budget"]))
        r["vs_floor"] = round(r["prefill_s"] / f["prefill_s"] - 1, 4) if f and evicting else None
        r["policy_share"] = (round(1 - (f["prefill_s"] - f["evict_prefill_s"]) / r["prefill_s"], 4)
                             if f and evicting else None)
        fu = full.get(r["prompt_tokens"])
        r["kv_vs_full"] = round(r["kv_bytes_peak"] / fu["kv_bytes_peak"], 4) if fu else None
        h = hf_fwd.get(r["prompt_tokens"])
        r["vs_hf_forward"] = round(r["prefill_s"] / h["prefill_s"], 4) if h and evicting else None
        d = hf_dec.get(r["budget"])
        r["decode_vs_hf"] = (round(r["decode_ms_per_token"] / d["decode_ms_per_token"], 4)
                             if d and evicting and r["decode_ms_per_token"] and d["decode_ms_per_token"] else None)
        kd = keydiff.get((r["prompt_tokens"], r["budget"]))
        r["vs_keydiff"] = round(r["total_s"] / kd["total_s"], 4) if kd and evicting else None


# ---------------------------------------------------------------------------------------------------------------
# Issue 14's goals as pass/fail lines.

def goals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (goal, policy): {"goal", "policy", "passed", "detail"}; goals whose rows are missing are left
    out. All are ratios between rows of the same interleaved run."""
    out: list[dict[str, Any]] = []
    pol = [r for r in rows if r["policy"] not in (FULL, HF_FORWARD, HF_DECODE)]
    names = list(dict.fromkeys(r["policy"] for r in pol))

    def add(goal: str, name: str, checks: list[tuple[bool, str]]) -> None:
        if checks:
            out.append({"goal": goal, "policy": name, "passed": all(ok for ok, _ in checks),
                        "detail": ", ".join(d for _, d in checks)})

    for name in names:
        mine = [r for r in pol if r["policy"] == name]
        limit = EVICT_SHARE_LIGHT if name in LIGHT_POLICIES else EVICT_SHARE_OTHER
        add(f"eviction <= {100 * limit:.0f} % of the run", name,
            [(r["evict_share"] <= limit, f"{r['prompt_tokens']}: {100 * r['evict_share']:.1f} %") for r in mine])
        add(f"decode per token <= {DECODE_VS_HF:.2f}x HF's at cache size N", name,
            [(r["decode_vs_hf"] <= DECODE_VS_HF, f"{r['prompt_tokens']}: {r['decode_vs_hf']:.2f}x") for r in mine
             if r.get("decode_vs_hf") is not None])
        add(f"prefill <= {PREFILL_VS_HF:.1f}x HF's one forward at >= {PREFILL_GOAL_TOKENS} tokens", name,
            [(r["vs_hf_forward"] <= PREFILL_VS_HF, f"{r['prompt_tokens']}: {r['vs_hf_forward']:.2f}x") for r in mine
             if r.get("vs_hf_forward") is not None and r["prompt_tokens"] >= PREFILL_GOAL_TOKENS])
        add(f"end to end <= {VS_KEYDIFF:.1f}x KeyDiff's", name,
            [(r["vs_keydiff"] <= VS_KEYDIFF, f"{r['prompt_tokens']}: {r['vs_keydiff']:.2f}x") for r in mine
             if r.get("vs_keydiff") is not None and name != "keydiff"])
        by_budget: dict[Any, list[dict[str, Any]]] = {}
        for r in mine:
            by_budget.setdefault(r["budget"], []).append(r)
        flat = []
        for rs in by_budget.values():
            if len(rs) < 2 or any(r["rss_start_mib"] is None for r in rs):
                continue
            lo, hi = min(rs, key=lambda r: r["prompt_tokens"]), max(rs, key=lambda r: r["prompt_tokens"])
            grow = (hi["peak_rss_mib"] - hi["rss_start_mib"]) - (lo["peak_rss_mib"] - lo["rss_start_mib"])
            kv_grow = (hi["kv_bytes_peak"] - lo["kv_bytes_peak"]) / 2**20  # layers a policy leaves unbounded
            flat.append((grow <= kv_grow + FLAT_SLACK_MIB,
                         f"{lo['prompt_tokens']}->{hi['prompt_tokens']}: {grow:+.0f} MiB (KV {kv_grow:+.0f} MiB)"))
        add(f"peak memory flat (growth <= KV growth + {FLAT_SLACK_MIB:.0f} MiB)", name, flat)
    return out


def goal_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    """PASS/FAIL lines grouped by goal (in issue 14's order), policies in run order within a goal."""
    rank = {k: i for i, k in enumerate(("eviction", "decode", "prefill", "end", "peak"))}
    ordered = sorted(results, key=lambda g: rank.get(g["goal"].split(" ")[0], len(rank)))  # stable: run order kept
    return [f"{'PASS' if g['passed'] else 'FAIL'}  {g['goal']}: {g['policy']} ({g['detail']})" for g in ordered]


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    from tabulate import tabulate

    def pct(v: float | None) -> str:
        return "" if v is None else f"{100 * v:+.1f} %" if v < 0 else f"{100 * v:.1f} %"

    def x(v: float | None) -> str:
        return "" if v is None else f"{v:.2f}x"

    head = ["policy", "prompt", "N", "B", "prefill s", "vs HF fwd", "decode ms/tok", "vs HF dec", "evict s (pre+dec)",
            "evict %", "total s", "vs keydiff", "vs floor", "peak KV tok", "KV MiB", "peak RSS MiB"]
    body = []
    for r in rows:
        hf = r["policy"] in (HF_FORWARD, HF_DECODE)
        body.append([r["policy"], r["prompt_tokens"], r["budget"] if r["budget"] is not None else "-",
                     r["block"] if r["block"] is not None else "all", f"{r['prefill_s']:.3f}",
                     x(r.get("vs_hf_forward")),
                     "" if r["decode_ms_per_token"] is None else f"{r['decode_ms_per_token']:.1f}",
                     x(r.get("decode_vs_hf")),
                     "" if hf or r["policy"] == FULL else f"{r['evict_prefill_s']:.3f}+{r['evict_decode_s']:.3f}",
                     "" if hf or r["policy"] == FULL else pct(r["evict_share"]), f"{r['total_s']:.3f}",
                     x(r.get("vs_keydiff")),
                     pct(r["vs_floor"]) if r["policy"] not in (FULL, FLOOR) and not hf else "", r["peak_kv_tokens"],
                     f"{r['kv_bytes_peak'] / 2**20:.1f}", f"{r['peak_rss_mib']:.0f}"])
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
    p.add_argument("--model", default=None,
                   help="a real model: conf/model preset name (e.g. smollm2-135m) or a local HF directory; its own "
                        "weights, tokenizer and a filler-prose prompt (default: a random-weight --arch/--config)")
    p.add_argument("--arch", default="tiny-llama3", help="built-in tiny architecture (kvbench.models.TINY_ARCHS)")
    p.add_argument("--config", default=None,
                   help="take the architecture from an HF config.json / model directory / hub id / conf/model preset")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: the architecture's)")
    p.add_argument("--lengths", type=_int_list, default=None, help="prompt lengths, e.g. 2k,8k,32k")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated conf/policy names, or 'all' (default: {','.join(DEFAULT_POLICIES)}); "
                        f"the baselines (--baselines) are added")
    p.add_argument("--baselines", default=None,
                   help=f"baselines added to the policies, comma-separated from {', '.join(BASELINES)}, or none "
                        f"(default: {FULL},{FLOOR}; with --model: {HF},{FLOOR}). {HF} = the hf-forward and hf-decode "
                        f"rows (HF's own loop, side by side)")
    p.add_argument("--full-max-tokens", type=lambda v: _int_list(v)[0], default=None,
                   help="run the full and hf-forward baselines only up to this prompt length (quadratic forwards)")
    p.add_argument("--budgets", type=_int_list, default=None, help="budgets N, e.g. 512,1024")
    p.add_argument("--block", type=int, default=None, help="block size B")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens decoded per configuration")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds; medians are reported")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--dtype", default=None,
                   help="float32 (default on CPU; with --model: the preset's) | bfloat16 (default on CUDA) | float16")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's; 1 with --quick)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="what the times measure: wall (default) or the process's CPU time (on a shared machine, with "
                        "--threads 1: robust to other processes' load; with more threads it sums them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench.json", help="rows and goals as JSON")
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
    if a.model is not None and a.config is not None:
        p.error("--model (real weights) and --config (random weights) exclude each other")
    if a.baselines is None:
        a.baselines = f"{HF},{FLOOR}" if a.model else f"{FULL},{FLOOR}"
    baselines = [] if a.baselines.strip() == "none" else [s.strip() for s in a.baselines.split(",") if s.strip()]
    if any(b not in BASELINES for b in baselines):
        p.error(f"--baselines takes {', '.join(BASELINES)} (comma-separated) or none, got '{a.baselines}'")
    a.baselines = baselines
    a.command = "kvbench-bench " + " ".join(shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
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
    log = None if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        if policies == ["all"]:
            policies = all_policies()
        for name in policies:  # fail on bad names and budgets before anything is built
            for b in budgets:
                _make_policy(name, b, a.seed)
        prompt = None
        if a.model is not None:
            model, tokenizer, desc = load_real_model(a.model, a.dtype, str(device))
            prompt = prompt_ids(max(lengths + budgets), 0, tokenizer, a.seed)
        else:
            dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
            model, desc = build_model(a.arch, a.config, a.layers, dtype, str(device), a.seed)
        if log:
            log(f"kvbench-bench: {desc} on {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
        t0 = time.perf_counter()
        rows = run_bench(model, configurations(policies, budgets, lengths, block, a.baselines, a.full_max_tokens),
                         new_tokens, repeats, a.seed, desc, log, prompt, a.clock)
    except (BenchError, PolicyError) as e:
        print(f"kvbench-bench: error: {e}", file=sys.stderr)
        return 2
    results = goals(rows)
    lines = goal_lines(results)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "goals": results}, indent=1) + "\n", encoding="utf-8")
    table = markdown_table(rows)
    md = Path(a.markdown) if a.markdown else out.with_suffix(".md")
    md.write_text(f"{desc} on {device} ({platform.processor() or platform.machine()}, torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads); {a.clock} clock, medians of {repeats} interleaved rounds, "
                  f"{new_tokens} new tokens.\n\nCommand: `{a.command}`" +
                  f"\n\n{table}\n" + ("\n## Goals (issue 14)\n\n" + "\n".join(f"- {ln}" for ln in lines) + "\n"
                                      if lines else ""), encoding="utf-8")
    print(table)
    for ln in lines:
        print(ln)
    if log:
        log(f"kvbench-bench: {len(rows)} configurations in {time.perf_counter() - t0:.0f} s -> {out}, {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
