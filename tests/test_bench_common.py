"""benchmarks/common.py: the host-parallelism probe that spot_training.py reports."""

import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _common():
    spec = importlib.util.spec_from_file_location("bench_common", REPO / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_host_parallelism_measures_between_one_core_and_one_per_worker():
    """Two single-threaded probe processes: each timed alone and together. Together they run at most
    as fast as on a core each (effective cores <= 2, with timing slack) and at least as fast as
    taking turns on one core (>= 1, with slack for a loaded machine)."""
    result = _common().host_parallelism(workers=2, reps=10)
    assert result["workers"] == 2 and len(result["together_s"]) == 2
    assert result["alone_s"] > 0 and all(t > 0 for t in result["together_s"])
    assert 0.6 < result["effective_cores"] < 2.6, result


def test_effective_cores_counts_the_slowdown_of_running_together():
    """A core each: no slowdown, as many cores as copies; one core shared by all: one; between."""
    common = _common()
    assert common.effective_cores(1.0, [1.0, 1.0, 1.0, 1.0]) == pytest.approx(4.0)
    assert common.effective_cores(0.5, [1.0, 1.0]) == pytest.approx(1.0)
    assert common.effective_cores(0.3, [0.48, 0.52]) == pytest.approx(1.2)


@pytest.mark.parametrize("workers,reps", [(0, 10), (2, 0), (1.5, 10)])
def test_host_parallelism_rejects_counts_below_one(workers, reps):
    with pytest.raises(ValueError, match="whole numbers >= 1"):
        _common().host_parallelism(workers=workers, reps=reps)
