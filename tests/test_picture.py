"""memsave.picture: a report's live memory over the step, as text and as a PNG, drawn
from the memory model's timelines (memsave.planner.curves)."""

import sys

import pytest
import tensorflow as tf

import memsave
from _models import tanh_mlp_loss
from memsave.planner import curves

DEPTH, WIDTH, BATCH = 12, 128, 256


def _report(checkpoints="memory"):
    weights = [tf.Variable(tf.random.normal([WIDTH, WIDTH], stddev=0.1)) for _ in range(DEPTH)]

    @tf.function
    def step(x):
        return memsave.gradients(tanh_mlp_loss(x, weights), weights, checkpoints=checkpoints)

    step(tf.ones([BATCH, WIDTH]))
    return memsave.last_report()


@pytest.mark.planner_fallback
def test_the_curves_are_the_models_timelines_with_their_peaks_and_phases():
    report = _report()
    assert report.fallback is None
    plan, baseline = report.memory_curve, report.baseline_curve
    assert plan.peak_bytes == max(plan.live_bytes) == report.predicted_live_bytes
    assert baseline.peak_bytes == max(baseline.live_bytes) >= report.baseline_peak_bytes * 0.99
    assert plan.peak_bytes < baseline.peak_bytes
    names = [name for _, name in plan.phases]
    assert names[0] == "forward" and "backward" in [n for _, n in baseline.phases]
    segments = [n for n in names if n.startswith("segment ")]
    assert segments == [f"segment {k + 1}" for k in range(report.predicted_segments)]
    assert [point for point, _ in plan.phases] == sorted(point for point, _ in plan.phases)
    assert report.peak_at.startswith(plan.peak_at.split(",")[0]) or (
        report.predicted_peak_bytes != report.predicted_live_bytes)  # (an allocator's own)
    assert plan.largest_at_peak and all(nbytes > 0 for nbytes, _ in plan.largest_at_peak)
    assert len(plan.live_bytes) <= curves.MAX_POINTS


def test_a_long_timeline_keeps_its_peak_when_sampled():
    live = [1] * 1000
    live[777] = 50
    labels = [("forward", 0, None)] * 500 + [("backward", 0, 3)] * 500
    curve = curves.of_timeline(live, labels, "somewhere", [], points=100)
    assert len(curve.live_bytes) == 100 and max(curve.live_bytes) == 50 == curve.peak_bytes
    assert curve.phases == ((0, "forward"), (50, "segment 4"))


@pytest.mark.planner_fallback
def test_the_text_picture_draws_both_curves_the_limit_and_the_peaks():
    report = _report()
    text = report.picture(width=60, height=10, limit="1MiB")
    lines = text.splitlines()
    assert lines[0].startswith("memsave: live memory over the step") and "limit 1.0 MiB" in text
    chart = [line for line in lines if " MiB |" in line]
    assert len(chart) == 10 and all(len(line.split(" MiB |", 1)[1]) == 60 for line in chart)
    assert any("#" in line for line in chart) and any("." in line for line in chart)
    assert any("-" in line.split(" MiB |", 1)[1] for line in chart)
    assert "|forward" in text
    assert f"memsave's plan: peak {report.memory_curve.peak_bytes / 2**20:.1f} MiB of live" in text
    assert f"tf.gradients: peak {report.baseline_curve.peak_bytes / 2**20:.1f} MiB of live" in text


@pytest.mark.planner_fallback
def test_where_plain_tf_gradients_answers_the_plan_is_its_curve():
    report = _report(checkpoints="speed")  # (a step this small: nothing worth recomputing)
    if report.fallback is None:
        pytest.skip("'speed' rewrote this step")
    assert report.memory_curve is report.baseline_curve
    assert "memsave's plan: peak" in report.picture()


def test_a_report_without_a_timeline_says_why(monkeypatch):
    report = memsave.RewriteReport(strategy="memory", region_ops=0, fallback="eager")
    with pytest.raises(memsave.MemsaveError, match="no memory timeline"):
        report.picture()


def test_the_png_is_written_or_names_the_extra(tmp_path, monkeypatch):
    report = _report()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(memsave.MemsaveError, match=r"memsave\[bench\]"):
            report.save_picture(str(tmp_path / "step.png"))
        return
    path = report.save_picture(str(tmp_path / "step.png"), limit=2**20)
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # (as if not installed)
    with pytest.raises(memsave.MemsaveError, match=r"memsave\[bench\]"):
        report.save_picture(str(tmp_path / "again.png"))
