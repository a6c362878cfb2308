"""The run settings: parsed and validated once from a resolved config into one `RunSettings`, which every later
step (the run loop, run directories, metrics.json, the report) reads instead of parsing the config again; and the
objects a config's `_target_` entries describe (policy, task).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from kvbench.policies.diagnostics import NAMES as DIAGNOSTICS
from kvbench.options import RUN_DEFAULTS, SCENARIOS, positive_int, resolve_protocol
from kvbench.policies.base import Policy, PolicyError
from kvbench.run.groups import ConfigError, option_kind_error
from kvbench.tasks.base import Task, TaskError


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input (reported as one line), as opposed to bugs (reported with a traceback)."""
    from omegaconf.errors import OmegaConfBaseException

    from kvbench.models.common import ModelError

    return (TaskError, PolicyError, ModelError, OmegaConfBaseException, ConfigError)


def _setting(default: Any = None, *, factory: Any = None, changes_results: bool = True) -> Any:
    """A RunSettings field; `changes_results=False` leaves it out of the resume key (how a run is shown or
    where it runs, not what it computes)."""
    meta = {"changes_results": changes_results}
    return field(default_factory=factory, metadata=meta) if factory is not None else field(default=default,
                                                                                            metadata=meta)


@dataclass(frozen=True)
class RunSettings:
    """Everything a job reads of its resolved config, parsed and validated once by `from_config`: the model, policy
    and task entries, the budget and the protocol in canonical form, and the run options. Fields are in
    conf/config.yaml's order (`recorded()` writes them back in that order)."""

    model: Mapping[str, Any] = _setting(factory=dict)  # the model preset's entries (name, path, dtype, ...)
    policy: Mapping[str, Any] | None = None  # the chosen policy's entries; None: run the `compare` list
    task: Mapping[str, Any] = _setting(factory=dict)  # the task's entries
    compare: tuple[str, ...] = _setting((), changes_results=False)  # policies run when none is chosen
    budget: int | None = None
    block: int | None = None  # None: the prompt goes in one forward (the protocol says so, or B = inf)
    protocol: str = "blockwise"
    seed: int = 0
    scenario: str = "question_aware"
    save_prompts: bool = False
    overwrite: bool = _setting(False, changes_results=False)
    device: str = _setting("auto", changes_results=False)
    shard: tuple[int, int] | None = None  # (i, n): samples with index % n == i
    diagnostics: tuple[str, ...] = ()
    graded: bool = True  # measure the graded score (answer_logprob): one teacher-forced branch per sample
    progress: bool = _setting(True, changes_results=False)
    # Samples per forward (the rows of one cache; engine.generate.generate_batch): a sample's tokens are its batch-1
    # tokens but where the k-row products round a near-tie differently (kvbench-bench --batch counts them), so a
    # batched run may resume a batch-1 one and the key leaves it out; every record says its batch.
    batch_size: int = _setting(1, changes_results=False)
    # Runs of a sweep (or of `compare`) that differ only in policy and budget run sample-major in one process, a
    # sample's runs whose policies select alike as the rows of one cache (kvbench.run.app.run_group); false runs each
    # alone. Results are the same but for a batch's rounding, so the key leaves it out.
    share: bool = _setting(True, changes_results=False)
    # How a shared group's runs go (docs/sweeps.md): true the runs of one policy class as the rows of one cache (one
    # forward and one eviction for all: a GPU's launches) and every cache's decoding steps as one forward, "decode" a
    # cache each (from the same shared trunk) and their decoding steps as one forward (a CPU reads the weights once),
    # false a cache each, decoding alone (their records exactly the separate runs'), "auto" true on CUDA and "decode"
    # elsewhere (on a CPU a cache's rows attend over the largest budget's slots: results/bench_sweep).
    share_rows: bool | str = _setting("auto", changes_results=False)
    # Each prompt block and decoding step (its eviction included) as one compiled graph (torch.compile; on CUDA a CUDA
    # graph): eager's predictions up to rounding (equal in float32: tests/test_engine.py), so the key leaves it out.
    compile: bool = _setting(False, changes_results=False)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> RunSettings:
        """Validate a resolved config (a plain dict; absent keys take their defaults, kvbench.options.RUN_DEFAULTS);
        ConfigError (one line) on a bad value or an unknown top-level key."""
        unknown = sorted(set(cfg) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown setting{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
        cfg = {**RUN_DEFAULTS, **cfg}  # an absent setting is its default: the one table the report reads too
        try:
            block = positive_int("block", cfg["block"], allow_none=True)
            budget = cfg["budget"]
            budget = None if budget is None else positive_int("budget", budget)  # null: the full cache's
            protocol, block = resolve_protocol(cfg["protocol"], block)
            batch_size = positive_int("batch_size", cfg["batch_size"])
        except ValueError as e:
            raise ConfigError(str(e)) from None
        scenario = cfg["scenario"]
        if scenario not in SCENARIOS:
            raise ConfigError(f"unknown scenario '{scenario}'; choose one of: {', '.join(SCENARIOS)}")
        for d in cfg["diagnostics"] or []:
            if d not in DIAGNOSTICS:
                raise ConfigError(f"unknown diagnostic '{d}'; choose from: {', '.join(DIAGNOSTICS)}")
        shard = cfg["shard"]
        if shard is not None:
            try:
                i, n = (int(x) for x in str(shard).split("/"))
                assert 0 <= i < n
            except (ValueError, AssertionError):
                raise ConfigError(f"shard must look like i/n with 0 <= i < n, got {shard!r}") from None
            shard = (i, n)
        seed = cfg["seed"]
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"seed must be an integer, got {seed!r}")
        policy = cfg.get("policy")
        for group in ("policy", "task"):  # a user's override of another kind than the YAML's default, named
            complaint = option_kind_error(group, cfg.get(group) or {})
            if complaint:
                raise ConfigError(complaint)
        return cls(model=dict(cfg.get("model") or {}), policy=dict(policy) if policy else None,
                   task=dict(cfg.get("task") or {}), compare=tuple(str(n) for n in cfg["compare"] or ()),
                   budget=budget, block=block, protocol=protocol, seed=seed, scenario=scenario,
                   save_prompts=_flag("save_prompts", cfg["save_prompts"]),
                   overwrite=_flag("overwrite", cfg["overwrite"]), device=str(cfg["device"]),
                   shard=shard, diagnostics=tuple(cfg["diagnostics"] or ()),
                   graded=_flag("graded", cfg["graded"]),
                   progress=_flag("progress", cfg["progress"]), batch_size=batch_size,
                   share=_flag("share", cfg["share"]), share_rows=_share_rows(cfg["share_rows"]),
                   compile=_flag("compile", cfg["compile"]))

    def recorded(self) -> dict[str, Any]:
        """The settings as the run records them (config.yaml; the resume key; metrics): plain values in the
        config's form (the canonical protocol, null for a block the protocol ignores, shard as "i/n")."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "shard":
                v = None if v is None else f"{v[0]}/{v[1]}"
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, Mapping):
                v = dict(v)
            out[f.name] = v
        return out

    def key(self, policy_name: str | None = None) -> str:
        """Resume key: every setting that changes results (model, policy and its name, task, budget, block, shard,
        seed, ...), so predictions are only ever continued under the configuration that produced them."""
        changes = {f.name for f in fields(self) if f.metadata.get("changes_results", True)}
        stable = {k: v for k, v in self.recorded().items() if k in changes}
        if policy_name is not None:
            stable["policy_name"] = policy_name
        return hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def group_key(self) -> str | None:
        """Which runs may share work (kvbench.run.app.run_group): equal keys share model, task, protocol, block,
        scenario, shard and every other setting but the policy and the budget, so they run the same samples, each
        sample's runs together (engine.generate.generate_batch: those whose policies select alike as the rows of one
        cache). None: the run goes alone (share=false)."""
        if not self.share:
            return None
        common = {k: v for k, v in self.recorded().items()
                  if k not in {"policy", "budget", "compare", "overwrite", "progress", "share"}}
        return json.dumps(common, sort_keys=True, default=str)

    def with_policy(self, policy: Mapping[str, Any]) -> RunSettings:
        """These settings with one policy chosen (a `compare` list runs each of its policies so)."""
        return replace(self, policy=dict(policy))


def _share_rows(value: Any) -> bool | str:
    if value not in ("auto", "decode") and not isinstance(value, bool):
        raise ConfigError(f"share_rows must be true, false, decode or auto, got {value!r}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def instantiate(spec: Mapping[str, Any], **extra: Any) -> Any:
    """Build the object a group YAML describes with Hydra's `instantiate`: `_target_` is "module.Class", the other
    keys its arguments (plain lists and dicts: `_convert_="all"`). Hydra wraps whatever the constructor (or the
    import of the target's module) raises in an InstantiationException whose message spans lines; that first error is
    raised instead, so bad input keeps its one-line error (PolicyError, TaskError, a TypeError for an unknown option,
    the ImportError of a module not on the path)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    target = spec.get("_target_")
    if not target:
        raise ConfigError(f"config entry has no _target_: {dict(spec)}")
    try:
        return hydra_instantiate(dict(spec), **extra, _convert_="all")
    except InstantiationException as e:
        cause: BaseException | None = e
        while cause.__cause__ is not None:  # the first error: the constructor's own, or the import of the target's
            cause = cause.__cause__  # module (Hydra wraps that one twice)
        if cause is e:
            raise ConfigError(str(e).splitlines()[0]) from None
        raise cause from None


def build_policy(policy_cfg: Mapping[str, Any], settings: RunSettings) -> Policy:
    try:
        return instantiate(policy_cfg, budget=settings.budget, seed=settings.seed)
    except (TypeError, ValueError) as e:  # an unknown option, or a value the constructor cannot take
        raise PolicyError(str(e)) from None


def policy_class(policy_cfg: Mapping[str, Any]) -> type[Policy]:
    """The class a policy's YAML instantiates (its `_target_`, by Hydra's `get_class`): what it says of all its
    instances, without building one."""
    from hydra.utils import get_class

    return get_class(str(policy_cfg["_target_"]))


def build_task(task_cfg: Mapping[str, Any]) -> Task:
    try:
        return instantiate(task_cfg)
    except (TypeError, ValueError) as e:  # as build_policy's
        raise TaskError(str(e)) from None
