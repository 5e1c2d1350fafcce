"""Summing gradient contributions from several segments.

Gradients of checkpoints feed the next segment as `grad_ys`, so they are summed
densely. Gradients of xs stay `tf.IndexedSlices` when every contribution is one:
densifying a large embedding gradient costs exactly the memory memsave exists to
save.
"""

import tensorflow as tf


def sum_dense(contributions, name="memsave_grad_sum"):
    """The dense sum of `contributions` (tensors or IndexedSlices), or None if empty."""
    dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
             for g in contributions]
    if not dense:
        return None
    if len(dense) == 1:
        return dense[0]
    return tf.math.add_n(dense, name=name)


def sum_keeping_sparse(contributions, name="memsave_grad_sum"):
    """Sums contributions; the result is IndexedSlices if all of them are."""
    if not contributions:
        return None
    if len(contributions) == 1:
        return contributions[0]
    if all(isinstance(g, tf.IndexedSlices) for g in contributions):
        index_dtypes = {g.indices.dtype for g in contributions}
        indices = [g.indices if len(index_dtypes) == 1 else tf.cast(g.indices, tf.int64)
                   for g in contributions]
        return tf.IndexedSlices(
            values=tf.concat([g.values for g in contributions], axis=0, name=name + "_values"),
            indices=tf.concat(indices, axis=0, name=name + "_indices"),
            dense_shape=contributions[0].dense_shape)
    return sum_dense(contributions, name=name)


def op_of(gradient):
    """The op that produces a gradient (the values op for IndexedSlices)."""
    return gradient.values.op if isinstance(gradient, tf.IndexedSlices) else gradient.op
