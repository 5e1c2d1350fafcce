"""Waits that hold under XLA, which drops control inputs and merges equal computations:
data dependencies through conditionals instead (memsave.build uses them where the
plan's environment is under XLA; the control inputs of memsave.ordering elsewhere).

A segment's copies read their inputs through a conditional on a value computed from
the gradient they wait for (`gate_from`, `local_input`), so XLA neither runs them in
the forward pass nor merges them with the forward ops they copy; its gradients leave
it through one too (`gated`), and deferred weight gradients read their inputs so
(`gate_inputs`).
"""

import contextlib

import tensorflow as tf

from memsave.graph import _tf_private
from memsave.graph.select import TensorMap


def local_input(t, gate=None):
    """A segment's own view of an outside tensor, on the tensor's device.

    An identity, not a stop_gradient: the segment's tf.gradients call stops at
    it anyway (it is one of that call's xs and stop_gradients), and a
    stop_gradient would also cut every higher-order gradient taken through
    the gradients memsave returns (they would come out None). Under XLA, `t`
    itself from a conditional on `gate` (a 1 XLA cannot fold), so the copies wait for
    the segment's gradient; exact for every value, -0.0 and NaN included.
    """
    placement = tf.device(t.op.device) if t.op.device else contextlib.nullcontext()
    with placement:
        if gate is not None and is_number(t.dtype):
            return gated(t, gate, name="input")
        return tf.identity(t, name="input")


def gated(t, gate, name="gated"):
    """`t` from a conditional on `gate` (under XLA; None and non-numeric tensors pass).

    XLA materialises a conditional's operand and cannot fuse the operand's producer
    into the branch, so whoever reads the result reads `t` itself, not a copy of its
    producer (which would keep the producer's own inputs alive, e.g. convolution
    outputs from the forward pass); and it cannot run before `gate` exists.
    """
    if t is None or isinstance(t, tf.IndexedSlices) or not is_number(t.dtype):
        return t
    return tf.cond(gate > 0.5, lambda: tf.identity(t), lambda: tf.zeros_like(t), name=name)


def is_number(dtype):
    """Whether tensors of `dtype` hold numbers (what a conditional can pass)."""
    return dtype.is_floating or dtype.is_complex or dtype.is_integer


def gate_from(trigger):
    """A float32 scalar 1 computed from the data of `trigger` (the incoming gradient of
    a segment, or the ys for the last one).

    XLA ignores control inputs and merges equal computations, so copies that only
    wait for their segment's gradient through control inputs would be merged back
    into the forward pass (nothing saved). Copies that read their inputs through a
    conditional on this value differ from the forward ops and cannot run before
    `trigger` exists. It reads one element; any value (NaN, an empty tensor) gives 1
    (tf.recompute_grad does the same).
    """
    with tf.name_scope("xla_gate"):
        if trigger.dtype.is_complex:
            trigger = tf.math.real(trigger)
        first = tf.reduce_max(tf.reshape(trigger, [-1])[:1])  # -inf when empty
        as_bool = tf.cast(first, tf.bool)  # NaN -> True
        return tf.where(tf.equal(as_bool, as_bool), 1.0, float("nan"))


def gate_inputs(cone, gate):
    """Under XLA: the ops of `cone` read the values they read from outside it through
    a conditional on `gate`, so XLA cannot run them before `gate` exists. Integer
    inputs are shapes and indices, which XLA needs as compile-time constants (a
    filter gradient's filter sizes): not gated."""
    through_gate = TensorMap()
    for op in cone:
        for index, t in enumerate(op.inputs):
            if t.op in cone or not (t.dtype.is_floating or t.dtype.is_complex):
                continue
            if t not in through_gate:
                through_gate[t] = gated(t, gate, name="deferred_input")
            _tf_private.update_input(op, index, through_gate[t])
