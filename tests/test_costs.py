"""The cost model (memsave.planner.costs): prices per op class, the switch that
selects a Costs, and the calibration's arithmetic on given timings (what a machine
measures belongs in benchmarks, not in an assertion)."""

import types

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave import calibration, planner
from memsave.planner import costs, opinfo
from memsave.region import ForwardRegion


def _conv_bn_relu():
    """One conv -> batch norm -> relu -> sum, in a v1 graph; returns (loss, ops by type)."""
    x = tf.constant(np.ones([8, 16, 16, 4], np.float32))
    w = tf.constant(np.ones([3, 3, 4, 8], np.float32))
    y = tf.nn.conv2d(x, w, 1, "SAME")
    y, _, _ = tf.compat.v1.nn.fused_batch_norm(y, tf.ones([8]), tf.zeros([8]), is_training=True)
    loss = tf.reduce_sum(tf.nn.relu(y))
    ops = {op.type: op for op in tf.compat.v1.get_default_graph().get_operations()}
    return loss, x, ops


def test_heavy_ops_cost_their_flops_others_their_elements_at_the_machines_price():
    price = costs.Costs(per_element=30.0, per_normalised_element=70.0)
    with tf.Graph().as_default():
        _, _, ops = _conv_bn_relu()
    elements = 8 * 16 * 16 * 8
    assert price.of(ops["Conv2D"]) == opinfo.flops(ops["Conv2D"]) == 2 * elements * 3 * 3 * 4
    assert price.of(ops["Relu"]) == 30 * elements
    # The batch norm's outputs: the normalised tensor and four [8] statistics.
    assert price.of(ops["FusedBatchNormV3"]) == 70 * (elements + 4 * 8)


def test_a_reduction_costs_the_elements_it_reads_and_a_reshape_none():
    """A Reshape's output is its input's buffer (no data moves); a Mean reads its whole
    input and writes a few elements (keras-hub GPT-2's layer-norm Means took 11.7 ms of a
    budget plan's recomputation, priced at nothing by their outputs)."""
    price = costs.Costs(per_element=30.0)
    with tf.Graph().as_default():
        x = tf.constant(np.ones([64, 256], np.float32))
        mean = tf.reduce_mean(x, axis=-1, keepdims=True)
        total = tf.reduce_sum(x)
        flat = tf.reshape(x, [-1])
        shifted = x - mean
        checked = tf.debugging.check_numerics(x, "x")
        l2 = tf.nn.l2_loss(x)
        unknown = tf.compat.v1.placeholder(tf.float32, shape=None)
        unknown_sum = tf.reduce_sum(unknown)
    assert price.of(mean.op) == price.of(total.op) == price.of(l2.op) == 30 * 64 * 256
    assert price.of(flat.op) == 0
    assert price.of(shifted.op) == 30 * 64 * 256  # (elementwise: its output's elements)
    # CheckNumerics passes its input's buffer on, but scans it: not free.
    assert price.of(checked.op) == 30 * 64 * 256
    # A reduction of an input of unknown rank: priced by its output, as before.
    assert price.of(unknown_sum.op) == 30


def test_use_selects_the_costs_a_model_is_built_with_and_restores_on_exit():
    dear = costs.Costs(per_element=1000.0, op_overhead=0, segment_overhead=0)
    assert costs.active() is costs.DEFAULT_COSTS
    with tf.Graph().as_default():
        loss, x, ops = _conv_bn_relu()
        with costs.use(dear):
            assert costs.active() is dear
            model = planner.model_of(ForwardRegion.build([loss], [x]))
        assert costs.active() is costs.DEFAULT_COSTS
        default = planner.MemoryModel(planner.StepGraph.build(ForwardRegion.build([loss], [x])))
    relu = model.graph.op_id[ops["Relu"]]
    assert model.graph.cost[relu] == 1000 * 8 * 16 * 16 * 8
    assert default.graph.cost[relu] == int(costs.DEFAULT_COSTS.per_element * 8 * 16 * 16 * 8)
    with pytest.raises(memsave.MemsaveError, match="use\\(\\) takes a memsave.planner.Costs"):
        with costs.use({"per_element": 3}):
            pass
    with pytest.raises(memsave.MemsaveError, match="Costs.per_element is -1"):
        costs.Costs(per_element=-1)


