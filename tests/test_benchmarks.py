"""The benchmark's parts work, on tiny configurations (no timings are asserted).

Three configurations run in child processes (two for the comparison, one for the
out-of-memory sweep); everything else runs here.
"""

import csv
import dataclasses
import math
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import (  # noqa: E402
    bench_rewrite_time, capacity, compare, graph_kinds, models, peak_breakdown, step_peaks,
    time_breakdown)
import memsave  # noqa: E402
from memsave import environment as environment_lib, measure  # noqa: E402
from memsave.planner import search  # noqa: E402

TINY = {
    "cnn": {"depth": 2, "batch": 2, "image_size": 8},
    "mlp": {"depth": 3, "batch": 4, "width": 8},
    "calls": {"depth": 3, "batch": 4, "width": 8},
    "transformer": {"depth": 2, "batch": 2, "seq_len": 8, "d_model": 16, "heads": 2, "d_ff": 16,
                    "vocab": 20},
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_model_step_gives_one_gradient_per_variable(name):
    model = models.build_model(name, seed=3, **TINY[name])
    step = model.make_step(lambda ys, xs: tf.gradients(ys, xs))
    loss, grads = step(*model.inputs)
    assert math.isfinite(float(loss))
    assert len(grads) == len(model.variables)
    assert all(g is not None for g in grads)
    assert len(model.block_outputs) == TINY[name]["depth"]
    graph = step.get_concrete_function(*model.inputs).graph
    assert graph.get_collection("checkpoints"), "marking models mark checkpoints for 'collection'"
    assert model.marks_checkpoints
    assert name in compare.MARKING_MODELS


def test_models_are_seeded_identically():
    first = models.build_model("mlp", seed=5, **TINY["mlp"])
    second = models.build_model("mlp", seed=5, **TINY["mlp"])
    for a, b in zip(first.variables, second.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(first.inputs[0], second.inputs[0])


def test_keras_application_model_builds_without_download():
    model = models.build_model("keras", batch=2, app="MobileNetV3Small", image_size=32)
    assert not model.marks_checkpoints and "keras" not in compare.MARKING_MODELS
    assert len(model.variables) > 50
    assert all(isinstance(v, tf.Variable) for v in model.variables)
    assert math.isfinite(float(model.loss(*model.inputs)))


KERAS_TINY = {
    "vit": {"depth": 2, "batch": 2, "image_size": 16, "patch": 8, "d_model": 8, "heads": 2},
    "gpt": {"depth": 2, "batch": 2, "seq_len": 6, "d_model": 8, "heads": 2, "vocab": 30},
    "lstm": {"depth": 2, "batch": 2, "seq_len": 5, "units": 4, "features": 3},
    "unet": {"depth": 2, "batch": 2, "image_size": 8, "base": 2, "classes": 3},
}


@pytest.mark.parametrize("name", sorted(KERAS_TINY))
def test_keras_layer_models_step_with_tf_gradients(name):
    model = models.build_model(name, seed=1, **KERAS_TINY[name])
    step = model.make_step(lambda ys, xs: tf.gradients(ys, xs))
    loss, grads = step(*model.inputs)
    assert math.isfinite(float(loss)) and len(grads) == len(model.variables)
    assert all(g is not None for g in grads)
    assert name in compare.KERAS_MODELS and name not in compare.MARKING_MODELS


def test_keras_hub_gpt2_steps_where_keras_hub_is_installed_and_names_it_where_not():
    try:
        import keras_hub  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install keras-hub"):
            models.build_model("gpt2", **KERAS_TINY["gpt"])
        return
    model = models.build_model("gpt2", seed=1, **KERAS_TINY["gpt"])
    step = model.make_step(lambda ys, xs: tf.gradients(ys, xs))
    loss, grads = step(*model.inputs)
    assert math.isfinite(float(loss)) and len(grads) == len(model.variables)
    assert "GPT2CausalLM: 2 layers" in model.description


@pytest.mark.parametrize("strategy, words", [("memory+chunk:3", "in chunks of 3"),
                                              ("memory+chunk:2", "in chunks of 2")])
def test_a_strategy_with_a_loop_chunk_recomputes_the_loops_in_chunks(strategy, words):
    """'S+chunk:K' (compare.py, peak_breakdown.py): S under
    memsave.recompute_loops('auto', chunk=K)."""
    import memsave

    model = models.build_model("lstm", seed=1, **KERAS_TINY["lstm"])
    grad_fn, _ = compare._strategy_gradient_fn(strategy, model)
    with memsave.always_rewrite(), memsave.recompute_loops("always"):
        model.make_step(grad_fn)(*model.inputs)
    loops = memsave.last_report().loops
    assert len(loops) == 2 and all(words in why for _, why in loops), loops


@pytest.mark.parametrize("strategy", ["tf.gradients", "memory"])
def test_step_peaks_reads_each_steps_peak_and_the_prediction(strategy):
    result = measure.run_isolated(step_peaks.CHILD_TARGET, timeout=300, model="mlp",
                                  strategy=strategy, steps=2, model_options=TINY["mlp"])
    assert len(result["peaks"]) == 2 and all(peak > 0 for peak in result["peaks"])
    assert result["predicted"] > 0


def test_a_keras_model_under_mixed_bfloat16_restores_the_policy():
    from keras.src.backend.common import global_state

    before = global_state.get_global_attribute("dtype_policy", None)
    model = models.build_model("vit", seed=1, mixed_precision="bfloat16", **KERAS_TINY["vit"])
    assert global_state.get_global_attribute("dtype_policy", None) is before  # (unset stays so)
    assert "mixed_bfloat16" in model.description
    dtypes = {op.outputs[0].dtype for op in model.make_step(
        lambda ys, xs: tf.gradients(ys, xs)).get_concrete_function(
            *model.inputs).graph.get_operations() if op.type == "MatMul"}
    assert tf.bfloat16 in dtypes
    with pytest.raises(ValueError, match="mixed_precision='half'"):
        models.build_model("vit", mixed_precision="half", **KERAS_TINY["vit"])


def test_compare_mirrors_the_model_lists():
    assert compare.MODELS == models.MODELS
    assert compare.KERAS_MODELS == models.KERAS_MODELS
    assert compare.MIXED_PRECISION == models.MIXED_PRECISION
    assert set(compare.DEFAULT_SWEEP_DEPTHS) == set(models.MODELS)
    assert set(compare.MARKING_MODELS) <= set(models.MODELS)


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="unknown model"):
        models.build_model("vgg")


def _read_csv(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_compare_runs_two_strategies_end_to_end(tmp_path, capsys):
    csv_path, md_path = tmp_path / "out.csv", tmp_path / "out.md"
    code = compare.main(["--model", "mlp", "--depth", "4", "--batch", "64", "--steps", "1",
                         "--warmup", "0", "--strategies", "tf.gradients,memory", "--csv",
                         str(csv_path), "--markdown", str(md_path), "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("strategy"))
    for column in ("peak MiB", "x tf", "predicted MiB", "pred err", "step ms", "pred x",
                   "max rel err", "build s"):
        assert column in header
    rows = _read_csv(csv_path)
    assert [row["strategy"] for row in rows] == ["tf.gradients", "memory"]
    for row in rows:
        assert row["status"] == "ok", row["message"]
        assert float(row["peak_mb"]) > 0 and float(row["step_ms"]) > 0
        assert float(row["grad_build_s"]) > 0
        assert float(row["predicted_mb"]) > 0
    assert float(rows[0]["peak_ratio"]) == 1.0
    assert float(rows[1]["max_rel_err"]) <= 1e-4
    assert float(rows[1]["predicted_time_ratio"]) >= 1.0  # ('memory' recomputes)
    markdown = md_path.read_text(encoding="utf-8")
    assert "| strategy | peak MiB |" in markdown and "| memory |" in markdown


def test_compare_runs_tape_configs_and_refuses_remat_off_keras(tmp_path, capsys):
    """'tape:S' and 'patched-tape:S' record the step on a tape (memsave's, or
    tf.GradientTape under memsave.patch); 'remat:MODE' needs Keras layers."""
    csv_path = tmp_path / "out.csv"
    code = compare.main(["--model", "mlp", "--depth", "4", "--batch", "64", "--steps", "1",
                         "--warmup", "0", "--strategies",
                         "tf.gradients,tape:memory,patched-tape:memory,remat:activations",
                         "--csv", str(csv_path), "--quiet"])
    assert code == 0
    rows = {row["strategy"]: row for row in _read_csv(csv_path)}
    for name in ("tape:memory", "patched-tape:memory"):
        assert rows[name]["status"] == "ok", rows[name]["message"]
        assert float(rows[name]["max_rel_err"]) <= 1e-4
    assert rows["remat:activations"]["status"] != "ok"
    assert "--model keras" in rows["remat:activations"]["message"]
    assert "vit" in rows["remat:activations"]["message"]


def test_predict_table_lists_measured_and_predicted_peaks():
    families = [("tiny MLP", "mlp", 4, 64, {}), ("tiny transformer", "transformer", 2, 2,
                                                 {"seq_len": 8, "d_model": 16, "heads": 2,
                                                  "d_ff": 16, "vocab": 20})]
    rows = compare.predict_table(families, strategies=("tf.gradients", "memory"))
    assert [(row["family"], row["strategy"]) for row in rows] == [
        ("tiny MLP", "tf.gradients"), ("tiny MLP", "memory"),
        ("tiny transformer", "tf.gradients"), ("tiny transformer", "memory")]
    for row in rows:
        assert row["status"] == "ok", row["message"]
        assert row["peak_mb"] > 0 and row["predicted_mb"] > 0
        assert row["predicted_error"] == pytest.approx(row["predicted_mb"] / row["peak_mb"] - 1)
    text = compare.format_predict_table(rows)
    assert text.splitlines()[0].split() == ["model", "strategy", "measured", "MiB", "predicted",
                                            "MiB", "error", "range", "MiB", "range", "error"]
    assert all(row["predicted_range"] is None for row in rows)  # (no loops: no range)
    markdown = compare.format_predict_table(rows, markdown=True)
    assert markdown.count("| tiny MLP |") == 2
    assert {name for name, *_ in compare.PREDICT_FAMILIES} >= {"ViT (Keras layers)",
                                                             "2 x Keras LSTM(256)"}


def test_a_predicted_range_misses_by_the_nearer_end():
    """A step whose peak TensorFlow's gradient loops move (the report's range): the
    predict table counts a measured peak within the range as met, else the error of the
    nearer end."""
    assert compare._range_error(113.1, 112.1, 153.3) == 0.0
    assert compare._range_error(100.0, 110.0, 150.0) == pytest.approx(0.10)
    assert compare._range_error(200.0, 110.0, 150.0) == pytest.approx(-0.25)
    row = dict(family="LSTM", strategy="tf.gradients", status="ok", peak_mb=152.4,
               predicted_mb=128.4, predicted_error=128.4 / 152.4 - 1,
               predicted_range="112.1-153.3", range_error=0.0)
    assert "| LSTM | tf.gradients | 152.4 | 128.4 | -16% | 112.1-153.3 | +0% |" in (
        compare.format_predict_table([row], markdown=True))
    measured = {"status": "ok", "peak_bytes": 100 * 2**20, "resting_bytes": 0, "step_s": 1.0,
                "predicted_peak_bytes": 120 * 2**20,
                "predicted_peak_range": [110 * 2**20, 150 * 2**20]}
    got, = compare._rows({"tf.gradients": measured}, ["tf.gradients"],
                         {"tf.gradients": os.devnull + "-none"})
    assert (got["predicted_range"], got["range_error"]) == ("110.0-150.0", pytest.approx(0.10))


def test_predict_families_picks_rows_by_part_of_their_label():
    assert compare.predict_families() == compare.PREDICT_FAMILIES
    assert [f[0] for f in compare.predict_families(["LSTM", "resnet50"])] == [
        "Keras ResNet50 96 px", "Keras ResNet50 96 px, mixed_bfloat16", "2 x Keras LSTM(256)"]
    with pytest.raises(ValueError, match=r"no model family's label contains \['vgg'\]"):
        compare.predict_families(["vgg"])


def test_device_description_names_the_kernels_and_a_set_executor(monkeypatch):
    monkeypatch.delenv("TF_NUM_INTEROP_THREADS", raising=False)
    description = measure.device_description()
    assert description.startswith(("CPU: ", "GPU: "))
    if description.startswith("CPU: "):
        assert description.endswith(("oneDNN on", "oneDNN off"))
        # (one op at a time: a step's time is not the default executor's)
        monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "1")
        assert measure.device_description() == description + ", 1 inter-op thread"


def _small_compare(capsys, *flags):
    """compare.py on a 4-layer MLP, tf.gradients and 'memory', with `flags`; its output."""
    code = compare.main(["--model", "mlp", "--depth", "4", "--batch", "64", "--steps", "1",
                         "--warmup", "0", "--strategies", "tf.gradients,memory", "--quiet",
                         *flags])
    assert code == 0
    return capsys.readouterr().out


def test_offload_says_what_moved_or_that_nothing_can_be_measured(capsys):
    printed = _small_compare(capsys, "--offload")
    if tf.config.list_physical_devices("GPU"):
        assert "MiB moved per step (out and back)" in printed, printed
    else:  # no misleading ratio on a machine whose "device" is the host
        assert "offload: nothing moved: no accelerator here" in printed, printed


@pytest.mark.measures
def test_jit_notes_give_hlo_ops_and_xla_buffers_and_fit_finds_a_cap_above_them(capsys):
    printed = _small_compare(capsys, "--jit", "--fit")
    notes = [line for line in printed.splitlines() if "optimized HLO" in line]
    assert len(notes) == 2 and all("XLA buffers" in line for line in notes), printed
    header = next(line for line in printed.splitlines() if line.startswith("strategy"))
    assert header.split()[-4:] == ["fits", "MiB", "x", "tf"], header
    for strategy, note in zip(("tf.gradients", "memory"), notes):
        row = next(line for line in printed.splitlines() if line.startswith(strategy + " "))
        buffers_mb = float(note.split("XLA buffers ")[1].split(" MiB")[0])
        fits_mb = int(row.split()[-2])
        assert buffers_mb <= fits_mb <= math.ceil(buffers_mb * compare.FIT_TOLERANCE) + 8, printed


@pytest.mark.parametrize("uncapped_mib, counted_out", [(103.4, True), (88.1, False)])
def test_a_capped_step_that_crashes_is_out_of_memory_only_if_it_needs_more(
        monkeypatch, uncapped_mib, counted_out):
    """With oneDNN on, a capped step whose allocation fails crashed (SIGSEGV, nothing on
    stderr): plain Keras' MLP at 1.2x its answer, which needs 103.4 MiB uncapped under a
    cap of 96 (AMD EPYC with AVX-512). The crash counts as out of memory only where the
    uncapped step needs more than the cap."""
    limit = 96 << 20
    calls = []

    def run_isolated(target, timeout=None, env=None, **kwargs):
        calls.append(kwargs["limit_mb"])
        if kwargs["limit_mb"] == 96:
            raise measure.IsolatedRunError("crashed", returncode=-11, stderr="")
        return {"oom": False, "peak": int(uncapped_mib * 2**20)}

    monkeypatch.setattr(measure, "run_isolated", run_isolated)
    if counted_out:
        result = capacity._capped("mlp", 3210, limit, False, "adam", 60)
        assert result["oom"] and result["crashed"] == 11
        assert "out of memory (signal 11 under the cap; 103.4 MiB uncapped)" == capacity._ran(result)
    else:
        with pytest.raises(measure.IsolatedRunError, match="crashed"):
            capacity._capped("mlp", 3210, limit, False, "adam", 60)
    assert calls == [96, 96 * capacity.UNCAPPED_FACTOR]


def _reserved_region(limit_mb):
    import tensorflow as tf
    reserved = measure.reserve_one_region(limit_mb)
    return {"reserved": reserved, "peak": tf.config.experimental.get_memory_info("CPU:0")["peak"]}


def test_one_region_of_two_gib_or_more_is_reserved():
    """capacity.py's uncapped rerun of a crashed 1 GiB step asks for a region of 4 GiB;
    one dimension of that many bytes overflowed Empty's int32 shape."""
    got = measure.run_isolated("test_benchmarks:_reserved_region", limit_mb=2100,
                               env=dict(measure.memory_limit_env(2100),
                                        PYTHONPATH=str(Path(__file__).parent)))
    assert got["reserved"] is not None and got["reserved"] >= 2100 - 32
    assert got["peak"] >= got["reserved"] << 20


def test_fitting_cap_finds_the_smallest_cap_within_tolerance():
    for need in (7, 87.3, 410.5):
        probed = []

        def probe(cap, need=need):
            probed.append(cap)
            return cap >= need

        # Uncapped peaks far above the need (allocator chunks), or below it (fragmentation:
        # under a cap each buffer must fit in one free chunk).
        for peak in (need * 1.6, need * 1.1, need / 1.1):
            cap = compare.fitting_cap(probe, peak_mb=peak)
            assert need <= cap <= need * compare.FIT_TOLERANCE + 1, (need, peak, cap, probed)
            assert len(probed) <= 10
            probed.clear()
        # From a lower bound just under the need: found at the first probe.
        assert compare.fitting_cap(probe, peak_mb=need * 1.6, lower_mb=need * 0.99) >= need
    assert compare.fitting_cap(lambda cap: False, peak_mb=50) is None


@pytest.mark.measures
def test_peak_breakdown_accounts_for_every_byte_alive_at_the_measured_peak():
    # Activations (8x32x32x16 floats, 0.5 MiB each) well above the weights' gradients
    # (~0.1 MiB in all): the peak falls in a recomputed segment's backward pass whatever
    # the executor's order (at 2x8x8 it fell, under load, at the step's end, where only
    # the returned gradients are alive).
    result = measure.run_isolated(
        peak_breakdown.CHILD_TARGET, env={"MEMSAVE_ALWAYS_REWRITE": "1"}, timeout=300,
        model="cnn", strategy="memory", model_options={"image_size": 32}, top=5,
        depth=TINY["cnn"]["depth"], batch=8)
    by_kind = result["by_kind"]
    assert sum(by_kind.values()) == result["records_peak"] > 0
    # The rewrite's copies and the returned gradients are told apart from the rest.
    assert by_kind.get("recomputed", 0) > 0 and by_kind.get("grads of xs", 0) > 0, by_kind
    assert result["bfc_peak"] >= result["records_peak"]
    assert len(result["largest"]) == 5 and result["predicted"] > 0
    # The model's own peak, with what it holds there: its largest buffers are recomputed
    # activations or gradients, and they do not exceed its prediction.
    assert result["model_at"].startswith(("backward of segment", "recomputation of segment"))
    assert len(result["model_largest"]) == 5
    assert {kind for _, kind, _ in result["model_largest"]} <= {
        "recomputed", "gradients", "gradients of xs", "forward", "resident"}
    assert sum(nbytes for nbytes, _, _ in result["model_largest"]) <= result["predicted"]
    printed = peak_breakdown.format_breakdown(result)
    assert "memory model:" in printed and "grads of xs" in printed
    assert "the memory model holds at its own peak" in printed


@pytest.mark.measures
def test_peak_breakdown_of_a_tf_function_step_reads_the_profilers_allocations():
    """The step as the tf.function the tests and compare.py measure: its allocations come
    from TensorFlow's profiler (a function leaves no RunMetadata), and what was held
    before the step and what the step allocated add up to the allocator's in-use at the
    step's peak, never above the process's peak."""
    result = measure.run_isolated(
        peak_breakdown.CHILD_TARGET, env={"MEMSAVE_ALWAYS_REWRITE": "1"}, timeout=300,
        model="cnn", strategy="memory", model_options={"image_size": 32}, top=5,
        depth=TINY["cnn"]["depth"], batch=8, function=True)
    by_kind = result["by_kind"]
    assert sum(by_kind.values()) == result["records_peak"] > 0
    assert by_kind.get("recomputed", 0) > 0, by_kind
    assert 0 < result["resident"] and result["resident"] + result["records_peak"] <= (
        result["bfc_peak"]), result
    assert len(result["largest"]) == 5 and result["function"]
    assert "held before the step" in peak_breakdown.format_breakdown(result)


def test_peak_breakdown_shows_what_is_alive_when_a_named_op_first_allocates():
    # (time, bytes, op): a 4-byte peak while "b" runs; "c" allocates after "b" is freed.
    events = [(0, 1, "a"), (1, 3, "b"), (2, -3, "b"), (3, 2, "c/grad"), (4, -1, "a")]
    assert peak_breakdown._live_at_peak(events) == (4, {"a": 1, "b": 3})
    assert peak_breakdown._live_at_peak(events, at="c/grad") == (3, {"a": 1, "c/grad": 2})
    assert peak_breakdown._live_at_peak(events, at="nowhere") == (0, {})


def test_graph_kinds_measures_both_kinds_of_graph_for_each_strategy(capsys):
    peaks = graph_kinds.main(["--model", "mlp", "--depth", "4", "--batch", "512",
                              "--strategies", "tf.gradients,memory", "--timeout", "300"])
    assert set(peaks) == {"tf.gradients", "memory"}
    # 4 tanh layers of 512 x 256 floats (0.5 MiB each): each step holds some of them.
    assert all(0.5 < peak < 64 for pair in peaks.values() for peak in pair), peaks
    printed = capsys.readouterr().out
    assert "tf.function MiB" in printed and "Session MiB" in printed


def test_budget_sweep_runs_budgets_down_to_an_infeasible_one(tmp_path, capsys):
    csv_path, png_path = tmp_path / "budget.csv", tmp_path / "budget.png"
    code = compare.main(["--model", "mlp", "--depth", "4", "--batch", "512", "--steps", "1",
                         "--warmup", "0", "--budget-sweep", "--budgets", "1,0.01", "--csv",
                         str(csv_path), "--png", str(png_path), "--quiet"])
    assert code == 0
    rows = {row["strategy"]: row for row in _read_csv(csv_path)}
    assert set(rows) == {"tf.gradients", "speed", "memory", "budget:1", "budget:0.01"}
    assert rows["budget:1"]["status"] == "ok"
    assert rows["budget:0.01"]["status"] == "error"
    assert "cannot be met" in rows["budget:0.01"]["message"]
    assert png_path.exists() or "matplotlib" not in sys.modules
    assert "budget:0.01" in capsys.readouterr().out


def test_sweep_records_out_of_memory_as_oom(tmp_path, capsys):
    csv_path, png_path = tmp_path / "sweep.csv", tmp_path / "sweep.png"
    # 12 MB holds the weights and data (4 MB) but not the step's activations (~25 MB).
    code = compare.main(["--sweep", "--model", "mlp", "--depths", "2,4", "--batch", "4096",
                         "--steps", "1", "--warmup", "0", "--strategies", "tf.gradients",
                         "--memory-limit-mb", "12", "--csv", str(csv_path), "--png",
                         str(png_path), "--quiet"])
    assert code == 0
    rows = _read_csv(csv_path)
    assert [(row["depth"], row["status"]) for row in rows] == [("2", "OOM"), ("4", "OOM")]
    assert "OOM when allocating" in rows[0]["message"]
    assert "not run" in rows[1]["message"]
    assert "OOM" in capsys.readouterr().out
    if _has_matplotlib():
        assert png_path.stat().st_size > 0


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _row(depth, strategy, status="ok", peak=10.0, ms=5.0):
    row = {field: None for field in compare.CSV_FIELDS}
    row.update(model="mlp", depth=depth, strategy=strategy, status=status,
               peak_mb=peak if status == "ok" else None, step_ms=ms if status == "ok" else None)
    return row


def test_sweep_plot_and_text_show_each_strategy(tmp_path):
    rows = [_row(2, "tf.gradients", peak=20), _row(2, "memory", peak=8),
            _row(4, "tf.gradients", status="OOM"), _row(4, "memory", peak=11)]
    text = compare.format_sweep(rows)
    assert "OOM" in text and "11.0 / 5" in text
    png = tmp_path / "plot.png"
    drew = compare.plot_sweep(rows, png, memory_limit_mb=30, title="tiny")
    assert drew == _has_matplotlib()
    if drew:
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_table_shows_oom_and_failure_rows():
    rows = [_row(None, "tf.gradients", status="OOM"), _row(None, "memory")]
    rows[0]["message"] = "OOM when allocating tensor"
    text = compare.format_table(rows)
    assert "OOM" in text.splitlines()[2]
    assert "tf.gradients: OOM when allocating tensor" in text


def test_repeated_runs_give_each_ratios_median_and_range_over_the_runs_that_measured():
    def run(time_ratio, peak, status="ok"):
        rows = [_row(None, "tf.gradients", peak=100.0), _row(None, "memory", status, peak)]
        rows[0].update(peak_ratio=1.0, time_ratio=1.0)
        if status == "ok":
            rows[1].update(peak_ratio=peak / 100.0, time_ratio=time_ratio)
        return rows
    runs = [run(1.42, 30.0), run(1.36, 28.0), run(0, 0, status="OOM"), run(1.40, 33.0)]
    base, memory = compare.repeated_rows(runs)
    assert base["strategy"] == "tf.gradients" and base["runs"] == 4
    assert memory["strategy"] == "memory" and memory["runs"] == 3  # (not the OOM run)
    assert memory["time_ratio"] == (1.40, 1.36, 1.42, 3)
    assert memory["peak_mb"] == (30.0, 28.0, 33.0, 3)
    assert memory["peak_ratio"] == pytest.approx((0.30, 0.28, 0.33, 3))
    text = compare.format_repeated([base, memory])
    assert "1.40 [1.36-1.42]" in text and "30.0 [28.0-33.0]" in text
    # A strategy that measured in no run, and a ratio a run lacks (tf.gradients failed).
    runs[0][1]["peak_ratio"] = None
    gone = [[dict(row, peak_mb=None)] for row in (runs[1][0],)]
    assert compare.repeated_rows(gone)[0]["peak_mb"] is None
    assert "-" in compare.format_repeated(compare.repeated_rows(gone)).splitlines()[2]
    assert "(n=2)" in compare.format_repeated(compare.repeated_rows(runs))


def test_repeat_below_one_or_with_another_mode_is_refused(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--model", "mlp", "--repeat", "0"])
    assert "--repeat is 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main(["--model", "mlp", "--sweep", "--repeat", "2"])
    assert "not to --sweep" in capsys.readouterr().err


def test_repeated_comparison_writes_every_run_to_csv_and_the_summary_to_markdown(
        tmp_path, capsys, monkeypatch):
    """main with --repeat, its measuring runs replaced by canned rows (one per run)."""
    ratios = iter([1.42, 1.36, 1.40])

    def canned(*args, **kwargs):
        rows = [_row(None, "tf.gradients", peak=100.0), _row(None, "memory", peak=30.0)]
        rows[0].update(peak_ratio=1.0, time_ratio=1.0)
        rows[1].update(peak_ratio=0.3, time_ratio=next(ratios))
        return rows
    monkeypatch.setattr(compare, "compare", canned)
    csv_path, md_path = tmp_path / "runs.csv", tmp_path / "runs.md"
    assert compare.main(["--model", "mlp", "--repeat", "3", "--csv", str(csv_path),
                         "--markdown", str(md_path), "--quiet"]) == 0
    assert "1.40 [1.36-1.42]" in capsys.readouterr().out
    rows = _read_csv(csv_path)
    assert [(row["run"], row["strategy"]) for row in rows] == [
        (str(run), strategy) for run in (1, 2, 3) for strategy in ("tf.gradients", "memory")]
    markdown = md_path.read_text(encoding="utf-8")
    assert "| memory |" in markdown and "3 runs:" in markdown and "1.40 [1.36-1.42]" in markdown


def test_relative_error_compares_saved_gradients(tmp_path):
    reference, other = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(reference, g0000=np.array([1.0, -2.0]), g0001=np.array([4.0]))
    np.savez(other, g0000=np.array([1.0, -2.2]), g0001=np.array([4.0]))
    assert compare._max_relative_error(other, reference) == pytest.approx(0.1)


def test_relative_error_of_a_numerically_zero_gradient_is_taken_against_the_largest(tmp_path):
    reference, other = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(reference, g0000=np.array([100.0]), g0001=np.array([1e-9]))
    np.savez(other, g0000=np.array([100.0]), g0001=np.array([-1e-9]))
    # (the floor: 1% of the largest gradient, as assert_same_gradients' in the tests)
    assert compare.NEGLIGIBLE == 1e-2
    assert compare._max_relative_error(other, reference) == pytest.approx(2e-9 / 1.0)


def test_build_time_rows_on_a_small_generated_graph():
    rows = bench_rewrite_time.build_time_rows([60], strategies=("memory",), repeats=1,
                                              isolate=False)
    assert rows[0]["ops"] > 30
    assert rows[0]["tf.gradients"] > 0 and rows[0]["memory ratio"] > 0
    assert "memory s" in bench_rewrite_time.format_rows(rows, ("memory",))


def test_benchmark_files_are_not_collected_by_the_test_suite():
    assert not os.path.basename(bench_rewrite_time.__file__).startswith("test_")


@pytest.mark.planner_fallback
def test_picture_draws_the_plan_against_tf_gradients_without_running(capsys):
    assert compare.main(["--model", "mlp", "--depth", "8", "--batch", "256", "--picture",
                         "--strategies", "tf.gradients,memory", "--memory-limit-mb", "8"]) == 0
    printed = capsys.readouterr().out
    assert "strategy memory" in printed and "memsave: live memory over the step" in printed
    assert "the limit 8.0 MiB" in printed and "tf.gradients: peak" in printed
    with pytest.raises(SystemExit, match="--picture draws one of"):
        compare.main(["--model", "mlp", "--depth", "4", "--picture", "--strategies", "every:2"])


def test_a_time_budget_is_a_strategy_the_benchmarks_run():
    """'time:T' is memsave.budget(time=T), the other corner of the trade (issue 47), in
    compare.py and time_breakdown.py alike."""
    assert repr(compare.budget_of("time:1.2")) == "memsave.budget(time=1.2)"
    assert repr(compare.budget_of("budget:0.5")) == "memsave.budget(0.5)"
    assert repr(time_breakdown._checkpoints("time:1.25")) == "memsave.budget(time=1.25)"
    with pytest.raises(ValueError, match="time:T with a step-time ratio"):
        compare.budget_of("time:fast")
    grad_fn, _ = compare._strategy_gradient_fn("time:1.3", None)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [64, 64])
        h = x
        for _ in range(12):
            h = tf.tanh(h)
        grads = grad_fn(tf.reduce_sum(h), [x])
    import memsave
    assert grads[0] is not None and memsave.last_report().strategy == "budget(time=1.3)"


def test_time_breakdown_takes_the_recomputation_over_the_baselines_step_not_its_op_time():
    """The CNN's figures (AMD EPYC with AVX-512): tf.gradients' ops sum to 372 ms but ran
    1.48 at a time in a 252 ms step; memsave's 85.5 ms of recomputation is a third of
    that step (1.34x alone), not a quarter of the summed op time (1.23x)."""
    def part(forward, recomputed, backward, wall):
        return {"seconds": {"forward": forward, "recomputed": recomputed,
                            "backward": backward, "bookkeeping": 0.0, "other": 0.0},
                "wall_s": wall}
    result = {"strategy": "memory", "time_ratio": 1.38,
              "step_s": {"memory": 0.3526, "tf.gradients": 0.2521},
              "tf.gradients": part(0.0992, 0.0, 0.2729, 0.2517),
              "memory": part(0.0947, 0.0855, 0.1815, 0.3530)}
    facts = time_breakdown.derived(result)
    assert facts["recomputed_alone"] == pytest.approx(1 + 0.0855 / 0.2517)
    assert facts["beyond"] == pytest.approx(1.38 - 1 - 0.0855 / 0.2517)
    assert facts["side_by_side"]["tf.gradients"] == pytest.approx(0.3721 / 0.2517)
    # (no profiled wall time: the timed step stands in)
    result["tf.gradients"]["wall_s"] = None
    assert time_breakdown.derived(result)["recomputed_alone"] == pytest.approx(
        1 + 0.0855 / 0.2521)


def test_time_breakdown_sums_the_recomputed_ops_apart_and_times_the_plan_without_its_order():
    result = time_breakdown.measure_breakdown("mlp", "memory", depth=8, batch=256, steps=1,
                                              profiled=1, variants=True)
    theirs, mine = result["tf.gradients"], result["memory"]
    # The copies run only in memsave's step; both run the same forward pass.
    assert theirs["runs"]["recomputed"] == 0 < mine["runs"]["recomputed"]
    assert mine["seconds"]["recomputed"] > 0
    assert theirs["runs"]["forward"] > 0 and mine["runs"]["forward"] > 0
    assert theirs["runs"]["backward"] > 0 and mine["runs"]["backward"] > 0
    assert result["time_ratio"] > 0 and set(result["variants"]) == set(time_breakdown.VARIANTS)
    assert result["variants"]["without ordering edges"][0] > 0  # ('memory' orders: timed)
    facts = time_breakdown.derived(result)
    assert facts["recomputed_alone"] > 1
    # (the MLP's copies are its MatMuls, BiasAdds and Tanhs: where their time went)
    assert set(mine["recomputed_by_type"]) & {"Tanh", "MatMul", "_MklMatMul", "_FusedMatMul",
                                              "_MklFusedMatMul"}, mine["recomputed_by_type"]
    printed = time_breakdown.format_breakdown(result)
    for line in ("recomputed", "beyond the recomputation", "without ordering edges",
                 "ran side by side", "recomputed op types (ms per step): "):
        assert line in printed, printed


def test_a_variant_is_the_plan_itself_only_where_every_choice_of_its_report_is_the_same():
    def report(**changes):
        fields = dict(checkpoints=[types.SimpleNamespace(name="a:0")], orders_backward=False,
                      recomputes_ahead=False, reads_checkpoints=False, reads_last_segment=True)
        return types.SimpleNamespace(**dict(fields, **changes))
    assert time_breakdown._same_plan(report(), report())
    assert not time_breakdown._same_plan(report(orders_backward=True), report())
    assert not time_breakdown._same_plan(report(recomputes_ahead=True), report())
    assert not time_breakdown._same_plan(
        report(checkpoints=[types.SimpleNamespace(name="b:0")]), report())
    assert not time_breakdown._same_plan(None, report())
    assert not time_breakdown._same_plan(None, None)


def test_time_breakdown_does_not_time_a_variant_that_is_the_plan_itself():
    """A budget's plan has no ordering edges: 'without ordering edges' is the same step,
    and timing it again would only show the noise between two runs of one step."""
    result = time_breakdown.measure_breakdown("mlp", "budget:0.85", depth=16, batch=512, steps=1,
                                              profiled=1, variants=True)
    assert result["variants"]["without ordering edges"] == (None, None)
    assert ("without ordering edges: the plan as planned (not timed again)"
            in time_breakdown.format_breakdown(result))


@pytest.mark.measures
def test_capacity_answers_run_under_their_cap_and_a_fifth_more_runs_out():
    """memsave.keras.max_batch_size's answers for capacity.py's MLP (24 x Dense(256),
    Adam) in 96 MiB: the training step `fit` runs, each under the cap held as one
    region (as a GPU holds its memory), runs at the answer and runs out of memory at
    1.2x it, with memsave ('memory') and with plain Keras. (With the weight gradients
    counted to the step's end and the batch sometimes outside the allocator,
    memsave's answer was 5783 and 1.2x it, 6940, ran; then 6332, and 7599 ran out. Since
    'memory' keeps matmul outputs the answer is 6962; its fill once let the live tensors
    rise to the allocator's peak, and the answer crashed under the cap. Intel Xeon,
    TensorFlow 2.21.)"""
    confirmation = capacity.confirm("mlp", timeout=300)
    table = capacity.format_confirmation(confirmation)
    print("\n" + table)
    assert capacity.confirmed(confirmation), table
    memsave_row, plain_row = confirmation["rows"]
    assert memsave_row["batch"] > plain_row["batch"], table


def test_memory_counts_a_live_peak_within_a_tie_as_no_higher_when_it_adds_matmul_outputs(
        monkeypatch):
    """'memory' adds matmul and convolution outputs to its lowest-peak plan while neither
    predicted peak rises, the live tensors' counted within search.PEAK_TIE (as `best`
    counts peaks: the model is not that exact). Held to the live peak exactly, keras-hub
    GPT-2 kept none: its first matmul output raised the live peak 0.1 MiB of 141.5 and
    lowered the allocator's 156.5 -> 149.4 (measured 160.0 -> 152.4 MiB, AMD EPYC with
    AVX-512). On this 27-block CNN the same rule keeps more outputs at a live peak 0.4%
    higher, the allocator's no higher than the plan alone. The environment is pinned
    (oneDNN's kernels, two threads, the CPU's BFC) so that the plan is this machine's
    whatever the CPU."""
    read = environment_lib.Environment.read.__func__

    def pinned(cls, graph, *args, **kwargs):
        return dataclasses.replace(
            read(cls, graph, *args, **kwargs), accelerator=False, kernels=environment_lib.ONEDNN,
            conv_threads=2, inter_op_threads=2, allocator=environment_lib.CPU_GROWING)

    monkeypatch.setattr(environment_lib.Environment, "read", classmethod(pinned))
    reports = {}
    for name, strategy in (("alone", memsave.strategies.lowest_peak(None)), ("filled", "memory")):
        model = models.build_model("cnn", depth=27, batch=8)
        step = model.make_step(lambda ys, xs: memsave.gradients(ys, xs, checkpoints=strategy))
        step.get_concrete_function(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype))
                                     for a in model.inputs])
        reports[name] = memsave.last_report()
    alone, filled = reports["alone"], reports["filled"]
    assert alone.predicted_live_bytes < filled.predicted_live_bytes
    assert filled.predicted_live_bytes <= alone.predicted_live_bytes * (1 + search.PEAK_TIE)
    assert filled.predicted_peak_bytes <= alone.predicted_peak_bytes
    assert filled.recompute_flops < alone.recompute_flops
