"""Training checkpoints: a pytree of device arrays plus a JSON dict of host state, per step.

One `Checkpointer` per run directory, over `orbax.checkpoint.CheckpointManager`. Each step
directory holds two items: ``state`` (the array pytree: policy and drafter params, optimiser
states, PRNG keys, written with orbax's `StandardSave`, sharding-aware) and ``host`` (a JSON
dict: data position, numpy RNG state, controller state, step).

Atomicity (a process SIGKILLed at any moment leaves a directory that restores):

* orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and, once every file is written,
  puts ``commit_success.txt`` in it and renames it to ``<step>`` (one atomic ``rename``). A
  killed save leaves only the temporary directory, which step listings never count.
* On top of that, a step counts as complete here only if its directory has orbax's commit
  marker and both items (`_is_complete`), so a directory that was, e.g., half removed by
  hand is never offered for restore.
* Pruning (``keep``) renames an old step into ``.trash/`` (atomic) before deleting it, so a
  kill mid-delete never leaves a half-deleted step that looks committed.
* A new `Checkpointer` removes leftover temporary directories, ``.trash/`` and incomplete step
  directories before it does anything else.

Saves are synchronous by default: `save` returns once the step is committed. With
``async_save=True`` the arrays are copied off the device during `save` and written by a
background thread; the commit is the same rename, so a kill loses the in-flight step but
never exposes it half-written. Call `wait` (or `close`) before reading the directory from
another process or before exit.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

_STATE = "state"
_HOST = "host"
_TRASH = ".trash"
_TMP_SUFFIX = ocp.path.step.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp"
_COMMIT_FILE = ocp.path.atomicity_types.COMMIT_SUCCESS_FILE  # "commit_success.txt"


def _is_complete(step_dir: Path) -> bool:
    """True if `step_dir` is a committed step: orbax's commit marker and both items exist."""
    return (
        step_dir.is_dir()
        and step_dir.name.isdigit()
        and (step_dir / _COMMIT_FILE).is_file()
        and (step_dir / _STATE).is_dir()
        and (step_dir / _HOST).is_dir()
    )


def _path_str(path) -> str:
    """``params.layers.0.w`` for a pytree key path (dict keys, indices and attributes alike)."""
    return jax.tree_util.keystr(path, simple=True, separator=".") or "<root>"


