"""Host offload of checkpoints (memsave.offload, issue 11).

On this CPU-only machine the CPU is split into two logical devices: `/CPU:0` plays
the accelerator, `/CPU:1` the host. The graphs that actually ran (run metadata:
the partitioned graphs after Grappler and placement) must hold each checkpoint's
copy out and its gated copy on `/CPU:1`, the copy back on `/CPU:0` read by the
segment's recomputed ops, and the gradients must equal tf.gradients'; in a
tf.function, in a tf.compat.v1 Session, and under MirroredStrategy (each replica
offloads to the host of its own task). Those run in child processes (logical
devices are fixed when TensorFlow starts). The rest builds graphs in this process.
"""

import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave.measure import run_isolated

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _run(case):
    return run_isolated(f"_offload_cases:{case}", env={"PYTHONPATH": TESTS_DIR}, timeout=300)


def _by_kind(copies):
    kinds = {"offload_out": [], "offload_staged": [], "offload_back": []}
    for copy in copies:
        kind = next(k for k in kinds if k in copy["name"])
        kinds[kind].append(copy)
    return kinds


def _assert_offloaded(result, accelerator, host):
    assert result["max_diff"] == 0.0, result["max_diff"]
    kinds = _by_kind(result["copies"])
    assert len(kinds["offload_out"]) == 2 and len(kinds["offload_back"]) == 2, result["copies"]
    for copy in kinds["offload_out"] + kinds["offload_staged"]:
        assert copy["device"].endswith(host), copy
    for copy in kinds["offload_staged"]:
        assert any(i.startswith("^") for i in copy["inputs"]), f"not gated: {copy}"
    for copy in kinds["offload_back"]:
        assert copy["device"].endswith(accelerator), copy
    # The recomputed ops read the copies back, on the accelerator.
    assert result["readers"] and all(r["device"].endswith(accelerator) for r in result["readers"])
    assert all("recompute" in r["name"] for r in result["readers"]), result["readers"]


@pytest.mark.measures
@pytest.mark.parametrize("case", ["function_case", "v1_case"])
def test_checkpoints_go_to_the_host_and_come_back_gated(case):
    result = _run(case)
    assert len(set(result["offloaded"])) == 2 and result["moved"] > 0
    _assert_offloaded(result, "CPU:0", "CPU:1")


@pytest.mark.measures
def test_under_mirrored_strategy_each_replica_offloads_to_its_own_host():
    result = _run("mirrored_case")
    first, second = result["reports"]
    assert first["offloaded"] == []  # replica 0 runs on its host's CPU already
    assert len(set(second["offloaded"])) == 2
    assert all(copy["name"].startswith("replica_1/") for copy in result["copies"])
    _assert_offloaded(result, "CPU:1", "CPU:0")


# -- building, in this process --------------------------------------------------------------

def _mlp(depth=6, width=256, batch=64):
    rng = np.random.RandomState(0)
    weights = [tf.constant((rng.standard_normal([width, width]) / 16).astype(np.float32))
               for _ in range(depth)]
    x = tf.constant(rng.standard_normal([batch, width]).astype(np.float32))
    with tf.device("/CPU:0"):
        h, marks = x, []
        for i, w in enumerate(weights):
            h = tf.tanh(tf.matmul(h, w))
            if i % 2 == 1 and i < depth - 1:
                marks.append(h)
        return tf.reduce_sum(h * h), weights, marks


def _copies(graph, kind):
    return [op for op in graph.get_operations() if op.type == "Snapshot" and kind in op.name]


