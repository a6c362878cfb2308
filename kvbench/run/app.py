"""Assemble and execute runs from a resolved config (a plain dict): no Hydra here, so tests can call it directly.

A run directory holds `config.yaml` (the resolved config), `predictions.jsonl` (one line per finished sample),
`metrics.json` (scores, average, stats, provenance) and whatever the task adds (heatmaps, official files).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from kvbench import __version__
from kvbench.models.generation import generation_provenance
from kvbench.metrics.aggregate import average_of
from kvbench.models.common import portable_path
from kvbench.models.loading import LoadedModel, load_model
from kvbench.options import LM_TOKENS_AFTER_EVICTION
from kvbench.policies.base import Policy
from kvbench.run import gitstate
from kvbench.run.config import load_group
from kvbench.run.labels import describe_run
from kvbench.run.machine import accelerator, cpu_info
from kvbench.run.loop import SharedRun, check_lm_settings, run_shared, run_task
from kvbench.run.records import aggregate_diagnostics, summarize
from kvbench.run.settings import ConfigError, RunSettings, build_policy, build_task, user_errors
from kvbench.run.threads import current_threads
from kvbench.tasks.base import Task, TaskEnv


def provenance(loaded: LoadedModel, task: Task) -> dict[str, Any]:
    import torch
    import transformers

    # `dirty`: whether kvbench's checkout had uncommitted changes (None: not a git checkout, e.g. a wheel).
    return {"kvbench": __version__, "commit": gitstate.commit(), "dirty": gitstate.dirty(),
            "transformers": transformers.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "cpu": cpu_info(), "model_path": portable_path(loaded.path),
            "model_revision": loaded.revision, "model_source": loaded.source, "device": str(loaded.model.device),
            "accelerator": accelerator(str(loaded.model.device)),
            "dtype": str(loaded.model.dtype).replace("torch.", ""), "task": task.provenance(),
            "generation": generation_provenance(loaded.model, loaded.generation_config_source)}


def task_average(task: Task, scores: dict[str, float]) -> float | None:
    """The `average` of metrics.json: the task's average_key score, else the mean of all scores (the one rule,
    kvbench.metrics.aggregate.average_of, which the report's shard merge applies too)."""
    return average_of(scores, task.average_key)


