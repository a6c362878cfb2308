"""Ratios between the configurations of one run (eviction share, vs the floor, vs HF, vs KeyDiff) and the speed
goals as pass/fail lines; the markdown table.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from kvbench.bench.setup import FLOOR, FULL, HF_DECODE, HF_FORWARD, base_name, policy_class, variant
from kvbench.metrics.stats import ALPHA, holm, ratio_test

# The lean-engine goals (issue 29). Eviction share of the whole run (prefill + decode), the same limit for every
# policy. Decoding per token against HF's plain decoding at cache size N: policies that need no attention scores
# (their per-step work is a key statistic, a hash or nothing) get 1.02x, every other policy 1.10x.
SCORE_FREE_POLICIES = ("streamingllm", "knorm", "keydiff", "random", "hashevict")


EVICT_SHARE = 0.08


DECODE_VS_HF_SCORE_FREE, DECODE_VS_HF = 1.02, 1.10  # decode per token with eviction every step / HF's plain decode


PREFILL_VS_HF = 1.0  # block-wise prefill / HF's single full forward, at prompts of PREFILL_GOAL_TOKENS and more


PREFILL_GOAL_TOKENS = 8000


VS_KEYDIFF = 1.5  # end-to-end time of any policy / KeyDiff's, same N and B


FLAT_SLACK_MIB = 16.0  # peak RSS growth from the shortest to the longest prompt allowed beyond the KV bytes' growth


# Host syncs per decoding step (kvbench.bench.syncs): reading the greedy token is the one a loop cannot avoid; every
# other one makes the host wait for the GPU's queue, every step.
HOST_SYNCS_PER_STEP = 1


def evict_measured(name: str) -> bool:
    """Whether a row's eviction time is measured apart: not for NAME+compiled, whose evictions run inside each
    forward's compiled graph (GenerationSettings.compile: its evict_s is 0, not a measurement), unless its policy draws
    from a generator (`Policy.sample_state`: those evict after each compiled forward)."""
    return not variant(name)[1].get("compile", False) or bool(policy_class(name).sample_state)


def add_ratios(rows: list[dict[str, Any]]) -> None:
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
        ref = d["decode_ms_per_token"] if d else None
        if r.get("hf_decode_s_rounds"):  # HF's decoding measured beside each of the row's calls: their median
            ref = 1000 * statistics.median(r["hf_decode_s_rounds"]) / r["hf_decode_steps"]
        r["decode_vs_hf"] = (round(r["decode_ms_per_token"] / ref, 4)
                             if evicting and r["decode_ms_per_token"] and ref else None)
        kd = keydiff.get((r["prompt_tokens"], r["budget"]))
        r["vs_keydiff"] = round(r["total_s"] / kd["total_s"], 4) if kd and evicting else None


def goals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (goal, policy): {"goal", "policy", "passed", "detail"}; goals whose rows are missing are left
    out. All are ratios between rows of the same interleaved run. `passed` is None where the decoding goal is not
    resolved at 95 % over the rounds (`_decode_check`)."""
    out: list[dict[str, Any]] = []
    pol = [r for r in rows if r["policy"] not in (FULL, HF_FORWARD, HF_DECODE)]
    names = list(dict.fromkeys(r["policy"] for r in pol))

    def add(goal: str, name: str, checks: list[tuple[bool | None, str]]) -> None:
        if checks:  # passed: False when any check failed, else None when any is not resolved, else True
            oks = [ok for ok, _ in checks]
            passed = False if False in oks else None if None in oks else True
            out.append({"goal": goal, "policy": name, "passed": passed, "detail": ", ".join(d for _, d in checks)})

    hf_dec = {r["budget"]: r for r in rows if r["policy"] == HF_DECODE}

    for name in names:
        mine = [r for r in pol if r["policy"] == name]
        add(f"eviction <= {100 * EVICT_SHARE:.0f} % of the run", name,
            [(r["evict_share"] <= EVICT_SHARE, f"{r['prompt_tokens']}: {100 * r['evict_share']:.1f} %") for r in mine
             if evict_measured(name)])
        limit = DECODE_VS_HF_SCORE_FREE if base_name(name) in SCORE_FREE_POLICIES else DECODE_VS_HF
        decoded = [_decode_check(r, hf_dec.get(r["budget"]), limit) for r in mine if r.get("decode_vs_hf") is not None]
        add(f"decode per token <= {limit:.2f}x HF's at cache size N", name, [(ok, d) for ok, d, _ in decoded])
        if decoded and all(t is not None for _, _, t in decoded):
            out[-1]["p"] = _line_p(out[-1]["passed"], [t for _, _, t in decoded])  # type: ignore[misc]
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
        add("each compiled forward a CUDA graph (torch skipped none)", name,
            [(r["cudagraph_skips"] == 0, f"{r['prompt_tokens']}: {r['cudagraph_skips']} skipped") for r in mine
             if r.get("cudagraph_skips") is not None and r["device"].startswith("cuda")])
        counted = {r["budget"]: r for r in mine if r.get("host_syncs_max_step") is not None}  # same at every length
        add(f"host syncs per decoding step <= {HOST_SYNCS_PER_STEP} (the token)", name,
            [(r["host_syncs_max_step"] <= HOST_SYNCS_PER_STEP,
              f"N={b}: {r['host_syncs_per_step']:.2f} (max {r['host_syncs_max_step']})") for b, r in counted.items()])
    return out


