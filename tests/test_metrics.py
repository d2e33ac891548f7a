"""`tltjax.metrics`: durable JSON lines that survive a cut-short write and resume cleanly,
TensorBoard scalars, optional wandb, aligned tables, valid PNG plots, quiet progress bars."""

import json
import struct
import sys
import types

import numpy as np
import pytest

from tltjax import metrics
from tltjax.metrics import MetricsLogger, Progress, read_metrics, summary_table, write_plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _tb_events(tb_dir):
    """The events in the TensorBoard files under `tb_dir` (TFRecord framing: u64 length, u32
    crc, payload, u32 crc), parsed with tensorboardX's Event proto."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            events.append(Event.FromString(data[pos + 12 : pos + 12 + length]))
            pos += 12 + length + 4
    return events


def _tb_scalars(tb_dir):
    """{tag: [(step, value)]} of the scalars under `tb_dir`."""
    out: dict = {}
    for event in _tb_events(tb_dir):
        for v in event.summary.value:
            out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_jsonl_roundtrip_and_tensorboard_tags(tmp_path):
    """Every log() call is one JSON line with its step, numpy scalars become plain numbers, and
    the TensorBoard event file holds each tag at each step."""
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"reward/mean": 0.25, "accuracy": np.float32(0.5), "response_length/max": np.int64(17)})
        logger.log(2, {"reward/mean": 0.75, "accuracy": 1.0})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "reward/mean": 0.25, "accuracy": 0.5, "response_length/max": 17},
        {"step": 2, "reward/mean": 0.75, "accuracy": 1.0},
    ]
    scalars = _tb_scalars(tmp_path / "tb")
    assert scalars["reward/mean"] == [(1, 0.25), (2, 0.75)]
    assert scalars["accuracy"] == [(1, 0.5), (2, 1.0)]
    assert scalars["response_length/max"] == [(1, 17.0)]


def test_non_scalar_metric_is_rejected_by_name(tmp_path):
    """A value that is not a scalar number raises a TypeError naming the metric and step."""
    with MetricsLogger(tmp_path, tensorboard=False) as logger, pytest.raises(TypeError, match="'bad' at step 3"):
        logger.log(3, {"bad": "text"})


def test_truncated_last_line_is_skipped_and_repaired(tmp_path):
    """A crash mid-write cuts the last line short: read_metrics skips it, a new logger drops it
    before appending, and a malformed line elsewhere is an error naming the line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(3, {"loss": 1.0})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert path.read_text().endswith("}\n")
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON line"):
        read_metrics(path)


def test_resume_drops_later_steps(tmp_path):
    """resume_step=k keeps lines with step <= k (no temp file left) and the resumed run's lines
    follow them; TensorBoard gets a purge marker at k + 1."""
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": float(step)})
    with MetricsLogger(tmp_path, resume_step=3) as logger:
        logger.log(4, {"loss": 40.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0),
    ]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tb"]
    starts = [e.step for e in _tb_events(tmp_path / "tb") if e.HasField("session_log") and e.session_log.status == 1]
    assert starts == [4]  # SessionLog.START at resume_step + 1: TensorBoard hides the old steps 4, 5


