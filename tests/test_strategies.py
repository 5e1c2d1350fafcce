"""Checkpoint strategies: what each keeps, on chains and on graphs with skips."""

import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave.strategies import STRATEGIES, keep_if, narrowest_cuts, union

from test_rewrite import assert_same_gradients


def _evaluate(fetches, graph):
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        return session.run(fetches)


def _input(shape, seed=0):
    return tf.constant(np.random.RandomState(seed).uniform(-1, 1, shape).astype(np.float32))


def conv(h, channels, seed, stride=1):
    k = tf.constant(np.random.RandomState(seed).standard_normal(
        [3, 3, h.shape[-1], channels]).astype(np.float32) * 0.2)
    return tf.nn.relu(tf.nn.conv2d(h, k, strides=stride, padding="SAME"))


def resnet_blocks(x, n=6):
    h = conv(x, 8, 0)
    for i in range(n):
        h = h + conv(conv(h, 8, 10 + 2 * i), 8, 11 + 2 * i)
    return tf.reduce_mean(h * h)


def densenet_block(x, n=6):
    features = [conv(x, 4, 0)]
    for i in range(n):
        features.append(conv(tf.concat(features, axis=-1), 4, 20 + i))
    transition = conv(tf.concat(features, axis=-1), 8, 40)
    h = transition
    for i in range(3):
        h = conv(h, 8, 50 + i)
    return tf.reduce_mean(h * h)


def unet(x, depth=3):
    skips, h = [], conv(x, 4, 0)
    for i in range(depth):
        h = conv(h, 4 * 2 ** i, 60 + i)
        skips.append(h)
        h = tf.nn.avg_pool2d(h, 2, 2, "SAME")
    h = conv(h, 4 * 2 ** depth, 70)
    for i in reversed(range(depth)):
        h = tf.image.resize(h, tf.shape(skips[i])[1:3], method="nearest")
        h = conv(tf.concat([h, skips[i]], axis=-1), 4 * 2 ** i, 80 + i)
    return tf.reduce_mean(h * h)


def transformer(x, layers=4, width=16):
    h = x
    for i in range(layers):
        rng = np.random.RandomState(100 + i)
        wq, wk, wv, w1, w2 = (tf.constant(rng.standard_normal([width, width]).astype(np.float32) * 0.2)
                              for _ in range(5))
        q, k, v = (tf.einsum("btd,de->bte", h, w) for w in (wq, wk, wv))
        attention = tf.nn.softmax(tf.einsum("bqd,bkd->bqk", q, k) / 4.0)
        h = h + tf.einsum("bqk,bkd->bqd", attention, v)
        h = h + tf.matmul(tf.nn.gelu(tf.einsum("btd,de->bte", h, w1)), w2)
    return tf.reduce_mean(h * h)


SKIP_GRAPHS = {
    "resnet": (resnet_blocks, [2, 8, 8, 3]),
    "densenet": (densenet_block, [2, 8, 8, 3]),
    "unet": (unet, [2, 16, 16, 3]),
    "transformer": (transformer, [2, 6, 16]),
}


@pytest.mark.parametrize("name", sorted(SKIP_GRAPHS))
def test_memory_strategy_finds_checkpoints_with_skip_connections(name):
    build, shape = SKIP_GRAPHS[name]
    graph = tf.Graph()
    with graph.as_default():
        x = _input(shape)
        loss = build(x)
        expected = tf.gradients(loss, [x])
        got = memsave.gradients(loss, [x], checkpoints="memory")
        report = memsave.last_report()
        assert report.fallback is None and report.checkpoints, report.summary()
        assert len(report.segments) >= 2
        values = _evaluate([expected, got], graph)
    assert_same_gradients(*values)


def test_memory_strategy_prefers_single_tensor_separators():
    graph = tf.Graph()
    with graph.as_default():
        x = _input([2, 8, 8, 3])
        loss = resnet_blocks(x, n=9)
        report = memsave.plan(loss, x, "memory")
    # Block outputs (the adds) and the square before the loss are the only
    # single-tensor cuts of the stack.
    assert report.checkpoints
    assert all(name.startswith(("add", "mul:")) for name in (c.name for c in report.checkpoints))


