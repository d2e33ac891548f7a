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


def _spot_training():
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))  # spot_training.py imports common as a sibling module
    try:
        spec = importlib.util.spec_from_file_location("bench_spot_training", REPO / "benchmarks" / "spot_training.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module


def test_free_device_emulation_runs_real_updates_first_then_sleeps_as_long():
    """--emulate-free-devices: the first update of a mesh size runs the program (timed), later ones sleep
    for that time without running it and hand back the state unchanged; sizes calibrate apart."""
    import time
    import types

    ran = []

    def program(state, target, batch):
        ran.append(batch)
        time.sleep(0.05)
        return state + 1, {"loss": float(batch)}

    spot = types.SimpleNamespace(programs=types.SimpleNamespace(get=lambda devices: program if devices else None))
    emu = _spot_training().FreeDeviceEmulation(spot, calibrate=1)
    assert spot.programs.get(()) is None  # no program for these devices: none to emulate either
    state, m = spot.programs.get(("d0",))(0, None, 7)
    assert (state, m, ran) == (1, {"loss": 7.0}, [7])
    t0 = time.perf_counter()
    state, m = spot.programs.get(("d0",))(state, None, 8)
    slept = time.perf_counter() - t0
    assert (state, m, ran) == (1, {"loss": 7.0}, [7])  # not run: the last real metrics, the state as given
    assert 0.04 <= slept < 0.5
    spot.programs.get(("d0", "d1"))(state, None, 9)  # a new size: real again
    assert ran == [7, 9]
    s = emu.summary()
    assert s["real_updates"] == 2 and s["emulated_updates"] == 1 and set(s["update_s"]) == {"1", "2"}
    with pytest.raises(ValueError):
        _spot_training().FreeDeviceEmulation(spot, calibrate=0)
