"""One measured configuration and an interleaved run of many: `engine.generate` (or HF's own loop) timed, its
eviction time split into prefill and decode, its peak RSS / GPU memory, medians over rounds.

Peak RSS per configuration (Linux): before each measured call the process returns freed heap memory to the OS
(`malloc_trim(0)`) and resets its resident-set high-water mark by writing 5 to /proc/self/clear_refs; VmHWM from
/proc/self/status after the call is that configuration's peak. Without a resettable high-water mark (not Linux) the
column is the process's lifetime peak (`getrusage`), marked in `rss_method`. On CUDA, `peak_gpu_mib` is
`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`; `generate` synchronises around its timers.

Host syncs per decoding step (`host_syncs_*`, kvbench.bench.syncs): one more, untimed call per (policy, budget,
block), on a prompt just long enough to evict (N + 2B tokens at most), under a counter that sees every op; the count
does not depend on the prompt length once the cache is over budget, and the counter's own overhead stays out of
the timed rounds.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kvbench.bench.goals import add_ratios
from kvbench.bench.hfloop import HFLoop, Lockstep, hf_layer_sizes
from kvbench.bench.setup import FLOOR, FULL, HF, HF_DECODE, HF_FORWARD, BenchError, make_policy, prompt_ids, variant
from kvbench.bench.syncs import count_host_syncs
from kvbench.engine.generate import GenerationSettings, Observer, generate, sync

ROW_FIELDS = ("policy", "prompt_tokens", "budget", "block", "prefill_s", "prefill_tokens_per_s",
              "decode_tokens_per_s", "decode_ms_per_token", "evict_s", "evict_prefill_s", "evict_decode_s",
              "total_s", "peak_kv_tokens", "kv_bytes_peak", "peak_rss_mib", "host_syncs_per_step")
SYNC_TOKENS = 4  # greedy tokens of the sync-counting call: 3 complete decoding steps
HF_REFERENCES = ("beside", "lockstep")  # run_bench's hf_reference: HF's decoding after each call, or between its steps
NO_SYNCS = {"host_syncs_per_step": None, "host_syncs_max_step": None, "host_sync_sites": None}


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


@dataclass(frozen=True)
class Config:
    policy: str
    budget: int | None  # None for full
    block: int | None  # None for full (single-pass prefill)
    prompt_tokens: int


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@torch.inference_mode()
def hf_generate(model: Any, ids: list[int], new_tokens: int, clock: Callable[[], float] = time.perf_counter,
                layer_sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """HF's own loop, no kvbench (`HFLoop`: one forward over `ids` into a plain `DynamicCache`, then greedy decoding
    with the same hand loop as `engine.generate`), timed whole; `layer_sizes`: each layer cut to its latest that many
    tokens after the forward (HF at a policy's per-layer sizes)."""
    device = model.device
    loop = HFLoop(model, ids, new_tokens, layer_sizes)
    sync(device)
    t0 = clock()
    loop.prefill()
    sync(device)
    prefill_s = clock() - t0
    t0 = clock()
    while loop.step():
        pass
    sync(device)
    decode_s = clock() - t0
    peak, nbytes = loop.held()
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": loop.steps, "tokens": loop.tokens,
            "evict_prefill_s": 0.0, "evict_decode_s": 0.0, "peak_kv_tokens": peak, "kv_bytes_peak": nbytes}