@pytest.mark.parametrize("prefetch", [0, 1])
def test_the_copy_back_waits_for_the_segment_a_prefetch_distance_ahead(prefetch):
    graph = tf.Graph()
    with graph.as_default():
        loss, weights, marks = _mlp()
        memsave.gradients(loss, weights, checkpoints=marks,
                          offload=memsave.Offload("/CPU:1", min_bytes=0, prefetch=prefetch))
    staged = {op.name.split("/")[1]: op for op in _copies(graph, "offload_staged")}
    assert set(staged) == {"last_segment", "segment_7"}
    # The last segment (first in the backward pass) waits for the forward pass (the loss).
    assert staged["last_segment"].control_inputs == [loss.op]
    second = staged["segment_7"].control_inputs
    if prefetch == 0:
        # Its own incoming gradient: a gradient op of the last segment.
        assert len(second) == 1 and "last_segment/gradients" in second[0].name
    else:
        assert second == [loss.op]  # while the last segment's backward runs


def test_small_checkpoints_stay_and_the_report_says_what_moved():
    graph = tf.Graph()
    with graph.as_default():
        loss, weights, marks = _mlp(batch=64, width=256)  # 64 KiB checkpoints
        memsave.gradients(loss, weights, checkpoints=marks, offload="/CPU:1")  # min 1 MiB
        assert memsave.last_report().offloaded == [] and not _copies(graph, "offload")
        memsave.gradients(loss, weights, checkpoints=marks,
                          offload=memsave.Offload("/CPU:1", min_bytes=32 * 1024))
        report = memsave.last_report()
    assert sorted(set(report.offloaded)) == sorted(m.name for m in marks)
    assert report.offload_moved_bytes == 2 * 2 * 64 * 256 * 4  # out and back, per checkpoint
    assert "2 checkpoints offloaded to host memory" in report.summary()


def test_without_an_accelerator_offload_true_moves_nothing():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.ones([512, 512], np.float32))
        h, marks = x, []
        for i in range(6):
            h = tf.tanh(h * 1.1)
            marks.append(h)
        memsave.gradients(tf.reduce_sum(h), [x], checkpoints=marks[1:-1:2], offload=True)
    assert memsave.last_report().offloaded == [] and not _copies(graph, "offload")


def test_under_xla_offload_is_ignored_with_a_warning():
    loss_weights = {}

    @tf.function(jit_compile=True, autograph=False)
    def step():
        loss, weights, marks = _mlp()
        loss_weights["marks"] = marks
        return memsave.gradients(loss, weights, checkpoints=marks, offload="/CPU:1")

    with pytest.warns(memsave.MemsaveWarning, match="offload is ignored under XLA"):
        step.get_concrete_function()
    assert memsave.last_report().offloaded == []


@pytest.mark.parametrize("offload,match", [
    ("cpu zero", r"offload='cpu zero' is no device string"),
    (3, r"offload is a int; pass False, True, a device string"),
    (memsave.Offload, r"offload is a type"),
])
def test_bad_offload_arguments_are_refused(offload, match):
    graph = tf.Graph()
    with graph.as_default():
        loss, weights, marks = _mlp()
        before = len(graph.get_operations())
        with pytest.raises(memsave.MemsaveError, match=match):
            memsave.gradients(loss, weights, checkpoints=marks, offload=offload)
        assert len(graph.get_operations()) == before
    with pytest.raises(memsave.MemsaveError, match=r"offload prefetch is -1; pass an int >= 0"):
        memsave.Offload(prefetch=-1)
    with pytest.raises(memsave.MemsaveError, match=match):
        memsave.gradient_function("memory", offload=offload)


