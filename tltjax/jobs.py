"""Job registry: `config.job` names the function that `python -m tltjax.main` runs.

A job is ``fn(config) -> exit_code``. Register one with `register_job`, and import its
implementation inside the function, so that `--help` and config errors stay fast
and one job's heavy imports never load for another::

    @register_job("sft_demo")
    def _sft_demo(config):
        return _import("tltjax.sft_demo").run(config)
"""

from __future__ import annotations

import difflib
import importlib
from types import ModuleType
from typing import Callable

from ml_collections import ConfigDict

from tltjax.config import ConfigError

Job = Callable[[ConfigDict], int]

JOBS: dict[str, Job] = {}


def register_job(name: str) -> Callable[[Job], Job]:
    """Decorator that registers `fn` as the job `name`; names are unique."""

    def decorator(fn: Job) -> Job:
        if name in JOBS:
            raise ValueError(f"job {name!r} is already registered (by {JOBS[name].__module__})")
        JOBS[name] = fn
        return fn

    return decorator


def get_job(name: str) -> Job:
    """The job registered as `name`; a `ConfigError` naming the registered jobs otherwise."""
    if name in JOBS:
        return JOBS[name]
    near = difflib.get_close_matches(name, JOBS, n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    raise ConfigError(f"unknown job config.job={name!r}.{hint} Registered jobs: {', '.join(sorted(JOBS))}.")


def _import(module: str) -> ModuleType:
    """Imports a job's module, with an actionable error if this checkout does not have it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise ConfigError(f"this job needs module {module}, which is not in this installation") from e


@register_job("sft_demo")
def _sft_demo(config: ConfigDict) -> int:
    """Supervised fine-tuning of a tiny model on a toy task, then sample from it."""
    return _import("tltjax.sft_demo").run(config)


@register_job("train_drafter")
def _train_drafter(config: ConfigDict) -> int:
    """Train (or load from the cache) an EAGLE drafter on the tiny policy's own samples."""
    return _import("tltjax.drafter.offline").run(config)


@register_job("rl")
def _rl(config: ConfigDict) -> int:
    """GRPO-family RL with speculative rollouts on the config's task (the tiny policy by default)."""
    return _import("tltjax.rl.trainer").run(config)
