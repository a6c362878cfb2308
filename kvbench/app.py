"""Assemble and execute runs from a resolved config (a plain dict): no Hydra here, so tests can call it directly.

A run directory holds `config.yaml` (the resolved config), `predictions.jsonl` (one line per finished sample),
`metrics.json` (scores, average, stats, provenance) and whatever the task adds (heatmaps, official files).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

from kvbench import __version__
from kvbench.config import ConfigError, load_group, remove_if_empty_run, user_errors
from kvbench.diagnostics import NAMES as DIAGNOSTICS
from kvbench.diagnostics import aggregate as aggregate_diagnostics
from kvbench.models import LoadedModel, load_model
from kvbench.policies.base import Policy, PolicyError
from kvbench.runner import SCENARIOS, RunSettings, generation_provenance, resolve_protocol, run_task, summarize
from kvbench.tasks.base import Task, TaskEnv, TaskError

# Settings that do not change results: excluded from the resume key.
_NOT_IN_KEY = ("progress", "overwrite", "device")


def instantiate(spec: dict[str, Any], **extra: Any) -> Any:
    """Build the object a group YAML describes: `_target_` is "module.Class", the other keys its arguments."""
    spec = dict(spec)
    target = spec.pop("_target_", None)
    if not target:
        raise ConfigError(f"config entry has no _target_: {spec}")
    module, _, cls = target.rpartition(".")
    return getattr(importlib.import_module(module), cls)(**spec, **extra)


def parse_settings(cfg: dict[str, Any]) -> RunSettings:
    block, budget = cfg.get("block"), cfg.get("budget")
    if block is not None and (not isinstance(block, int) or isinstance(block, bool) or block <= 0):
        raise ConfigError(f"block must be a positive integer or null, got {block!r}")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0):
        raise ConfigError(f"budget must be a positive integer, got {budget!r}")
    try:
        protocol, block = resolve_protocol(cfg.get("protocol", "blockwise"), block)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.get("scenario", "question_aware") not in SCENARIOS:
        raise ConfigError(f"unknown scenario '{cfg.get('scenario')}'; choose one of: {', '.join(SCENARIOS)}")
    for d in cfg.get("diagnostics") or []:
        if d not in DIAGNOSTICS:
            raise ConfigError(f"unknown diagnostic '{d}'; choose from: {', '.join(DIAGNOSTICS)}")
    shard = cfg.get("shard")
    if shard is not None:
        try:
            i, n = (int(x) for x in str(shard).split("/"))
            assert 0 <= i < n
        except (ValueError, AssertionError):
            raise ConfigError(f"shard must look like i/n with 0 <= i < n, got {shard!r}") from None
        shard = (i, n)
    return RunSettings(budget=budget, block=block, protocol=protocol, scenario=cfg.get("scenario", "question_aware"),
                       save_prompts=bool(cfg.get("save_prompts")), shard=shard,
                       diagnostics=tuple(cfg.get("diagnostics") or ()))


def build_policy(policy_cfg: dict[str, Any], budget: int | None, seed: int) -> Policy:
    try:
        return instantiate(policy_cfg, budget=budget, seed=seed)
    except TypeError as e:  # unknown option passed to the policy's constructor
        raise PolicyError(str(e)) from None


def build_task(task_cfg: dict[str, Any]) -> Task:
    try:
        return instantiate(task_cfg)
    except TypeError as e:
        raise TaskError(str(e)) from None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(loaded: LoadedModel, task: Task) -> dict[str, Any]:
    import torch
    import transformers

    return {"kvbench": __version__, "commit": _git_commit(), "transformers": transformers.__version__,
            "torch": torch.__version__, "python": platform.python_version(), "model_path": loaded.path,
            "model_revision": loaded.revision, "model_source": loaded.source, "device": str(loaded.model.device),
            "dtype": str(loaded.model.dtype).replace("torch.", ""), "task": task.provenance(),
            "generation": generation_provenance(loaded.model)}


def run_key(cfg: dict[str, Any], policy_name: str | None = None) -> str:
    """Resume key: every setting that changes results (model, policy and its name, task, budget, block, shard,
    seed, ...), so predictions are only ever continued under the configuration that produced them."""
    stable = {k: v for k, v in cfg.items() if k not in _NOT_IN_KEY}
    if policy_name is not None:
        stable["policy_name"] = policy_name
    return hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]


def task_average(task: Task, scores: dict[str, float]) -> float | None:
    """The `average` of metrics.json: the task's average_key score, else the mean of all scores."""
    if task.average_key:
        return scores.get(task.average_key)
    return sum(scores.values()) / len(scores) if scores else None