def test_integrations_pass_offload_on():
    offload = memsave.Offload("/CPU:1", min_bytes=0)
    graph = tf.Graph()
    with graph.as_default():
        loss, weights, marks = _mlp()
        memsave.gradient_function(marks, offload=offload)(loss, weights)
        assert memsave.last_report().offloaded
        with memsave.patch(checkpoints=marks, offload=offload):
            tf.gradients(loss, weights)
        assert memsave.last_report().offloaded
        variables = [tf.compat.v1.Variable(w) for w in (np.ones([4, 4], np.float32),)]
        with tf.device("/CPU:0"):
            h = tf.tanh(tf.tanh(tf.ones([4, 4]) @ variables[0]) * 2.0)
            mark = tf.tanh(h)
            v1_loss = tf.reduce_sum(tf.sin(mark) * mark)
        optimizer = memsave.MemsaveOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                             checkpoints=[mark], offload=offload)
        optimizer.minimize(v1_loss)
        assert memsave.last_report().offloaded == [mark.name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert repr(memsave.patch("memory", offload=True)).startswith("memsave.patch(")


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_the_memory_model_counts_offloaded_checkpoints_as_host_memory(prefetch):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.ones([512, 512], np.float32))  # 1 MiB tensors
        h, marks = x, []
        with tf.device("/CPU:0"):
            for i in range(12):
                h = tf.tanh(h * 1.01)
                if i % 3 == 2 and i < 11:
                    marks.append(h)
        loss = tf.reduce_sum(h)
        kept = memsave.plan(loss, [x], checkpoints=marks)
        offload = memsave.Offload("/CPU:1", prefetch=prefetch)
        offloaded = memsave.plan(loss, [x], checkpoints=marks, offload=offload)
        memsave.gradients(loss, [x], checkpoints=marks, offload=offload)
        built = memsave.last_report()
    assert kept.predicted_host_bytes == 0
    assert offloaded.predicted_host_bytes == built.predicted_host_bytes == 3 * 2**20
    # Kept, the step peaks in the backward pass of the last segment (first in the
    # backward pass: the three 1 MiB checkpoints, its three recomputed tanh outputs and
    # the loss's gradient; each tanh writes into its product's buffer, so the
    # recomputations hold no more). Offloaded, the first two checkpoints are on the host
    # through it, unless brought back early (`prefetch` segments ahead).
    saved = kept.predicted_peak_bytes - offloaded.predicted_peak_bytes
    assert saved == pytest.approx(max(2 - prefetch, 0) * 2**20, abs=16), (
        saved, offloaded.peak_at)
    assert built.predicted_peak_bytes == offloaded.predicted_peak_bytes


# -- budgets that may offload ----------------------------------------------------------