def measure(model: Any, cfg: Config, new_tokens: int, mem: PeakMemory, seed: int = 0,
            prompt: Sequence[int] | None = None, clock: str = "wall",
            layer_sizes: Sequence[int] | None = None, lockstep: bool = False) -> dict[str, Any]:
    """One call of configuration `cfg` on `prompt` (default: a random prompt); raw numbers for one round, timed by
    `clock` (CLOCKS: wall time, or the process's CPU time). `layer_sizes`: HF's own loop at those per-layer cache
    sizes (`hf_generate`). A kvbench call's `layer_tokens`: each layer's tokens per KV head at its first decoding
    step (GenerationResult.layer_tokens); a compiled call's `cudagraph_skips`: the CUDA graphs torch skipped during it
    (on CUDA a compiled forward that is not a CUDA graph runs its kernels one launch each). `lockstep` (a kvbench
    configuration with a budget): HF's own decoding one step after each of the call's (`Lockstep`), its numbers as
    `hf_decode_s`, `hf_decode_steps`, `hf_layer_sizes` and `hf_tokens`; the call's peak RSS then includes HF's cache
    and prompt forward."""

    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = list(prompt[:cfg.prompt_tokens]) if prompt is not None else prompt_ids(cfg.prompt_tokens, vocab, seed=seed)
    if cfg.policy in (HF_FORWARD, HF_DECODE):
        rss0 = mem.start()
        c0, w0 = time.process_time(), time.perf_counter()
        m = hf_generate(model, ids, new_tokens, CLOCKS[clock], layer_sizes)
    else:
        policy = make_policy(cfg.policy, cfg.budget, seed)
        policy.start_sample(seed)
        rss0 = mem.start()
        c0, w0 = time.process_time(), time.perf_counter()
        settings = GenerationSettings(block=cfg.block, max_new_tokens=new_tokens, **variant(cfg.policy)[1])
        hf = Lockstep(model, ids, cfg.budget, new_tokens, CLOCKS[clock]) if lockstep else None
        observer = Observer(clock=hf.clock, on_step=hf.on_step) if hf else Observer(clock=CLOCKS[clock])
        if settings.compile:  # torch's compiler counters: imported where a call compiles, not at every start-up
            from torch._dynamo.utils import counters
            skips = counters["inductor"]["cudagraph_skips"]
        res = generate(model, policy, ids, settings, observer=observer)
        m = {"prefill_s": res.prefill_s, "decode_s": res.decode_s, "decode_steps": res.decode_steps,
             "tokens": res.tokens, "evict_prefill_s": res.evict_prefill_s, "evict_decode_s": res.evict_decode_s,
             "peak_kv_tokens": res.peak_kv_tokens, "kv_bytes_peak": res.kv_bytes_peak, "layer_tokens": res.layer_tokens}
        if settings.compile:
            m["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
        if hf is not None:
            m.update(hf.finish(), hf_reference="lockstep")
    m["cpu_per_wall"] = (time.process_time() - c0) / max(time.perf_counter() - w0, 1e-9)
    m.update(peak_rss_mib=mem.rss_peak_mib(), rss_start_mib=rss0, peak_gpu_mib=mem.gpu_peak_mib())
    return m


def host_syncs(model: Any, cfg: Config, seed: int = 0, prompt: Sequence[int] | None = None) -> dict[str, Any]:
    """Host syncs per decoding step of configuration `cfg` (kvbench.bench.syncs), from one untimed call on the first
    min(prompt_tokens, N + 2B) tokens: `host_syncs_per_step` (mean over the complete steps), `host_syncs_max_step`,
    `host_sync_sites` (file:line -> syncs per step, most first; the token's argmax is generate.py's)."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    n = min(cfg.prompt_tokens, (cfg.budget or 0) + 2 * (cfg.block or 64))
    ids = list(prompt[:n]) if prompt is not None else prompt_ids(n, vocab, seed=seed)
    policy = make_policy(cfg.policy, cfg.budget, seed)
    policy.start_sample(seed)
    c = count_host_syncs(model, policy, ids, cfg.block, SYNC_TOKENS)
    if not c.per_step:
        return dict(NO_SYNCS)
    steps = len(c.per_step)
    return {"host_syncs_per_step": round(c.mean, 3), "host_syncs_max_step": max(c.per_step),
            "host_sync_sites": {site: round(k / steps, 3) for site, k in c.by_site.items()}}


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


def warm_ups(configs: Sequence[Config], new_tokens: int, device_type: str) -> list[tuple[Config, int]]:
    """The unmeasured calls `run_bench` makes first, as (configuration, new tokens): kernels, thread pools and the
    allocator warmed before any round. One short call per kvbench policy (its first configuration, on the first
    min(prompt, N + 2B) tokens, 2 new tokens). HF's own loop on a GPU: every HF configuration at its own shape
    (prompt and new tokens). Its `DynamicCache` grows by a concatenation per layer per step, a new size each time,
    so a short call leaves most of a measured call's allocations new; with the short call only, HF's first round
    on a GPU decoded much slower than its later ones, which made the paired per-round ratios of the decoding goal
    meaningless there (results/bench_gpu/RUN.md). On a CPU the rounds agree, so the short call is kept there."""
    out: list[tuple[Config, int]] = []
    for name in dict.fromkeys(c.policy for c in configs):
        same = [c for c in configs if c.policy == name]
        if name in (HF_FORWARD, HF_DECODE) and device_type != "cpu":
            out.extend((c, new_tokens) for c in same)
        else:
            c = same[0]
            warm = min(c.prompt_tokens, (c.budget or 0) + 2 * (c.block or 64))
            out.append((Config(c.policy, c.budget, c.block, warm), min(new_tokens, 2)))
    return out


def run_bench(model: Any, configs: Sequence[Config], new_tokens: int, repeats: int, seed: int = 0,
              model_desc: str = "", log: Callable[[str], None] | None = None,
              prompt: Sequence[int] | None = None, clock: str = "wall", syncs: bool = True,
              hf_reference: str | None = None,
              on_round: Callable[[list[dict[str, Any]], int], None] | None = None) -> list[dict[str, Any]]:
    """Measure every configuration `repeats` times, interleaved (round r runs them all, in an order rotated by r),
    after the unmeasured warm-up calls of `warm_ups`; returns one row per configuration with medians. `on_round`
    (rows, rounds done) is called after every round but the last with the rows of the rounds so far, so that a bench
    stopped early (a time limit, a lost machine) can leave what it measured. `prompt`: the
    token ids every configuration reads its first `prompt_tokens` from (default: random ids per length). `syncs`:
    count host syncs per decoding step once per (policy, budget, block) (`host_syncs`; not for HF's own loop).

    `hf_reference` "beside": right after each call of a kvbench configuration, HF's own decoding at its budget (the
    hf-decode configuration) is measured once more and kept beside that call as its reference (the row's
    `hf_decode_s_rounds`; the hf-decode row itself keeps its own calls), and the decoding goal pairs each call with
    its reference (goals.round_ratios). Where the call's layers did not all hold N tokens a head when it decoded
    (K-norm leaves its first two layers whole, PyramidKV gives the lower layers more and the upper fewer), HF's
    reference holds those per-layer sizes instead (`hf_layer_sizes`, the row's `hf_layer_sizes`), so both sides
    attend as many keys in every layer; its prompt forward is then over the longest layer's tokens (its time is not
    used). Why: on a shared machine a call's time moves with the stretch it ran in, and a round's hf-decode call ran
    minutes before or after most of the round's rows; a reference seconds away shares more of its call's stretch
    (how much that buys depends on the machine: results/bench_smollm2/RUN.md). The price: one more HF call (prompt of N tokens, or of the longest layer's, then the decoding) per kvbench
    call.

    `hf_reference` "lockstep": the same reference (HF's decoding at the call's per-layer sizes), made one step after
    each of the call's own decoding steps instead of after the call (kvbench.bench.hfloop.Lockstep): both sides'
    steps alternate a tenth of a second apart, so a stretch of the machine moves both; the same row fields and
    test. Its price: HF's prompt forward and steps inside the call (not in its times, but in its peak RSS)."""
    if hf_reference not in (None, *HF_REFERENCES):
        raise BenchError(f"hf_reference is one of {', '.join(HF_REFERENCES)}, got {hf_reference!r}")
    hf_at = {c.budget: c for c in configs if c.policy == HF_DECODE}
    if hf_reference and not hf_at:
        raise BenchError(f"an HF reference ({hf_reference}) needs the hf-decode baseline (--baselines hf)")
    mem = PeakMemory(model.device)
    # per policy, the CUDA graphs torch skipped over all its calls (its first calls record them, the warm-up's too)
    skipped: collections.Counter[str] = collections.Counter()
    for c, n in warm_ups(configs, new_tokens, model.device.type):
        skipped[c.policy] += measure(model, c, n, mem, seed, prompt, clock).get("cudagraph_skips", 0)
    counted: dict[tuple[str, int | None, int | None], dict[str, Any]] = {}
    for c in configs if syncs else ():
        key = (c.policy, c.budget, c.block)
        if c.policy not in (HF_FORWARD, HF_DECODE) and key not in counted:
            counted[key] = host_syncs(model, c, seed, prompt)
            if log:
                log(f"host syncs {c.policy:>12} N={c.budget} B={c.block}: {counted[key]['host_syncs_per_step']} "
                    f"per decoding step")
    raw: dict[Config, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(repeats):
        k = r % len(configs)
        for c in list(configs[k:]) + list(configs[:k]):
            ref = hf_at.get(c.budget) if hf_reference and c.policy not in (HF_FORWARD, HF_DECODE) else None
            m = measure(model, c, new_tokens, mem, seed, prompt, clock, lockstep=ref is not None and
                        hf_reference == "lockstep")
            if ref is not None and hf_reference == "beside":  # HF's decoding at its budget right after: this stretch
                sizes = hf_layer_sizes(m.get("layer_tokens"), ref.budget)
                if sizes is not None:  # at the policy's own per-layer sizes: HF's forward over the longest
                    ref = Config(HF_DECODE, ref.budget, None, max(sizes))
                h = measure(model, ref, new_tokens, mem, seed, prompt, clock, sizes)
                m.update(hf_decode_s=h["decode_s"], hf_decode_steps=h["decode_steps"], hf_layer_sizes=sizes,
                         hf_reference="beside")
            raw[c].append(m)
            skipped[c.policy] += m.get("cudagraph_skips", 0)
            if log:
                log(f"round {r + 1}/{repeats} {c.policy:>12} N={c.budget} B={c.block} T={c.prompt_tokens}: "
                    f"prefill {m['prefill_s']:.3f} s (evict {m['evict_prefill_s']:.3f}), decode {m['decode_s']:.3f} s "
                    f"(evict {m['evict_decode_s']:.3f}), peak RSS {m['peak_rss_mib']:.0f} MiB, "
                    f"cpu/wall {m['cpu_per_wall']:.2f}"
                    + (f"; HF's decoding {hf_reference} {m['hf_decode_s']:.3f} s" if ref is not None else ""))
        if on_round is not None and r + 1 < repeats:
            on_round(_rows(configs, raw, counted, skipped, model, model_desc, mem.method, clock), r + 1)
    return _rows(configs, raw, counted, skipped, model, model_desc, mem.method, clock)


def _rows(configs: Sequence[Config], raw: dict[Config, list[dict[str, Any]]], counted: dict[tuple, dict[str, Any]],
          skipped: collections.Counter[str], model: Any, model_desc: str, rss_method: str,
          clock: str) -> list[dict[str, Any]]:
    """One row per configuration from its calls so far, with the ratios between rows (goals.add_ratios); a compiled
    one (NAME+compiled) with `cudagraph_skips`, the CUDA graphs torch skipped in its policy's calls so far."""
    rows = [{**_row(c, raw[c], model, model_desc, rss_method), "clock": clock,
             **counted.get((c.policy, c.budget, c.block), NO_SYNCS),
             **({"cudagraph_skips": skipped[c.policy]} if variant(c.policy)[1].get("compile") else {})}
            for c in configs]
    add_ratios(rows)
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
        # each round's times (the eviction's too, so two ways of evicting in one run compare round by round)
        **{f"{k}_rounds": [round(m[k], 6) for m in ms] for k in keys},
        "cpu_per_wall": round(statistics.median(m["cpu_per_wall"] for m in ms), 3),
        "first_tokens": ms[0]["tokens"][:8],
        "repeats": len(ms), "decode_steps": steps, "device": str(model.device), "model": model_desc,
        "rss_method": rss_method,
    }
    if all("hf_decode_s" in m for m in ms):  # run_bench's hf_reference: each call's own reference, round by round
        row.update(hf_decode_s_rounds=[round(m["hf_decode_s"], 6) for m in ms],
                   hf_decode_steps=ms[0]["hf_decode_steps"], hf_layer_sizes=ms[0]["hf_layer_sizes"],
                   hf_reference=ms[0]["hf_reference"])
    return row