def write_json(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a kill leaves either the old or the new file, never half."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Exclusive lock on a run directory: a second process on the same directory (the same command started
    twice, a sweep launched twice) would append duplicate predictions, so it fails at once instead.
    The kernel drops the lock when its process dies, SIGKILL included."""
    import fcntl

    with (run_dir / ".lock").open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another kvbench process is running in {run_dir}") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Session:
    """Keeps the loaded model between the runs of one process (compare mode runs several policies)."""

    def __init__(self) -> None:
        self._model: tuple[str, LoadedModel] | None = None
        self.references: dict[Any, Any] = {}  # full-cache continuations, shared by the runs of one model

    def model(self, cfg: dict[str, Any], seed: int) -> LoadedModel:
        m = dict(cfg["model"])
        key = json.dumps([m, cfg.get("device"), seed], sort_keys=True)
        if self._model is None or self._model[0] != key:
            from kvbench.attention import install

            if m.get("path") in (None, "", "???"):
                raise ConfigError("model.path is required (a hub id or a local directory)")
            loaded = load_model(name=m.get("name", "model"), path=str(m["path"]), dtype=m.get("dtype", "auto"),
                                max_prompt_tokens=m.get("max_prompt_tokens", 4096), revision=m.get("revision"),
                                attn_implementation=m.get("attn_implementation", "sdpa"),
                                device=cfg.get("device", "auto"), chat_template=m.get("chat_template", True),
                                seed=seed)
            install(loaded.model)
            self._model = (key, loaded)
            self.references = {}
        return self._model[1]


def run_one(cfg: dict[str, Any], policy_name: str, run_dir: Path, session: Session,
            progress: bool = True) -> dict[str, Any]:
    """One (model, policy, budget, block, task) run into `run_dir`; returns its metrics.

    Resumable: a rerun into the same directory with the same configuration skips finished samples (and a
    finished run entirely); another configuration is refused unless overwrite=true.
    """
    settings = parse_settings(cfg)
    # Recorded as run: a block the protocol ignores is null (config.yaml, resume key, metrics alike).
    cfg = dict(cfg, protocol=settings.protocol, block=settings.block)
    seed = int(cfg.get("seed", 0))
    policy = build_policy(cfg["policy"], settings.budget, seed)
    task = build_task(cfg["task"])
    if not run_dir.exists():  # a model that cannot load is bad input: fail before creating the run directory
        session.model(cfg, seed)  # (an existing directory may be a finished run, which needs no model)
    run_dir.mkdir(parents=True, exist_ok=True)
    fresh = not (run_dir / "run.json").exists()
    try:
        with run_lock(run_dir):
            return _run_locked(cfg, policy_name, run_dir, session, progress, settings, seed, policy, task)
    except user_errors():
        # Bad input found only when the task builds its samples (a data file read then): a new run that has no
        # prediction yet leaves nothing behind.
        pred = run_dir / "predictions.jsonl"
        if fresh and not (pred.is_file() and pred.stat().st_size > 0):
            for name in ("config.yaml", "run.json", "predictions.jsonl"):
                (run_dir / name).unlink(missing_ok=True)
            remove_if_empty_run(run_dir)
        raise


def _run_locked(cfg: dict[str, Any], policy_name: str, run_dir: Path, session: Session, progress: bool,
                settings: RunSettings, seed: int, policy: Policy, task: Task) -> dict[str, Any]:
    metrics_path, pred_path, meta_path = run_dir / "metrics.json", run_dir / "predictions.jsonl", run_dir / "run.json"
    key = run_key(cfg, policy_name)
    if cfg.get("overwrite"):
        for p in (metrics_path, pred_path, meta_path):
            p.unlink(missing_ok=True)
    elif meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if old.get("key") != key:
            raise ConfigError(f"{run_dir} holds a run with a different configuration; use overwrite=true or "
                              f"another hydra.run.dir")
        if metrics_path.is_file():
            print(f"kvbench: {run_dir} is finished (overwrite=true recomputes it)")
            return json.loads(metrics_path.read_text())
        if old.get("commit") != _git_commit():
            print(f"kvbench: warning: resuming {run_dir}, started at commit {old.get('commit')}, with commit "
                  f"{_git_commit()}", file=sys.stderr)
    elif pred_path.is_file():
        raise ConfigError(f"{pred_path} exists without run.json (its configuration is unknown); use "
                          f"overwrite=true or another hydra.run.dir")
    loaded = session.model(cfg, seed)
    env = TaskEnv(tokenizer=loaded.tokenizer, model_name=loaded.name, max_prompt_tokens=loaded.max_prompt_tokens,
                  chat_template=loaded.chat_template, seed=seed)
    _write_config(run_dir, cfg)
    if not meta_path.is_file():
        write_json(meta_path, {"key": key, "policy": policy_name, "kvbench": __version__, "commit": _git_commit()})
    records = run_task(loaded.model, loaded.tokenizer, policy, task, env, settings, run_dir, progress=progress,
                       references=session.references)
    scores = task.aggregate(records)
    metrics: dict[str, Any] = {
        "task": task.name, "model": loaded.name, "policy": policy_name, "budget": settings.budget,
        "block": settings.block, "protocol": settings.protocol, "scenario": settings.scenario,
        "shard": cfg.get("shard"),
        "scores": scores, "average": task_average(task, scores),
        "stats": summarize(records, settings.budget, policy.evicts),
        "provenance": provenance(loaded, task),
    }
    if settings.diagnostics:
        metrics["diagnostics"] = aggregate_diagnostics(records)
    from kvbench.report import describe_run

    label = describe_run(loaded.name, policy_name, settings.budget, settings.block, settings.protocol, policy.evicts)
    metrics.update(task.finalize(run_dir, records, scores, label=label) or {})
    write_json(metrics_path, metrics)
    return metrics


def _write_config(run_dir: Path, cfg: dict[str, Any]) -> None:
    from omegaconf import OmegaConf

    write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(cfg)))


def run_configured(cfg: dict[str, Any], choices: dict[str, Any], run_dir: Path) -> list[dict[str, Any]]:
    """Entry from the CLI: a single run, or one run per policy of `policy=compare`, then a printed table."""
    from kvbench.report import print_metrics_table

    session = Session()
    progress = bool(cfg.get("progress", True))
    if cfg.get("shard") is not None:
        # Each shard gets its own directory below the run's (shards of one sweep share the Hydra subdir);
        # kvbench-report merges the shards back into one row.
        index, count = parse_settings(cfg).shard or (0, 1)
        run_dir = run_dir / f"shard{index}of{count}"
    if "compare" in cfg["policy"]:
        names = list(cfg["policy"]["compare"])
        for n in names:
            load_group("policy", n)  # fail on a bad name before any run starts
        results = []
        for n in names:
            sub = dict(cfg, policy=load_group("policy", n))
            results.append(run_one(sub, n, run_dir / n, session, progress))
    else:
        results = [run_one(cfg, str(choices.get("policy", "policy")), run_dir, session, progress)]
    print_metrics_table(results)
    print(f"\nrun directory: {run_dir}")
    return results