def _wide_mlp(depth=12):
    """tanh(x @ w) layers of 2 MiB activations on /CPU:0, with 0.25 MiB weights: the
    activations dominate, as in a training step on an accelerator."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.ones([2048, 256], np.float32))
        weights = [tf.Variable(np.eye(256, dtype=np.float32) / 2) for _ in range(depth)]
        h = x
        with tf.device("/CPU:0"):
            for w in weights:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_sum(h)
    return graph, loss, weights


def _planned_offload(report):
    return [c.name for c in report.checkpoints if c.offloaded]


@pytest.mark.parametrize("flops_per_byte", [0.0, 1e9])
def test_budget_offloads_only_where_transfers_cost_less_than_recomputation(flops_per_byte):
    graph, loss, weights = _wide_mlp()
    with graph.as_default():
        kept_only = memsave.plan(loss, weights, checkpoints=memsave.budget(0.7))
        offload = memsave.Offload("/CPU:1", flops_per_byte=flops_per_byte)
        report = memsave.plan(loss, weights, checkpoints=memsave.budget(0.7, offload=offload))
    assert report.predicted_peak_bytes <= 0.7 * report.baseline_peak_bytes
    assert not _planned_offload(kept_only) and kept_only.recompute_flops > 0
    if flops_per_byte == 0:  # free transfers: keep (nearly) everything, offload the rest
        assert _planned_offload(report)
        assert report.recompute_flops < kept_only.recompute_flops / 5
        assert report.predicted_host_bytes > 0 and report.offload_moved_bytes > 0
    else:  # transfers dearer than any recomputation: the plan without offload
        assert not _planned_offload(report) and report.transfer_flops == 0
        assert [c.name for c in report.checkpoints] == [c.name for c in kept_only.checkpoints]


def test_budget_with_offload_reaches_peaks_recomputation_alone_cannot():
    # (12 layers, recomputation alone reaches 19 MiB of tf.gradients' 31.3 MiB: 0.5 is
    # 15.6 MiB; with offload 15.5. At 16 layers the same checks took 34 s of CI's 15
    # minutes.)
    graph, loss, weights = _wide_mlp()
    with graph.as_default():
        with pytest.raises(memsave.MemsaveError, match="cannot be met"):
            memsave.plan(loss, weights, checkpoints=memsave.budget(0.5))
        budget = memsave.budget(0.5, offload="/CPU:1")
        planned = memsave.plan(loss, weights, checkpoints=budget)
        ops_before = len(graph.get_operations())
        memsave.gradients(loss, weights, checkpoints=budget)
        built = memsave.last_report()
        copies_out = [op for op in graph.get_operations()[ops_before:]
                      if op.name.endswith("offload_out")]
        # The integrations take the budget as it is, offload included.
        memsave.gradient_function(budget)(loss, weights)
        through_function = memsave.last_report()
    assert planned.predicted_peak_bytes <= 0.5 * planned.baseline_peak_bytes
    assert built.predicted_peak_bytes == planned.predicted_peak_bytes
    # The rewrite offloads exactly what the plan chose, each copied out once.
    chosen = _planned_offload(planned)
    assert chosen and _planned_offload(built) == chosen
    assert sorted(set(built.offloaded)) == sorted(chosen)
    assert sorted(op.inputs[0].name for op in copies_out) == sorted(chosen)
    assert built.offload_moved_bytes == planned.offload_moved_bytes
    assert _planned_offload(through_function) == chosen


def test_a_budget_below_the_lowest_peak_with_offload_names_that_peak():
    # (on 12 layers, as above: 15.5 MiB, after a search of 7 s)
    graph, loss, weights = _wide_mlp(depth=6)
    with graph.as_default():
        with pytest.raises(memsave.MemsaveError, match=r"can reach on this graph with offload "
                                                       r"is 12\.5 MiB .*raise the budget to at "
                                                       r"least 12\.5 MiB$"):
            memsave.plan(loss, weights, checkpoints=memsave.budget(0.45, offload="/CPU:1"))


def test_offload_given_to_the_budget_and_the_call_must_agree():
    graph, loss, weights = _wide_mlp(depth=4)
    with graph.as_default():
        budget = memsave.budget(0.8, offload="/CPU:1")
        memsave.plan(loss, weights, checkpoints=budget, offload="/CPU:1")  # the same: fine
        ops = len(graph.get_operations())
        with pytest.raises(memsave.MemsaveError, match=r"offload is given twice"):
            memsave.gradients(loss, weights, checkpoints=budget, offload=True)
        assert len(graph.get_operations()) == ops
    assert repr(budget) == ("memsave.budget(0.8, offload=Offload(device='/CPU:1', "
                            "min_bytes=1048576, prefetch=1, flops_per_byte=1000.0))")
    with pytest.raises(memsave.MemsaveError, match="offload flops_per_byte is -1"):
        memsave.Offload(flops_per_byte=-1)
    with pytest.raises(memsave.MemsaveError, match="offload is a int"):
        memsave.budget(0.5, offload=3)


@pytest.mark.measures
def test_budget_with_offload_runs_on_two_devices_with_gradients_of_tf_gradients():
    result = _run("budget_case")
    assert result["max_diff"] == 0.0, result["max_diff"]
    assert result["planned"] and sorted(set(result["offloaded"])) == sorted(result["planned"])
    kinds = _by_kind(result["copies"])
    assert len(kinds["offload_out"]) == len(result["planned"])
    assert all(copy["device"].endswith("CPU:1") for copy in kinds["offload_out"])
    assert all(copy["device"].endswith("CPU:0") for copy in kinds["offload_back"])