def test_the_price_of_a_segment_decides_how_many_segments_a_budget_makes():
    """In a chain of tanh every plan recomputes every tanh once, but for the checkpoints
    (a tanh's gradient reads its kept output), so what separates plans within a budget is
    their segments: free segments let the budget keep more tensors, each saving one
    tanh's recomputation; dear ones make the fewest segments that fit."""
    free_costs = costs.Costs(per_element=35.0, segment_overhead=0.0)
    with tf.Graph().as_default() as graph:
        x = tf.constant(np.ones([256, 256], np.float32))
        h = x
        for _ in range(48):
            h = tf.tanh(h)
        loss = tf.reduce_sum(h)
        reports = {}
        for name, cost_model in (("free", free_costs),
                                 ("dear", costs.Costs(per_element=35.0, segment_overhead=1e9))):
            with costs.use(cost_model):
                reports[name] = memsave.plan(loss, [x], checkpoints=memsave.budget(0.7))
        with costs.use(free_costs):  # the dear plan, priced as the free plan was
            dear_plan = [graph.get_tensor_by_name(c.name) for c in reports["dear"].checkpoints]
            dear_at_free_costs = memsave.plan(loss, [x], checkpoints=dear_plan)
    free, dear = reports["free"], reports["dear"]
    for report in (free, dear):
        assert report.predicted_peak_bytes <= 0.7 * report.baseline_peak_bytes
    assert len(dear.checkpoints) < len(free.checkpoints)
    assert free.recompute_flops < dear_at_free_costs.recompute_flops


def _timings(**seconds):
    """CalibrationTimings of a machine whose heavy ops run at 1e11 FLOP/s, a ReLU and an
    add at 30 FLOPs per element, a batch norm at 80, an op at 10 us, a segment at 100 us;
    `seconds` overrides any of them."""
    rate = 1e11
    values = dict(conv=calibration.CONV_FLOPS / rate, matmul=calibration.MATMUL_FLOPS / rate,
                  relu=25 * calibration.ELEMENTS / rate, add=35 * calibration.ELEMENTS / rate,
                  norm=80 * calibration.ELEMENTS / rate, per_op=1e-5, per_segment=1e-4)
    values.update(seconds)
    return calibration.CalibrationTimings(**values)


def test_calibration_prices_each_op_class_in_flops_of_the_heavy_ops():
    measured = calibration.costs_from_timings(_timings(), source="given")
    assert measured == costs.Costs(per_element=30.0, per_normalised_element=80.0,
                                   op_overhead=1e6, segment_overhead=1e7, source="given")
    # The FLOP rate is the geometric mean of the convolution's and the matmul's: a
    # convolution four times slower halves every price.
    slow_conv = calibration.costs_from_timings(_timings(conv=4 * calibration.CONV_FLOPS / 1e11))
    assert (slow_conv.per_element, slow_conv.per_normalised_element) == (15.0, 40.0)
    assert (slow_conv.op_overhead, slow_conv.segment_overhead) == (5e5, 5e6)
    assert slow_conv.source == "calibrate() on this machine"


def test_calibration_takes_a_segment_that_costs_nothing_measurable_as_free():
    # On an AMD EPYC without AVX-512 a segment measured no time beyond plain tf.gradients.
    assert calibration.costs_from_timings(_timings(per_segment=0.0)).segment_overhead == 0


@pytest.mark.parametrize("heavy_op", ["conv", "matmul"])
def test_calibration_refuses_a_heavy_op_that_took_no_time(heavy_op):
    with pytest.raises(memsave.MemsaveError, match=f"the {heavy_op} measured 0.0 s"):
        calibration.costs_from_timings(_timings(**{heavy_op: 0.0}))


class _FakeClock:
    """perf_counter for measure_timings: every run of a measured graph takes `measured`
    seconds, every run of its reference `reference` (they run alternately)."""

    def __init__(self, measured, reference):
        self.now, self.calls, self.durations = 0.0, 0, (measured, reference)

    def __call__(self):
        if self.calls % 2:  # the end of a run
            self.now += self.durations[(self.calls // 2) % 2]
        self.calls += 1
        return self.now


def test_measure_timings_runs_every_graph_and_keeps_what_it_takes_beyond_its_reference(
        monkeypatch):
    """The graphs run for real; the seconds come from a clock of the test's own (a real
    one's figures depend on the machine and its load: they belong in benchmarks)."""
    clock = _FakeClock(measured=3.0, reference=1.0)
    monkeypatch.setattr(calibration, "time", types.SimpleNamespace(perf_counter=clock))
    timings = calibration.measure_timings(repeats=2)
    for name in ("conv", "matmul", "relu", "add", "norm"):
        assert getattr(timings, name) == 2.0, (name, timings)
    assert timings.per_op == pytest.approx(2.0 / 800)  # chains of 1000 and 200 ops
    assert timings.per_segment == pytest.approx(2.0 / 199)  # 199 segments' worth
    # Seven measured graphs and their references, each traced once and run twice more.
    assert clock.calls == 7 * 2 * 3 * 2


def test_calibrate_prices_what_measure_timings_measured(monkeypatch):
    given = _timings()
    monkeypatch.setattr(calibration, "measure_timings", lambda repeats: given)
    assert memsave.calibrate(repeats=1, source="test") == calibration.costs_from_timings(
        given, "test")