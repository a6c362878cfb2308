"""The run settings: parsed and validated once from a resolved config into one `RunSettings`, which every later
step (the run loop, run directories, metrics.json, the report) reads instead of parsing the config again; and the
objects a config's `_target_` entries describe (policy, task).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from kvbench.engine.diagnostics import NAMES as DIAGNOSTICS
from kvbench.engine.generate import SCENARIOS, resolve_protocol
from kvbench.policies.base import Policy, PolicyError, positive_int
from kvbench.tasks.base import Task, TaskError


class ConfigError(ValueError):
    """A top-level setting with a bad value."""


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input (reported as one line), as opposed to bugs (reported with a traceback)."""
    from omegaconf.errors import OmegaConfBaseException

    from kvbench.models.common import ModelError

    return (TaskError, PolicyError, ModelError, OmegaConfBaseException, ConfigError)


@dataclass(frozen=True)
class RunSettings:
    """What a run does, beyond which model, policy and task: parsed once by `from_config`."""

    budget: int | None
    block: int | None  # None: the prompt goes in one forward (the protocol says so, or B = inf)
    scenario: str = "question_aware"
    protocol: str = "blockwise"
    save_prompts: bool = False
    shard: tuple[int, int] | None = None  # (i, n): samples with index % n == i
    diagnostics: tuple[str, ...] = ()
    seed: int = 0
    graded: bool = True  # measure the graded score (answer_logprob): one teacher-forced branch per sample

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RunSettings:
        """Validate the top-level settings of a resolved config; ConfigError (one line) on a bad value."""
        try:
            block = positive_int("block", cfg.get("block"), allow_none=True)
            budget = cfg.get("budget")
            budget = None if budget is None else positive_int("budget", budget)  # null: the full cache's
            protocol, block = resolve_protocol(cfg.get("protocol", "blockwise"), block)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        scenario = cfg.get("scenario", "question_aware")
        if scenario not in SCENARIOS:
            raise ConfigError(f"unknown scenario '{scenario}'; choose one of: {', '.join(SCENARIOS)}")
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
        return cls(budget=budget, block=block, protocol=protocol, scenario=scenario,
                   save_prompts=bool(cfg.get("save_prompts")), shard=shard,
                   diagnostics=tuple(cfg.get("diagnostics") or ()), seed=int(cfg.get("seed", 0)),
                   graded=_flag("graded", cfg.get("graded", True)))

    def recorded(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """`cfg` as the run records it (config.yaml, resume key, metrics): the canonical protocol, and null for a
        block the protocol ignores."""
        return dict(cfg, protocol=self.protocol, block=self.block)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def instantiate(spec: dict[str, Any], **extra: Any) -> Any:
    """Build the object a group YAML describes: `_target_` is "module.Class", the other keys its arguments."""
    spec = dict(spec)
    target = spec.pop("_target_", None)
    if not target:
        raise ConfigError(f"config entry has no _target_: {spec}")
    module, _, cls = target.rpartition(".")
    return getattr(importlib.import_module(module), cls)(**spec, **extra)


def build_policy(policy_cfg: dict[str, Any], settings: RunSettings) -> Policy:
    try:
        return instantiate(policy_cfg, budget=settings.budget, seed=settings.seed)
    except TypeError as e:  # unknown option passed to the policy's constructor
        raise PolicyError(str(e)) from None


def build_task(task_cfg: dict[str, Any]) -> Task:
    try:
        return instantiate(task_cfg)
    except TypeError as e:
        raise TaskError(str(e)) from None
