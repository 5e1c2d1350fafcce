"""Summing gradient contributions from several segments, placed as tf.gradients places them.

Gradients of checkpoints feed the next segment as `grad_ys`, so they are summed
densely. Gradients of xs stay `tf.IndexedSlices` when every contribution is one:
densifying a large embedding gradient costs exactly the memory memsave exists to
save.

Placement follows tf.gradients' own aggregation: contributions are summed per
device, each partial sum colocated with its first contribution, then the partial
sums are added (the caller puts all of it under the colocation of the tensor's op
when gradients are colocated with ops).
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
    by_device = {}
    for g in dense:
        by_device.setdefault(g.device or "", []).append(g)
    graph = tf.compat.v1.get_default_graph()
    partial_sums = []
    for device in sorted(by_device):
        group = by_device[device]
        with graph.colocate_with(group[0].op, ignore_existing=True):
            partial_sums.append(group[0] if len(group) == 1 else tf.math.add_n(group, name=name))
    if len(partial_sums) == 1:
        return partial_sums[0]
    return tf.math.add_n(partial_sums, name=name)


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