def test_wandb_requested_but_missing_warns(tmp_path, monkeypatch):
    """wandb=True without the package installed warns and keeps logging to the other sinks."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.warns(UserWarning, match="wandb package is not installed"):
        logger = MetricsLogger(tmp_path, tensorboard=False, wandb=True)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 1.0}]


def test_wandb_receives_init_kwargs_and_scalars(tmp_path, monkeypatch):
    """With wandb importable, init gets the dict's kwargs (dir defaulting to workdir) and each
    log() reaches run.log at its step."""
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsLogger(tmp_path, tensorboard=False, wandb={"project": "p"}, resume_step=0) as logger:
        logger.log(1, {"loss": 0.5})
    assert calls == [
        ("init", {"project": "p", "dir": str(tmp_path), "resume": "allow"}),
        ("log", {"loss": 0.5}, 1),
        ("finish",),
    ]


def test_summary_table_aligns_columns():
    """Every line has the same width; numbers are right-aligned and strings left-aligned under
    their headers; missing values show as '-'."""
    rows = [
        {"name": "plain", "tok/s": 1234.5678, "accept": None},
        {"name": "speculative-k4", "tok/s": 98.0, "accept": 3},
    ]
    table = summary_table(rows, ["name", "tok/s", "accept"])
    lines = table.split("\n")
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    assert lines[0].startswith("name ") and lines[2].startswith("plain ") and lines[3].startswith("speculative-k4")
    assert lines[2].rstrip().endswith("-") and lines[3].endswith("3")
    end = lines[0].index("tok/s") + len("tok/s")
    assert lines[2][:end].endswith("1235") and lines[3][:end].endswith("98")
    assert set(lines[1].replace(" ", "")) == {"-"}


def _records():
    rng = np.random.default_rng(0)
    out = []
    for step in range(1, 9):
        out.append({
            "step": step, "reward/mean": 0.1 * step, "reward/std": 0.05, "accuracy": 0.1 * step,
            "response_length/mean": 100.0 + step, "response_length/p90": 150.0, "response_length/max": 200,
            "rollout/accept_length": 2.0 + 0.1 * step,
            "time/rollout_plain": 1.0, "time/rollout_spec": float(rng.uniform(0.5, 1)), "time/reward": 0.1,
            "time/update": 0.5, "time/drafter": 0.2, "time/logprob_check": 0.05,
        })  # fmt: skip
    return out


def test_write_plots_writes_valid_pngs(tmp_path):
    """All four plots are written as PNG files over 1 KB."""
    paths = write_plots(_records(), tmp_path / "plots", lengths=[10, 20, 20, 35, 80])
    names = ["accept_length.png", "response_length.png", "reward.png", "time_breakdown.png"]
    assert sorted(p.name for p in paths) == names
    for p in paths:
        data = p.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1024, p


def test_write_plots_skips_absent_keys(tmp_path):
    """Only plots whose keys are present are written: accuracy alone gives reward.png only."""
    paths = write_plots([{"step": 1, "accuracy": 0.5}, {"step": 2, "accuracy": 0.7}], tmp_path)
    assert [p.name for p in paths] == ["reward.png"]
    assert write_plots([{"step": 1, "loss": 1.0}], tmp_path / "none") == []


def test_progress_disabled_is_silent(capsys):
    """enabled=False (and a non-TTY stderr, as under pytest) prints nothing; update takes postfix."""
    for enabled in (False, True):
        with Progress(total=3, desc="rollout", enabled=enabled) as bar:
            bar.update(1, loss=0.123456, accept=3)
            bar.update(2)
    assert capsys.readouterr().err == ""



def test_moving_average_and_trend_on_hand_made_series():
    steps, means = metrics.moving_average([1, 2, 3, 4], [0.0, 1.0, 2.0, 6.0], window=2)
    assert steps == [2, 3, 4] and means == [0.5, 1.5, 4.0]
    assert metrics.moving_average([1, 2], [1.0, 2.0], window=3) == ([], [])
    with pytest.raises(ValueError, match="window"):
        metrics.moving_average([1], [1.0], window=0)
    t = metrics.trend([0.1, 0.2, 0.3, 0.4, 0.5])  # odd length: the middle value is in neither half
    assert t["first_half"] == pytest.approx(0.15) and t["second_half"] == pytest.approx(0.45)
    assert t["slope_per_step"] == pytest.approx(0.1)
    assert metrics.trend([0.3, 0.3, 0.3])["slope_per_step"] == pytest.approx(0.0, abs=1e-12)
    assert np.isnan(metrics.trend([0.5])["slope_per_step"])
