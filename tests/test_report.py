"""The report of what memsave kept and recomputed, and its logging."""

import logging
import re

import numpy as np
import tensorflow as tf

import memsave


def _chain(n=16):
    x = tf.constant(np.ones([64, 64], np.float32))
    h = x
    for _ in range(n):
        h = tf.tanh(h)
    return tf.reduce_sum(h), x


def test_the_summary_counts_one_of_a_kind_in_the_singular():
    graph = tf.Graph()
    with graph.as_default():
        loss, x = _chain()
        middle = [op for op in graph.get_operations() if op.type == "Tanh"][8].outputs[0]
        memsave.gradients(loss, x, checkpoints=[middle])
    summary = memsave.last_report().summary()
    assert "strategy explicit list: 1 checkpoint (" in summary
    assert "2 segments recompute " in summary
    for plural in ("checkpoints", "segments", "ops", "loops"):
        assert not re.search(rf"(?<!\d)1 {plural}\b", summary), summary


def test_plan_reports_without_touching_the_graph():
    graph = tf.Graph()
    with graph.as_default():
        loss, x = _chain()
        before = len(graph.get_operations())
        report = memsave.plan(loss, x, "memory")
        assert len(graph.get_operations()) == before
    assert report.region_ops == 17
    # 16 equal tensors in a chain: the lowest predicted peak keeps a few of them (2 to 5
    # give the same peak within a tensor; the tie goes to the fewest segments).
    assert 2 <= len(report.checkpoints) <= 5
    assert all(c.bytes == 64 * 64 * 4 and c.dtype == "float32" for c in report.checkpoints)
    assert report.kept_bytes == len(report.checkpoints) * 64 * 64 * 4
    assert report.predicted_peak_bytes < 0.6 * report.baseline_peak_bytes
    assert "segment" in report.peak_at and report.baseline_peak_at.startswith("backward pass")
    # Every tanh again, plus per-op and per-segment overheads (tiny tensors: those dominate).
    assert 0.9 < report.recompute_fraction < 3
    assert not report.segments


def test_report_counts_segments_and_recomputed_bytes(caplog):
    graph = tf.Graph()
    with graph.as_default(), caplog.at_level(logging.DEBUG, logger="memsave"):
        loss, x = _chain()
        memsave.gradients(loss, x, checkpoints="memory")
    report = memsave.last_report()
    assert len(report.segments) == len(report.checkpoints) + 1
    assert report.copied_ops == 17  # every region op copied exactly once on a chain
    # Of those, the tanh of every segment but the last run: the last one (its 4 tanh and
    # the loss, first in backward order) reads what the forward pass has just made, and
    # the loss's copy (a sum, whose gradient reads nothing) would not run anyway.
    # Reading the checkpoints instead of recomputing them would hold each through the
    # next segment's backward pass, a higher peak on a chain: not chosen.
    assert not report.reads_checkpoints and report.reads_last_segment
    assert report.segments[0].copied_ops == 5 and report.segments[0].recomputed_ops == 0
    assert report.recomputed_ops == 12
    assert report.recomputed_bytes == 12 * 64 * 64 * 4
    assert "segments recompute 12 ops" in report.summary()
    text = report.format()
    assert "the last one reads what the forward pass made" in text
    for c in report.checkpoints:
        assert c.name in text
    assert "recomputed segments" in text
    assert any(r.levelno == logging.INFO and f"{len(report.checkpoints)} checkpoints" in r.getMessage()
               and "predicted peak" in r.getMessage() for r in caplog.records)
    assert any(r.levelno == logging.DEBUG and "kept (checkpoints)" in r.getMessage()
               for r in caplog.records)


def test_report_lists_what_is_never_recomputed():
    graph = tf.Graph()
    with graph.as_default():
        w = tf.Variable(np.ones([8, 8], np.float32))
        h = tf.compat.v1.placeholder(tf.float32, [None, 8])  # unknown batch: shapes are computed
        for _ in range(6):
            h = tf.tanh(tf.matmul(h, w))
            h = h * tf.cast(tf.random.uniform(tf.shape(h)) > 0.5, h.dtype)  # draw shaped by h
        report = memsave.plan(tf.reduce_sum(h), [w], "memory")
    reasons = dict(report.not_recomputable)
    types = {graph.get_operation_by_name(name).type for name in reasons}
    assert "RandomUniform" in types and "ReadVariableOp" in types
    assert set(reasons.values()) == {"stateful"}


def test_a_kept_tensor_list_is_reported_at_its_elements_bytes():
    """A TensorList (an RNN's input sequence, which the LSTM benchmark's 'memory' plan
    keeps) is reported at the bytes of its elements, as the memory model counts it (it
    was 0.00 MiB)."""
    from memsave.report import CheckpointInfo

    with tf.Graph().as_default():
        sequence = tf.zeros([10, 4, 8], tf.float32)
        elements = tf.TensorArray(tf.float32, size=10).unstack(sequence)
        info = CheckpointInfo.of(elements.flow, "kept")
    assert info.dtype == "variant" and info.bytes == 10 * 4 * 8 * 4