def _saved_shape(leaf) -> tuple[int, ...]:
    """The shape `leaf` has on disk: typed PRNG keys are stored as their uint32 key data."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
    return tuple(np.shape(leaf))


def _abstract(leaf):
    """A restore target leaf: arrays become `ShapeDtypeStruct` with the same sharding."""
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf


class Checkpointer:
    """Saves and restores ``(state pytree, host dict)`` per step under `directory`, keeping the
    newest `keep` steps. Every listed step is complete and restorable (see module docstring)."""

    def __init__(self, directory: str | Path, keep: int = 3, *, async_save: bool = False):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (checkpoints to retain), got {keep}")
        self.directory = Path(directory).absolute()
        self.keep = keep
        self.async_save = async_save
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._clean_incomplete()
        # Handlers registered up front, so a fresh process can read item metadata before saving.
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, save_args, restore_args in (
            (_STATE, ocp.args.StandardSave, ocp.args.StandardRestore),
            (_HOST, ocp.args.JsonSave, ocp.args.JsonRestore),
        ):
            registry.add(item, save_args)
            registry.add(item, restore_args)
        self._manager = ocp.CheckpointManager(
            self.directory,
            handler_registry=registry,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                save_interval_steps=1,
                create=True,
                cleanup_tmp_directories=True,
                todelete_subdir=_TRASH,
                enable_async_checkpointing=async_save,
            ),
        )

    # -- listing ---------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if _is_complete(p))

    def latest_step(self) -> int | None:
        """The newest complete step, or None if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- save ------------------------------------------------------------------------------

    def save(self, step: int, state_pytree: Any, host_state: dict, *, force: bool = False) -> None:
        """Writes `state_pytree` (jax/numpy arrays, typed PRNG keys, python scalars) and the
        JSON-able `host_state` as checkpoint `step`, then prunes to the newest `keep` steps.

        Raises if `step` already has a checkpoint, unless ``force=True``, which deletes the old
        one first (a kill between the two leaves the older steps, never a mixed one).
        """
        step = int(step)
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        try:
            host = json.loads(json.dumps(host_state, allow_nan=False))  # validates and snapshots
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"host_state for step {step} must be JSON-serialisable (dicts, lists, str, finite "
                f"numbers): {e}; convert numpy values with .tolist() / int()"
            ) from None
        self.wait()  # a previous async save of this step must land before the existence check
        if (self.directory / str(step)).exists():
            if not force:
                raise FileExistsError(
                    f"checkpoint step {step} already exists in {self.directory}; "
                    "pass force=True to replace it, or save under a new step"
                )
            self._manager.delete(step)
            self._empty_trash()
        self._manager.save(
            step,
            args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardSave(state_pytree), _HOST: ocp.args.JsonSave(host)}
            ),
            force=True,  # the caller decides when to save; no interval policy here
        )
        if not self.async_save:
            self._empty_trash()

    def wait(self) -> None:
        """Blocks until an in-flight async save is committed (a no-op for synchronous saves)."""
        self._manager.wait_until_finished()
        self._empty_trash()

    # -- restore ---------------------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None) -> tuple[Any, dict]:
        """``(state_pytree, host_state)`` of `step` (default: the latest complete step).

        `target` is a pytree like the saved one whose leaves are arrays or
        ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``: arrays are restored with that
        structure, dtype and sharding. Without a target, the saved structure and shardings
        are used (containers such as optax namedtuples come back as dicts/lists).
        """
        self.wait()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(
                    f"no complete checkpoint in {self.directory}; save one first, or start from scratch"
                )
            step = steps[-1]
        elif int(step) not in steps:
            raise FileNotFoundError(
                f"no complete checkpoint for step {step} in {self.directory}; complete steps: {steps}"
            )
        step = int(step)
        if target is None:
            state_args = ocp.args.StandardRestore()
        else:
            target = jax.tree.map(_abstract, target)
            self._check_target(step, target)
            state_args = ocp.args.StandardRestore(target)
        out = self._manager.restore(
            step, args=ocp.args.Composite(**{_STATE: state_args, _HOST: ocp.args.JsonRestore()})
        )
        return out[_STATE], out[_HOST]

    def _check_target(self, step: int, target: Any) -> None:
        """Raises naming every path whose presence or shape differs between step and target."""
        saved = self._manager.item_metadata(step)[_STATE]
        saved = getattr(saved, "tree", saved)
        want = {_path_str(p): _saved_shape(x) for p, x in jax.tree_util.tree_leaves_with_path(target)}
        have = {_path_str(p): tuple(m.shape) for p, m in jax.tree_util.tree_leaves_with_path(saved)}
        problems = [
            f"  {k}: checkpoint has shape {have[k]}, target expects {want[k]}"
            for k in sorted(want.keys() & have.keys())
            if have[k] != want[k]
        ]
        problems += [f"  {k}: in the target but not in the checkpoint" for k in sorted(want.keys() - have.keys())]
        problems += [f"  {k}: in the checkpoint but not in the target" for k in sorted(have.keys() - want.keys())]
        if problems:
            raise ValueError(
                f"checkpoint step {step} in {self.directory} does not match the restore target:\n"
                + "\n".join(problems)
                + "\nbuild the target from the same config that wrote the checkpoint"
            )

    # -- housekeeping ----------------------------------------------------------------------

    def close(self) -> None:
        """Waits for in-flight saves and releases orbax's resources."""
        self.wait()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _empty_trash(self) -> None:
        if jax.process_index() == 0:
            shutil.rmtree(self.directory / _TRASH, ignore_errors=True)

    def _clean_incomplete(self) -> None:
        """Removes what a killed process left: orbax temp dirs, the trash, incomplete steps."""
        self._empty_trash()
        for p in self.directory.iterdir():
            if _TMP_SUFFIX in p.name or (p.is_dir() and p.name.isdigit() and not _is_complete(p)):
                log.warning("removing incomplete checkpoint %s (left by an interrupted save)", p)
                # rename first so a kill during rmtree cannot leave a half-removed step behind
                dead = self.directory / _TRASH / p.name
                dead.parent.mkdir(exist_ok=True)
                p.rename(dead)
        self._empty_trash()