def test_memory_strategy_keeps_about_sqrt_n_on_a_chain():
    graph = tf.Graph()
    with graph.as_default():
        x = _input([4, 4])
        h = x
        for _ in range(100):
            h = tf.tanh(h)
        report = memsave.plan(tf.reduce_sum(h), x, "memory")
    assert report.region_ops == 101
    # The lowest predicted peak of a chain of equal tensors: about sqrt(100) checkpoints.
    assert 8 <= len(report.checkpoints) <= 13
    positions = sorted(int(c.name.split("_")[1].split(":")[0]) for c in report.checkpoints)
    gaps = np.diff(positions)
    assert gaps.min() >= 5 and gaps.max() <= 13, positions  # evenly spaced


def test_speed_strategy_chooses_by_op_type():
    graph = tf.Graph()
    with graph.as_default():
        x = _input([4, 8])
        w = _input([8, 8], 1)
        h = x
        for _ in range(4):
            h = tf.nn.relu(tf.matmul(h, w, name="not_named_like_a_matmul"))
        report = memsave.plan(tf.reduce_sum(h), x, "speed")
    assert len(report.checkpoints) == 4
    assert all("expensive MatMul" in c.reason for c in report.checkpoints)


def test_collection_strategy_works_inside_tf_function():
    @tf.function
    def step(x):
        h = x
        for i in range(9):
            h = tf.tanh(h)
            if i % 3 == 1:
                memsave.mark_checkpoint(h)
        loss = tf.reduce_sum(h)
        got = memsave.gradients(loss, [x], checkpoints="collection")
        return tf.gradients(loss, [x])[0], got[0], len(memsave.last_report().checkpoints)

    expected, got, kept = step(_input([3, 3]))
    assert int(kept) == 3
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6)


def test_empty_collection_falls_back_quietly_and_the_report_says_how_to_mark():
    graph = tf.Graph()
    with graph.as_default():
        x = _input([3])
        loss = tf.reduce_sum(tf.tanh(tf.tanh(x)))
        with warnings.catch_warnings():
            warnings.simplefilter("error", memsave.MemsaveWarning)
            memsave.gradients(loss, [x], checkpoints="collection")
        assert "mark_checkpoint" in memsave.last_report().fallback


def test_registry_and_combinators():
    assert sorted(STRATEGIES) == ["collection", "memory", "speed"]
    graph = tf.Graph()
    with graph.as_default():
        x = _input([4, 4])
        h = x
        for _ in range(12):
            h = tf.sin(tf.tanh(h))
        loss = tf.reduce_sum(h)
        sines = keep_if(lambda t, region: t.op.type == "Sin", "a {op_type}")
        both = union(sines, narrowest_cuts(2))
        report = memsave.plan(loss, x, both)
        reasons = [c.reason for c in report.checkpoints]
        assert reasons.count("a Sin") == 12  # every Sin, each once, first reason wins
        assert 12 <= len(reasons) <= 14  # plus at most the two cuts' tensors
        assert report.strategy.startswith("union(keep_if(a <op type>), ")
        got = memsave.gradients(loss, [x], checkpoints=both)
        values = _evaluate([tf.gradients(loss, [x]), got], graph)
    assert_same_gradients(*values)


def _calls_made_by(fn):
    """How many Python and built-in function calls `fn()` makes: a count of the work
    done that, unlike a clock, does not depend on the machine or its load."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_memory_strategy_scales_about_linearly():
    def planning_calls(n):
        graph = tf.Graph()
        with graph.as_default():
            x = _input([2, 2])
            h = x
            for i in range(n):
                h = h + tf.tanh(h) if i % 2 else tf.tanh(h)
            loss = tf.reduce_sum(h)
            return _calls_made_by(lambda: memsave.plan(loss, x, "memory"))

    small, large = planning_calls(250), planning_calls(2000)
    # 8x the ops: linear is ~8x, quadratic would be ~64x.
    assert large / small < 24, (small, large)