def round_ratios(r: dict[str, Any], hf: dict[str, Any] | None, beside: bool = True) -> list[float] | None:
    """A row's per-round decoding time per token over HF's (--repeats >= 2): over HF's call measured right after each
    of the row's calls when the row has them (`hf_decode_s_rounds`, run_bench's hf_beside) and `beside`, else over the
    hf-decode row `hf`'s call of the same round (interleaved: round i of both ran in the same stretch of the machine);
    None with one round."""
    mine = r.get("decode_s_rounds") or []
    if beside and r.get("hf_decode_s_rounds"):
        theirs, their_steps = r["hf_decode_s_rounds"], r["hf_decode_steps"]
    else:
        theirs = [] if hf is None else hf.get("decode_s_rounds") or []
        their_steps = None if hf is None else hf["decode_steps"]
    if len(mine) < 2 or len(mine) != len(theirs) or not (r["decode_steps"] and their_steps):
        return None
    # per token: each round's decoding seconds over the row's decoding steps
    return [(a / r["decode_steps"]) / (b / their_steps) for a, b in zip(mine, theirs)]


def _decode_check(r: dict[str, Any], hf: dict[str, Any] | None,
                  limit: float) -> tuple[bool | None, str, tuple[float, float] | None]:
    """A row's decoding goal. With rounds, a test at 95 % on the paired per-round ratios (`round_ratios`) on their logs
    (`ratio_test`): passed when the one-sided upper t bound of their geometric mean is within the limit, failed when
    the lower bound is over it, None (not resolved) otherwise. With one round, the ratio of the row's medians against
    the limit.
    Returns (passed, the words, the test's one-sided p values under the limit and over it; None with one round)."""
    text = f"{r['prompt_tokens']}: {r['decode_vs_hf']:.2f}x"
    held, bound = r.get("peak_kv_tokens"), (r["budget"] or 0) + (r["block"] or 0)
    # a layer the policy leaves whole (K-norm's first two) or gives more than N (PyramidKV's lower ones) is not at
    # HF's cache size there, unless HF's reference beside each call held the policy's per-layer sizes: said beside
    # the verdict
    lockstep = r.get("hf_reference") == "lockstep"  # HF's steps between the call's (else its call right after)
    sizes = r.get("hf_layer_sizes") if r.get("hf_decode_s_rounds") else None
    if sizes:
        note = (f"; HF's {'in lockstep with' if lockstep else 'beside'} each call held the policy's per-layer sizes "
                f"({min(sizes)}-{max(sizes)} tokens a head)")
    elif held and r["budget"] and held > bound:
        note = f"; some layer holds up to {held} tokens a head, over N + B = {bound}, where HF's holds N"
    else:
        note = ""
    ratios = round_ratios(r, hf)
    if ratios is None:
        return r["decode_vs_hf"] <= limit, text + note, None
    test = ratio_test(ratios, limit)
    assert test is not None  # round_ratios gives two or more
    passed = True if test.upper <= limit else False if test.lower > limit else None
    pairs = (("calls each in lockstep with HF's" if lockstep else "calls each beside HF's")
             if r.get("hf_decode_s_rounds") else "paired rounds")
    return (passed, f"{text}, geometric mean {test.mean:.2f}x, one-sided 95 % bounds {test.lower:.2f}x and "
            f"{test.upper:.2f}x over {len(ratios)} {pairs}{note}", (test.p_under, test.p_over))


def _line_p(passed: bool | None, tests: list[tuple[float, float]]) -> float:
    """One decoding line's p value for a family of lines, in the direction of its own verdict: a pass needs every row
    under the limit (the largest p under it), a failure one row over it (the smallest p over it); a line not resolved
    at 95 % takes the smaller of the two, which is over 5 % either way."""
    under, over = max(t[0] for t in tests), min(t[1] for t in tests)
    return under if passed is True else over if passed is False else min(under, over)


