"""STUB being replaced by the segment rewrite (in progress)."""
import tensorflow as tf


def gradients(ys, xs, grad_ys=None, checkpoints="collection", **kwargs):
    return tf.gradients(ys, xs, grad_ys=grad_ys, **kwargs)


def gradients_speed(ys, xs, grad_ys=None, **kwargs):
    return gradients(ys, xs, grad_ys, checkpoints="speed", **kwargs)


def gradients_memory(ys, xs, grad_ys=None, **kwargs):
    return gradients(ys, xs, grad_ys, checkpoints="memory", **kwargs)


def gradients_collection(ys, xs, grad_ys=None, **kwargs):
    return gradients(ys, xs, grad_ys, checkpoints="collection", **kwargs)
