"""Measured peak memory of memsave against tf.gradients (issue 3's targets).

Every configuration runs in its own process with the CPU BFC allocator on
(memsave.measure.run_isolated), so peaks never mix.
"""

import os

import pytest

from memsave.measure import run_isolated

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def measure(case, **kwargs):
    return run_isolated(f"_memory_cases:{case}", env={"PYTHONPATH": TESTS_DIR}, **kwargs)


@pytest.fixture(scope="module")
def chain_baseline():
    return measure("chain", mode="tf")


@pytest.mark.parametrize("mode", ["memory", "listed"])
def test_chain_of_100_tanh_peaks_at_most_a_quarter(chain_baseline, mode):
    got = measure("chain", mode=mode)
    ratio = got["peak_mb"] / chain_baseline["peak_mb"]
    assert chain_baseline["peak_mb"] > 90, chain_baseline  # 100 x 1 MB activations
    assert ratio <= 0.25, f"{mode}: {got['peak_mb']:.1f} MB vs {chain_baseline['peak_mb']:.1f} MB"
    assert got["checksum"] == pytest.approx(chain_baseline["checksum"], rel=1e-5)


def test_resnet_like_chain_of_100_blocks_peaks_at_most_30_percent():
    baseline = measure("chain", mode="tf", residual=True)
    got = measure("chain", mode="memory", residual=True)
    ratio = got["peak_mb"] / baseline["peak_mb"]
    assert ratio <= 0.30, f"{got['peak_mb']:.1f} MB vs {baseline['peak_mb']:.1f} MB"
    assert got["checksum"] == pytest.approx(baseline["checksum"], rel=1e-5)


def test_deep_mlp_in_tf_function_peaks_at_most_half():
    baseline = measure("deep_mlp", mode="tf")
    got = measure("deep_mlp", mode="memory")
    ratio = got["peak_mb"] / baseline["peak_mb"]
    assert ratio <= 0.50, f"{got['peak_mb']:.1f} MB vs {baseline['peak_mb']:.1f} MB"
    assert got["checksum"] == pytest.approx(baseline["checksum"], rel=1e-4)