def holm_line(results: Sequence[dict[str, Any]], alpha: float = ALPHA) -> str | None:
    """The decoding lines tested over rounds (those with a p value), as one family (`family_line`)."""
    lines = [g for g in results if g["goal"].startswith("decode") and g.get("p") is not None]
    return family_line([(g["policy"], g["passed"], g["p"]) for g in lines], "decode per token", ("PASS", "FAIL"),
                       alpha)


def family_line(lines: Sequence[tuple[str, bool | None, float]], what: str, labels: tuple[str, str],
                alpha: float = ALPHA, over: str = "rounds") -> str | None:
    """Lines of one run, each a test at 1 - alpha on its own, as one family: what each line's verdict is once Holm's
    correction (`kvbench.metrics.stats.holm`) keeps the family-wise error at `alpha`; None with fewer than two lines.
    `lines`: (name, verdict: True / False / None for not resolved, its p value in the direction of its verdict);
    `labels`: the words for True and False; `over`: what each line's test is over. A line keeps its verdict when its
    adjusted p value is within alpha, else it is not resolved after the correction."""
    if len(lines) < 2:
        return None
    adjusted = holm([p for _, _, p in lines])
    groups: dict[str, list[str]] = {labels[0]: [], labels[1]: [], "not resolved": []}
    for (name, passed, _), p in zip(lines, adjusted):
        kept = passed is not None and p <= alpha
        groups[labels[0] if kept and passed else labels[1] if kept else "not resolved"].append(f"{name} ({p:.2g})")
    body = "; ".join(f"{k} {', '.join(v)}" for k, v in groups.items() if v)
    return (f"HOLM  {what}, the {len(lines)} lines over {over} as one family (family-wise {100 * alpha:.0f} %, "
            f"adjusted p): {body}")


def goal_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    """PASS/FAIL lines grouped by goal (in docs/bench.md's order), policies in run order within a goal."""
    rank = {k: i for i, k in enumerate(("eviction", "decode", "prefill", "end", "peak", "host"))}
    ordered = sorted(results, key=lambda g: rank.get(g["goal"].split(" ")[0], len(rank)))  # stable: run order kept
    label = {True: "PASS", False: "FAIL", None: "NOT RESOLVED"}
    lines = [f"{label[g['passed']]}  {g['goal']}: {g['policy']} ({g['detail']})" for g in ordered]
    family = holm_line(ordered)
    if family is not None:  # right after the decoding lines it corrects
        last = max(i for i, g in enumerate(ordered) if g["goal"].startswith("decode"))
        lines.insert(last + 1, family)
    return lines


def goals_markdown(lines: Sequence[str]) -> str:
    """The markdown file's "## Goals" section that follows a bench table: one item per goal line; "" without lines."""
    return "\n## Goals\n\n" + "\n".join(f"- {ln}" for ln in lines) + "\n" if lines else ""


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    from tabulate import tabulate

    def pct(v: float | None) -> str:
        return "" if v is None else f"{100 * v:+.1f} %" if v < 0 else f"{100 * v:.1f} %"

    def x(v: float | None) -> str:
        return "" if v is None else f"{v:.2f}x"

    head = ["policy", "prompt", "N", "B", "prefill s", "vs HF fwd", "decode ms/tok", "vs HF dec", "evict s (pre+dec)",
            "evict %", "total s", "vs keydiff", "vs floor", "peak KV tok", "KV MiB", "peak RSS MiB", "syncs/step"]
    body = []
    for r in rows:
        hf = r["policy"] in (HF_FORWARD, HF_DECODE)
        body.append([r["policy"], r["prompt_tokens"], r["budget"] if r["budget"] is not None else "-",
                     r["block"] if r["block"] is not None else "all", f"{r['prefill_s']:.3f}",
                     x(r.get("vs_hf_forward")),
                     "" if r["decode_ms_per_token"] is None else f"{r['decode_ms_per_token']:.1f}",
                     x(r.get("decode_vs_hf")),
                     "" if hf or r["policy"] == FULL else "in graph" if not evict_measured(r["policy"])
                     else f"{r['evict_prefill_s']:.3f}+{r['evict_decode_s']:.3f}",
                     "" if hf or r["policy"] == FULL or not evict_measured(r["policy"]) else pct(r["evict_share"]),
                     f"{r['total_s']:.3f}",
                     x(r.get("vs_keydiff")),
                     pct(r["vs_floor"]) if r["policy"] not in (FULL, FLOOR) and not hf else "", r["peak_kv_tokens"],
                     f"{r['kv_bytes_peak'] / 2**20:.1f}", f"{r['peak_rss_mib']:.0f}",
                     "" if r.get("host_syncs_per_step") is None else f"{r['host_syncs_per_step']:.2f}"])
    return tabulate(body, headers=head, tablefmt="github", disable_numparse=True)
