"""`memsave.GradientTape`: a drop-in for `tf.GradientTape` that computes with memsave.

    @tf.function
    def train_step(x, y):
        with memsave.GradientTape(checkpoints="memory") as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

It records as `tf.GradientTape` records (it is one), and notes which ops of the graph
were made while it recorded. `gradient()` in a graph (a `tf.function` body, a v1
graph) then asks `memsave.gradients` for the gradients of the sources the tape
watches, stopping at every op on the way that the tape did not record (made before it
started, after it stopped, inside `stop_recording()`): the tape would not
differentiate through those either. Sources it does not watch get None (zeros with
unconnected_gradients='zero'), as from the tape. Called eagerly, it is the tape: there
is no graph to rewrite (a log line says so once). `jacobian` and `batch_jacobian` are
the tape's own.
"""

import contextlib
import logging

import tensorflow as tf

from memsave import inputs, rewrite
from memsave.graph import _tf_private
from memsave.graph.select import TensorSet, get_backward_walk_ops, get_forward_walk_ops

logger = logging.getLogger(__name__)
_said_eager = []


class GradientTape(tf.GradientTape):
    """`tf.GradientTape` whose `gradient` keeps only checkpoints (memsave.gradients).

    Args:
      checkpoints: as memsave.gradients' (default 'memory': the lowest predicted peak).
      offload: as memsave.gradients'.
      persistent, watch_accessed_variables: as tf.GradientTape's.
    """

    def __init__(self, persistent=False, watch_accessed_variables=True, checkpoints="memory",
                 offload=False):
        super().__init__(persistent=persistent,
                         watch_accessed_variables=watch_accessed_variables)
        self._memsave_checkpoints = checkpoints
        self._memsave_offload = offload
        self._ranges = []  # (graph, first op id recorded, last op id recorded or None)
        self._watched = TensorSet()
        self._memsave_used = False
        self._as_tape = False  # (inside jacobian and batch_jacobian: the tape's own)

    # -- what was recorded -------------------------------------------------------
    def __enter__(self):
        result = super().__enter__()
        self._start_range()
        return result

    def __exit__(self, *exc_info):
        self._end_range()
        return super().__exit__(*exc_info)

    @contextlib.contextmanager
    def stop_recording(self):
        with super().stop_recording():
            self._end_range()
            try:
                yield
            finally:
                self._start_range()

    def reset(self):
        super().reset()
        recording = bool(self._ranges) and self._ranges[-1][2] is None
        self._ranges = []
        self._watched = TensorSet()
        if recording:
            self._start_range()

    def watch(self, tensor):
        for t in tf.nest.flatten(tensor):
            if isinstance(t, tf.Tensor) and not _tf_private.is_eager_tensor(t):
                self._watched.add(t)
        super().watch(tensor)

    def _start_range(self):
        if not tf.executing_eagerly():
            graph = tf.compat.v1.get_default_graph()
            self._ranges.append((graph, _tf_private.ops_made(graph) + 1, None))

    def _end_range(self):
        if self._ranges and self._ranges[-1][2] is None:
            graph, first, _ = self._ranges[-1]
            self._ranges[-1] = (graph, first, _tf_private.ops_made(graph))

    def _recorded(self, op):
        index = _tf_private.creation_index(op)
        return any(graph is op.graph and first <= index and (last is None or index <= last)
                   for graph, first, last in self._ranges)

    # -- gradients -----------------------------------------------------------------
    def jacobian(self, *args, **kwargs):
        """As tf.GradientTape.jacobian (the tape's own: it records and differentiates
        one row at a time, in a loop it builds)."""
        with self._the_tapes_own():
            return super().jacobian(*args, **kwargs)

    def batch_jacobian(self, *args, **kwargs):
        """As tf.GradientTape.batch_jacobian (the tape's own)."""
        with self._the_tapes_own():
            return super().batch_jacobian(*args, **kwargs)

    @contextlib.contextmanager
    def _the_tapes_own(self):
        previous, self._as_tape = self._as_tape, True
        try:
            yield
        finally:
            self._as_tape = previous

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """As tf.GradientTape.gradient, computed by memsave.gradients in a graph."""
        targets = tf.nest.flatten(target)
        graph_targets = [t for t in targets if isinstance(t, tf.Tensor)
                         and not _tf_private.is_eager_tensor(t)]
        if (self._as_tape or tf.executing_eagerly() or len(graph_targets) != len(targets)
                or not targets
                or not any(graph is targets[0].graph for graph, _, _ in self._ranges)):
            if tf.executing_eagerly() and not _said_eager:
                _said_eager.append(True)
                logger.info("memsave.GradientTape: called eagerly, so it answers as "
                            "tf.GradientTape; memory is saved inside a tf.function")
            return super().gradient(target, sources, output_gradients, unconnected_gradients)
        if self._memsave_used and not self._persistent:
            raise RuntimeError("A non-persistent GradientTape can only be used to compute one "
                               "set of gradients (or jacobians)")
        self._memsave_used = True
        if self._recording and not self._persistent:
            self._end_range()  # (tf.GradientTape stops recording here too)
        flat_sources = tf.nest.flatten(sources)
        watched = [self._is_watched(s) for s in flat_sources]
        xs = [s for s, w in zip(flat_sources, watched) if w]
        grads = self._memsave_gradients(targets, xs, output_gradients, unconnected_gradients)
        result, found = [], iter(grads)
        for source, is_watched in zip(flat_sources, watched):
            if is_watched:
                result.append(next(found))
            elif tf.UnconnectedGradients(unconnected_gradients) == tf.UnconnectedGradients.ZERO:
                result.append(tf.zeros(source.shape, source.dtype))
            else:
                result.append(None)
        return tf.nest.pack_sequence_as(sources, result)

    def _is_watched(self, source):
        if inputs.is_variable(source):  # (a Keras 3 variable wraps the tf.Variable watched)
            return any(v.handle is source.handle for v in self.watched_variables())
        return isinstance(source, tf.Tensor) and source in self._watched

    def _memsave_gradients(self, targets, xs, output_gradients, unconnected_gradients):
        if not xs:
            return []
        stops = self._unrecorded(targets, xs)
        grad_ys = None if output_gradients is None else tf.nest.flatten(output_gradients)
        return rewrite.gradients(targets, xs, grad_ys=grad_ys,
                                 checkpoints=self._memsave_checkpoints,
                                 offload=self._memsave_offload,
                                 stop_gradients=stops or None,
                                 unconnected_gradients=unconnected_gradients)

    def _unrecorded(self, targets, xs):
        """The outputs of the ops between `xs` and `targets` that the tape did not
        record: gradients stop there, as the tape's do."""
        graph = targets[0].graph
        seeds = [_tf_private.graph_tensor_of_variable(x, graph) if inputs.is_variable(x) else x
                 for x in xs]
        downstream = set(get_forward_walk_ops(seeds, inclusive=False))
        path = [op for op in get_backward_walk_ops([t.op for t in targets], inclusive=True)
                if op in downstream]
        return [t for op in path if not self._recorded(op) for t in op.outputs]
