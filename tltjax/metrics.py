"""The one logging path for training runs: metrics to JSON lines, TensorBoard and (optionally)
Weights & Biases; plain-text tables, PNG plots and progress bars built on the same records.

``workdir/metrics.jsonl`` is the source of truth: one ``{"step": ..., name: value}`` object
per `MetricsLogger.log` call, fsynced before `log` returns, so a crash loses nothing already
logged and at most cuts the last line short (which `read_metrics` skips).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file, in order. A last line cut short by a crash is
    skipped; a malformed line anywhere else raises ValueError naming the line."""
    path = Path(path)
    lines = path.read_text().split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # no newline after it: the write was interrupted
                break
            raise ValueError(
                f"{path}:{i + 1} is not a JSON line ({e}); only the last line may be cut short by a "
                "crash, so this file was edited or written by something else"
            ) from None
    return records


def _write_jsonl_atomically(path: Path, records: Sequence[Mapping]) -> None:
    """Replaces `path` with `records`, one per line, via a fsynced temp file and os.replace."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _number(step: int, name: str, value: Any) -> int | float:
    """`value` as a python int or float (numpy / jax scalars included)."""
    if hasattr(value, "item") and np.size(value) == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"metric {name!r} at step {step} is {value!r} ({type(value).__name__}); log a scalar number")
    return value if isinstance(value, int) else float(value)


class MetricsLogger:
    """Writes each step's scalar metrics to ``workdir/metrics.jsonl`` (fsynced), TensorBoard
    (``workdir/tb``, via tensorboardX) and, when asked and installed, Weights & Biases.

    ``resume_step=k`` resumes a run from its step-k checkpoint: metrics.jsonl keeps only lines
    with step <= k (rewritten atomically) and TensorBoard purges events after k. Without it,
    new lines are appended. ``wandb`` is True or a dict of `wandb.init` keyword arguments.
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        tensorboard: bool = True,
        wandb: bool | dict = False,
        resume_step: int | None = None,
    ):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / METRICS_FILE
        if self.path.exists():
            text = self.path.read_text()
            if resume_step is not None or (text and not text.endswith("\n")):
                kept = [r for r in read_metrics(self.path) if resume_step is None or r.get("step", 0) <= resume_step]
                _write_jsonl_atomically(self.path, kept)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(logdir=str(self.workdir / TB_DIR), purge_step=purge)
        self._wandb = None
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                warnings.warn(
                    "wandb logging was requested but the wandb package is not installed; "
                    "`pip install wandb` or pass wandb=False. Logging to metrics.jsonl and TensorBoard only.",
                    stacklevel=2,
                )
            else:
                kwargs = dict(wandb) if isinstance(wandb, Mapping) else {}
                kwargs.setdefault("dir", str(self.workdir))
                if resume_step is not None:
                    kwargs.setdefault("resume", "allow")
                self._wandb = wandb_lib.init(**kwargs)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records `metrics` (name -> scalar) at `step` in every sink; durable on return."""
        step = int(step)
        values = {name: _number(step, name, v) for name, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for name, v in values.items():
                self._tb.add_scalar(name, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        """Flushes and closes every sink; safe to call twice."""
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def summary_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """`rows` as an aligned plain-text table of `columns`: a header, a rule, one line per row.
    Numeric columns are right-aligned, floats shown to 4 significant digits, missing as ``-``."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    def is_number(v):
        return isinstance(v, numbers.Real) and not isinstance(v, bool)

    numeric = [all(is_number(row[c]) for row in rows if row.get(c) is not None) for c in columns]
    widths = [max([len(c)] + [len(r[j]) for r in cells]) for j, c in enumerate(columns)]

    def line(items):
        return "  ".join(s.rjust(w) if num else s.ljust(w) for s, w, num in zip(items, widths, numeric))

    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _series(records: Sequence[Mapping], key: str) -> tuple[list, list]:
    """(steps, values) of the records that have a finite number under `key`."""
    steps, values = [], []
    for i, r in enumerate(records):
        v = r.get(key)
        if isinstance(v, numbers.Real) and math.isfinite(v):
            steps.append(r.get("step", i))
            values.append(float(v))
    return steps, values


