"""Configurations whose peak memory the tests measure, each in its own process.

Run through memsave.measure.run_isolated("_memory_cases:<name>", ...), which
turns the CPU BFC allocator on before TensorFlow is imported. Every function
returns the peak in MB of one training-style step and a checksum of the
gradients, so the caller can check the rewrite still computes the same thing.
"""

import numpy as np
import tensorflow as tf

import memsave
from memsave.measure import peak_memory_bytes


def _gradient_fn(mode, marks):
    if mode == "tf":
        return tf.gradients
    checkpoints = marks if mode == "listed" else mode
    return lambda ys, xs: memsave.gradients(ys, xs, checkpoints=checkpoints)


def _measure(step, *args):
    step(*args)  # trace and warm up outside the measured call
    peak, grads = peak_memory_bytes(lambda: [g.numpy() for g in step(*args)])
    return {"peak_mb": peak / 2**20, "checksum": float(sum(np.sum(g, dtype=np.float64) for g in grads))}


def chain(mode, n=100, residual=False, mark_every=10):
    """A chain of n elementwise ops on a 1 MB tensor (a = tanh(a), or a = a + tanh(a))."""
    @tf.function
    def step(x):
        h, marks = x, []
        for i in range(n):
            h = h + tf.tanh(h) if residual else tf.tanh(h)
            if i % mark_every == mark_every - 1 and i < n - 1:
                marks.append(h)
        return _gradient_fn(mode, marks)(tf.reduce_sum(h), [x])

    x = tf.constant(np.random.RandomState(0).uniform(-1, 1, [512, 512]).astype(np.float32))
    return _measure(step, x)


def deep_mlp(mode, layers=48, batch=4096, width=256):
    """A deep tanh MLP with variables, in tf.function; gradients w.r.t. all weights."""
    rng = np.random.RandomState(0)
    weights = [tf.Variable((rng.standard_normal([width, width]) / np.sqrt(width)).astype(np.float32))
               for _ in range(layers)]

    @tf.function
    def step(x):
        h = x
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
        return _gradient_fn(mode, [])(tf.reduce_mean(h * h), weights)

    x = tf.constant(rng.standard_normal([batch, width]).astype(np.float32))
    return _measure(step, x)