def write_json(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a kill leaves either the old or the new file, never half."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class RunBusy(ConfigError):
    """Another kvbench process holds the run directory: this one must neither write nor remove anything there."""


# Files Hydra writes into a run directory before the job starts, and the lock file; a directory holding only these has
# no results.
_HYDRA_ONLY = {".hydra", "cli.log", "kvbench.log", "main.log", "_job.log", ".lock"}
# What a run writes into its directory before its first result; removed again when it fails on bad input.
_RUN_FILES = ("config.yaml", "run.json", "predictions.jsonl")


@dataclass
class HeldLock:
    """A held run lock, and what taking it created (only what this process created is ever removed)."""

    run_dir: Path
    created_dir: bool
    created_lock_file: bool


def _busy(run_dir: Path) -> RunBusy:
    return RunBusy(f"another kvbench process is running in {run_dir}")


@contextlib.contextmanager
def run_lock(run_dir: Path, create: bool = True) -> Iterator[HeldLock]:
    """Exclusive lock on a run directory (its `.lock` file, a filelock.FileLock: flock on Unix), taken before
    anything is written into it or removed from it: a second process on the same directory (the same command
    started twice, a sweep launched twice) would append duplicate predictions or delete the first one's files, so it
    fails at once (`RunBusy`) and touches nothing. `create`: make the directory (and its parents) if missing;
    otherwise a missing directory is RunBusy (another process removed it). The kernel drops the lock when its process
    dies, SIGKILL included."""
    from filelock import FileLock, Timeout

    for _ in range(3):
        created_dir = False
        if create and not run_dir.is_dir():
            try:
                run_dir.mkdir(parents=True)
                created_dir = True
            except FileExistsError:
                pass  # made by another process just now
        if not run_dir.is_dir():
            if create:
                continue  # removed by another process between our mkdir and now: make it again
            raise _busy(run_dir)
        lock_path = run_dir / ".lock"
        lock_existed = lock_path.exists()
        lock = FileLock(str(lock_path), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise _busy(run_dir) from None
        except FileNotFoundError:
            if create:
                continue  # removed, with its directory, between our mkdir and the lock: make it again
            raise _busy(run_dir) from None
        try:
            # The holder before us may have removed the directory (a new run that failed on bad input) between our
            # open and our lock: a lock on a removed file guards nothing, so start again.
            if not lock_path.exists():
                continue
            yield HeldLock(run_dir, created_dir, not lock_existed)
            return
        finally:
            lock.release()
    raise _busy(run_dir)


def remove_if_empty_run(run_dir: Path) -> None:
    """Remove a run directory that holds nothing but Hydra's own files (a job that failed before any result), under
    the run lock: a directory another kvbench process holds is left alone."""
    if not run_dir.is_dir():
        return
    try:
        with run_lock(run_dir, create=False):
            if {p.name for p in run_dir.iterdir()} <= _HYDRA_ONLY:
                shutil.rmtree(run_dir, ignore_errors=True)
    except RunBusy:
        pass


def _discard_new_run(lock: HeldLock, existed: set[str]) -> None:
    """After bad input, under the lock: remove what this process wrote into its run directory, when the run is new
    (its run.json is ours) and has no prediction yet, and the directory itself when this process made it. What was
    there when the lock was taken is never touched."""
    run_dir = lock.run_dir
    pred = run_dir / "predictions.jsonl"
    if "run.json" in existed or (pred.is_file() and pred.stat().st_size > 0):
        return  # a run started before, or results this process computed (resumable): keep
    for name in _RUN_FILES:
        if name not in existed:
            (run_dir / name).unlink(missing_ok=True)
    if lock.created_dir and {p.name for p in run_dir.iterdir()} <= {".lock"}:
        shutil.rmtree(run_dir, ignore_errors=True)
    elif lock.created_lock_file:
        (run_dir / ".lock").unlink(missing_ok=True)


class Session:
    """Keeps the loaded model between the runs of one process (`compare` runs several policies)."""

    def __init__(self) -> None:
        self._model: tuple[str, LoadedModel] | None = None
        self.references: dict[Any, Any] = {}  # full-cache continuations, shared by the runs of one model

    def model(self, settings: RunSettings) -> LoadedModel:
        m = dict(settings.model)
        key = json.dumps([m, settings.device, settings.seed], sort_keys=True)
        if self._model is None or self._model[0] != key:
            from kvbench.engine.cache import install

            if m.get("path") in (None, "", "???"):
                raise ConfigError("model.path is required (a hub id or a local directory)")
            loaded = load_model(name=m.get("name", "model"), path=str(m["path"]), dtype=m.get("dtype", "auto"),
                                max_prompt_tokens=m.get("max_prompt_tokens", 4096), revision=m.get("revision"),
                                attn_implementation=m.get("attn_implementation", "sdpa"),
                                device=settings.device, chat_template=m.get("chat_template", True),
                                seed=settings.seed)
            install(loaded.model)
            self._model = (key, loaded)
            self.references = {}
        return self._model[1]


def run_one(cfg: Mapping[str, Any] | RunSettings, policy_name: str, run_dir: Path, session: Session) -> dict[str, Any]:
    """One (model, policy, budget, block, task) run into `run_dir`; returns its metrics. `cfg`: a resolved config
    (parsed here) or the job's settings parsed once.

    Resumable: a rerun into the same directory with the same configuration skips finished samples (and a
    finished run entirely); another configuration is refused unless overwrite=true.
    """
    settings = cfg if isinstance(cfg, RunSettings) else RunSettings.from_config(cfg)
    if settings.policy is None:
        raise ConfigError("no policy chosen (policy=NAME)")
    policy = build_policy(settings.policy, settings)
    task = build_task(settings.task)
    if task.lm_tokens is not None:
        check_lm_settings(task.lm_tokens, settings)
    if not run_dir.exists():  # a model that cannot load is bad input: fail before creating the run directory
        session.model(settings)  # (an existing directory may be a finished run, which needs no model)
    with run_lock(run_dir) as lock:
        existed = {name for name in _RUN_FILES if (run_dir / name).exists()}
        try:
            return _run_locked(settings, policy_name, run_dir, session, policy, task)
        except user_errors():
            # Bad input found only once the run has started (a data file read while the samples are built): a new
            # run that has no prediction yet leaves nothing behind.
            _discard_new_run(lock, existed)
            raise


def _open_run(settings: RunSettings, policy_name: str, run_dir: Path, session: Session) -> dict[str, Any] | None:
    """Under the run lock: check the directory against this configuration (resume, finished, refused) and record the
    run (config.yaml, run.json); a finished run's metrics, or None when samples are left to run."""
    metrics_path, pred_path, meta_path = run_dir / "metrics.json", run_dir / "predictions.jsonl", run_dir / "run.json"
    key = settings.key(policy_name)
    if settings.overwrite:
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
        if old.get("commit") != gitstate.commit():
            print(f"kvbench: warning: resuming {run_dir}, started at commit {old.get('commit')}, with commit "
                  f"{gitstate.commit()}", file=sys.stderr)
    elif pred_path.is_file():
        raise ConfigError(f"{pred_path} exists without run.json (its configuration is unknown); use "
                          f"overwrite=true or another hydra.run.dir")
    session.model(settings)  # a model that cannot load fails before anything is written
    _write_config(run_dir, settings.recorded())
    if not meta_path.is_file():
        write_json(meta_path, {"key": key, "policy": policy_name, "kvbench": __version__, "commit": gitstate.commit()})
    return None


def task_env(loaded: LoadedModel, settings: RunSettings) -> TaskEnv:
    return TaskEnv(tokenizer=loaded.tokenizer, model_name=loaded.name, max_prompt_tokens=loaded.max_prompt_tokens,
                   chat_template=loaded.chat_template, seed=settings.seed)


def _run_locked(settings: RunSettings, policy_name: str, run_dir: Path, session: Session, policy: Policy,
                task: Task) -> dict[str, Any]:
    finished = _open_run(settings, policy_name, run_dir, session)
    if finished is not None:
        return finished
    loaded = session.model(settings)
    records = run_task(loaded.model, loaded.tokenizer, policy, task, task_env(loaded, settings), settings, run_dir,
                       references=session.references)
    return _close_run(settings, policy_name, run_dir, loaded, policy, task, records)


def _close_run(settings: RunSettings, policy_name: str, run_dir: Path, loaded: LoadedModel, policy: Policy,
               task: Task, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's metrics.json from its records (written last: a run with metrics.json is finished)."""
    return write_metrics(settings, policy_name, run_dir, policy, task, records, loaded.name,
                         provenance(loaded, task))


def write_metrics(settings: RunSettings, policy_name: str, run_dir: Path, policy: Policy, task: Task,
                  records: list[dict[str, Any]], model_name: str, prov: dict[str, Any],
                  stopped: dict[str, Any] | None = None, threads: int | None = None) -> dict[str, Any]:
    """Write and return metrics.json from a run's records; `prov` is the loading process's `provenance`, `threads`
    its torch threads (None: this process's). `stopped`: set when the run was stopped before its last sample and
    closed over the records it had finished (kvbench-score --close-stopped); recorded as metrics.json `stopped`."""
    scores = task.aggregate(records)
    scores_by_budget = task.lm_tokens == LM_TOKENS_AFTER_EVICTION
    metrics: dict[str, Any] = {
        "task": task.name, "model": model_name, "policy": policy_name, "budget": settings.budget,
        "block": settings.block, "protocol": settings.protocol, "scenario": settings.scenario,
        "shard": settings.recorded()["shard"],
        # Which settings this policy uses (the report shows "-" for the others): the full cache has no budget nor
        # protocol, and no block when it reads the prompt in one forward.
        # Under the LM score's after_eviction setting the budget and block say which tokens are scored, for the full
        # cache too (its N = 256 and N = 512 runs score different tokens: two rows, each the reference of its N).
        "applies": {"budget": policy.evicts or scores_by_budget,
                    "protocol": policy.evicts or scores_by_budget,
                    "block": policy.evicts or not policy.single_pass_prefill or scores_by_budget},
        # The run the others are compared against (the report pairs every policy with it): a policy that never
        # evicts, the full cache.
        "reference": not policy.evicts,
        "scores": scores, "average": task_average(task, scores),
        # How each score is built from the samples (kvbench-report's standard errors and paired tests read it).
        "composition": task.composition(records), "graded": settings.graded,
        # The report's columns and the recipe a shard merge recomputes the scores with (it never builds a Task).
        "layout": task.layout(records, scores),
        "stats": summarize(records, settings.budget, policy.evicts),
        # torch intra-op threads (a SLURM job: its CPUs; kvbench.run.threads)
        "threads": current_threads() if threads is None else threads,
        **({"batch": {"size": settings.batch_size}} if settings.batch_size > 1 else {}),
        "provenance": prov,
        **({"stopped": stopped} if stopped is not None else {}),
    }
    if settings.diagnostics:
        metrics["diagnostics"] = aggregate_diagnostics(records)
    label = describe_run(model_name, policy_name, settings.budget, settings.block, settings.protocol, policy.evicts)
    metrics.update(task.finalize(run_dir, records, scores, label=label) or {})
    write_json(run_dir / "metrics.json", metrics)
    return metrics


@dataclass(frozen=True)
class Member:
    """One run of a sweep: its settings (a policy chosen), its policy's name and its directory."""

    settings: RunSettings
    name: str
    run_dir: Path


def run_members(members: Sequence[Member], session: Session) -> list[dict[str, Any]]:
    """Run a sweep's runs, each group of equal `RunSettings.group_key` sample-major through `run_group` (one run:
    `run_one`, as alone), in the order given; returns their metrics in that order."""
    groups: dict[Any, list[int]] = {}
    for j, m in enumerate(members):
        key = m.settings.group_key()
        groups.setdefault(("alone", j) if key is None else key, []).append(j)
    out: list[dict[str, Any] | None] = [None] * len(members)
    for idx in groups.values():
        for j, metrics in zip(idx, run_group([members[j] for j in idx], session)):
            out[j] = metrics
    return out  # type: ignore[return-value]


def run_group(members: Sequence[Member], session: Session) -> list[dict[str, Any]]:
    """The runs of one shared-work group (equal `RunSettings.group_key`), sample-major: each sample's missing runs go
    through the engine together (kvbench.run.loop.run_shared), each run into its own directory with the files and
    numbers it has when it runs alone (the timings: its equal share of each forward it was a row of).
    Every run's lock is held for the group's time; a relaunch resumes per (run, sample). A task scored against the
    full cache's own continuation (fidelity) runs its members one after another (it shares through the session's
    references)."""
    if len(members) == 1:
        m = members[0]
        return [run_one(m.settings, m.name, m.run_dir, session)]
    if any(m.settings.policy is None for m in members):
        raise ConfigError("no policy chosen (policy=NAME)")
    policies = [build_policy(m.settings.policy, m.settings) for m in members]
    task = build_task(members[0].settings.task)  # one task for all: equal group keys hold equal task settings
    if task.needs_reference:
        return [run_one(m.settings, m.name, m.run_dir, session) for m in members]
    if task.lm_tokens is not None:
        for m in members:
            check_lm_settings(task.lm_tokens, m.settings)
    if any(not m.run_dir.exists() for m in members):  # a model that cannot load fails before any directory is made
        session.model(members[0].settings)
    out: list[dict[str, Any] | None] = [None] * len(members)
    with contextlib.ExitStack() as stack:
        locks = [stack.enter_context(run_lock(m.run_dir)) for m in members]
        existed = [{name for name in _RUN_FILES if (m.run_dir / name).exists()} for m in members]
        try:
            todo = []
            for j, m in enumerate(members):
                out[j] = _open_run(m.settings, m.name, m.run_dir, session)
                if out[j] is None:
                    todo.append(j)
            if todo:
                loaded = session.model(members[0].settings)
                runs = [SharedRun(policies[j], members[j].settings, members[j].run_dir / "predictions.jsonl")
                        for j in todo]
                records = run_shared(loaded.model, loaded.tokenizer, runs, task, task_env(loaded, members[0].settings))
                for j, recs in zip(todo, records):
                    m = members[j]
                    out[j] = _close_run(m.settings, m.name, m.run_dir, loaded, policies[j], task, recs)
        except user_errors():
            for lock, had in zip(locks, existed):
                _discard_new_run(lock, had)
            raise
    return out  # type: ignore[return-value]


def _write_config(run_dir: Path, cfg: Mapping[str, Any]) -> None:
    from omegaconf import OmegaConf

    write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(cfg)))


def run_configured(cfg: Mapping[str, Any], choices: Mapping[str, Any], run_dir: Path,
                   conf_dirs: Sequence[Path] | None = None) -> list[dict[str, Any]]:
    """Entry from the CLI: the chosen policy's run, or with no policy chosen one run per policy of the `compare`
    option (same model, task and settings; each in run_dir/<policy>; `conf_dirs` are where their YAMLs are found);
    returns their metrics."""
    settings = RunSettings.from_config(cfg)
    session = Session()
    return run_members(plan_members(settings, choices, run_dir, conf_dirs), session)


def plan_members(settings: RunSettings, choices: Mapping[str, Any], run_dir: Path,
                 conf_dirs: Sequence[Path] | None = None) -> list[Member]:
    """A job's runs: the chosen policy's, or with no policy chosen one per policy of the `compare` option (each in
    run_dir/<policy>); a shard's runs go below run_dir/shard<i>of<n>. A bad policy name fails before any run."""
    if settings.shard is not None:
        # Each shard gets its own directory below the run's (shards of one sweep share the Hydra subdir);
        # kvbench-report merges the shards back into one row.
        index, count = settings.shard
        run_dir = run_dir / f"shard{index}of{count}"
    if settings.policy is not None:
        return [Member(settings, str(choices.get("policy") or "policy"), run_dir)]
    if not settings.compare:
        raise ConfigError("no policy to run: choose one (policy=NAME) or list several (compare=[NAME,...])")
    policies = {n: load_group("policy", n, conf_dirs) for n in settings.compare}
    return [Member(settings.with_policy(policies[n]), n, run_dir / n) for n in settings.compare]