def moving_average(steps: Sequence, values: Sequence, window: int) -> tuple[list, list[float]]:
    """(steps, means) of each run of `window` consecutive `values`, placed at the run's last step."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if len(values) < window:
        return [], []
    v = np.asarray(values, np.float64)
    means = np.convolve(v, np.ones(window) / window, mode="valid")
    return list(steps[window - 1 :]), [float(m) for m in means]


def trend(values: Sequence[float]) -> dict[str, float]:
    """How a per-step series moved: means of its first and second halves and its least-squares slope per step."""
    v = np.asarray(values, np.float64)
    if len(v) < 2:
        return {"first_half": float("nan"), "second_half": float("nan"), "slope_per_step": float("nan")}
    half = len(v) // 2
    slope = float(np.polyfit(np.arange(len(v)), v, 1)[0])
    return {"first_half": float(v[:half].mean()), "second_half": float(v[len(v) - half :].mean()), "slope_per_step": slope}


def write_plots(
    records: Sequence[Mapping], out_dir: str | Path, *, lengths: Sequence[int] | None = None
) -> list[Path]:
    """PNG plots of training `records` (as from `read_metrics`) in `out_dir`; a plot whose keys
    are all absent is skipped. Returns the paths written, from:

    * reward.png: "reward/mean" with a ±"reward/std" band and its moving average over 5 steps
      (a step's prompts differ in difficulty: the average shows the trend), and "accuracy", vs step;
    * response_length.png: a histogram of `lengths`, and "response_length/{mean,p90,max}" vs step;
    * accept_length.png: "rollout/accept_length" vs step;
    * time_breakdown.png: stacked bars of every "time/..." key per step.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig, name):
        FigureCanvasAgg(fig)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        written.append(path)

    def panels(n):
        fig = Figure(figsize=(5.5 * n, 4))
        return fig, [fig.add_subplot(1, n, i + 1) for i in range(n)]

    # reward.png
    reward, accuracy = _series(records, "reward/mean"), _series(records, "accuracy")
    drawn = [s for s in (reward, accuracy) if s[0]]
    if drawn:
        fig, axes = panels(len(drawn))
        ax = iter(axes)
        if reward[0]:
            a = next(ax)
            a.plot(*reward, label="mean")
            std = dict(zip(*_series(records, "reward/std")))
            band = [(s, m, std[s]) for s, m in zip(*reward) if s in std]
            if band:
                s, m, d = map(np.asarray, zip(*band))
                a.fill_between(s, m - d, m + d, alpha=0.3, label="± std")
            steps, means = moving_average(*reward, window=5)
            if len(steps) > 1:
                a.plot(steps, means, color="black", label="moving average (5 steps)")
            a.set(title="reward", xlabel="step")
            a.legend()
        if accuracy[0]:
            a = next(ax)
            a.plot(*accuracy, color="tab:green")
            a.set(title="accuracy", xlabel="step", ylim=(0, 1.02))
        save(fig, "reward.png")

    # response_length.png
    per_step = {k: _series(records, f"response_length/{k}") for k in ("mean", "p90", "max")}
    per_step = {k: s for k, s in per_step.items() if s[0]}
    has_hist = lengths is not None and len(lengths) > 0
    if has_hist or per_step:
        fig, axes = panels(int(has_hist) + int(bool(per_step)))
        ax = iter(axes)
        if has_hist:
            a = next(ax)
            a.hist(np.asarray(lengths), bins=min(50, max(1, len(set(lengths)))))
            a.set(title="response length", xlabel="tokens", ylabel="responses")
        if per_step:
            a = next(ax)
            for k, s in per_step.items():
                a.plot(*s, label=k)
            a.set(title="response length per step", xlabel="step", ylabel="tokens")
            a.legend()
        save(fig, "response_length.png")

    # accept_length.png
    accept = _series(records, "rollout/accept_length")
    if accept[0]:
        fig, (a,) = panels(1)
        a.plot(*accept)
        a.set(title="speculative decoding: mean accept length", xlabel="step", ylabel="tokens / verify")
        save(fig, "accept_length.png")

    # time_breakdown.png
    keys = list(dict.fromkeys(k for r in records for k in r if k.startswith("time/")))
    timed = [(r.get("step", i), r) for i, r in enumerate(records) if any(k in r for k in keys)]
    if timed:
        fig = Figure(figsize=(7.5, 4))
        a = fig.add_subplot()
        steps = np.asarray([s for s, _ in timed], dtype=float)
        width = 0.8 * (float(np.min(np.diff(np.unique(steps)))) if len(np.unique(steps)) > 1 else 1.0)
        bottom = np.zeros(len(timed))
        for k in keys:
            v = np.asarray([float(r.get(k) or 0.0) for _, r in timed])
            a.bar(steps, v, width=width, bottom=bottom, label=k.removeprefix("time/"))
            bottom += v
        a.set(title="time per step", xlabel="step", ylabel="seconds")
        a.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        save(fig, "time_breakdown.png")
    return written


class Progress:
    """A tqdm progress bar (per training step, or per rollout with ``leave=False``), shown only
    when `enabled` and stderr is a terminal."""

    def __init__(
        self,
        total: int | None = None,
        desc: str = "",
        *,
        enabled: bool = True,
        unit: str = "step",
        leave: bool = True,
        position: int | None = None,
    ):
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            leave=leave,
            position=position,
            dynamic_ncols=True,
            file=sys.stderr,
            disable=None if enabled else True,  # None: tqdm disables itself off a TTY
        )

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advances by `n`; `postfix` (e.g. ``loss=0.3``) is shown after the bar."""
        if postfix:
            self._bar.set_postfix({k: _cell(v) for k, v in postfix.items()}, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
