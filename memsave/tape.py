"""`memsave.GradientTape`: a drop-in for `tf.GradientTape` that computes with memsave.

    @tf.function
    def train_step(x, y):
        with memsave.GradientTape(checkpoints="memory") as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

It records as `tf.GradientTape` records (it is one), and notes which ops of the graph
were made while it recorded and when each tensor was watched. `gradient()` in a graph
(a `tf.function` body, a v1 graph) then works out which ops the tape recorded (made
while it recorded, inside no `stop_recording()`, reading a watched tensor, a watched
variable or the output of such an op, after it was watched), asks `memsave.gradients`
for the gradients of the sources the tape watches, and stops at every op on the way
that the tape did not record: the tape would not differentiate through those either.
Sources it does not watch get None (zeros with unconnected_gradients='zero'), as from
the tape. It answers as the plain tape (`tf.GradientTape.gradient`): called eagerly
(no graph to rewrite; a MemsaveWarning says so once, and `last_report()` each time), while another tape records (a
higher-order gradient: that tape would not record memsave's copies), for ragged or
sparse sources and targets, and in `jacobian` and `batch_jacobian`.
"""

import contextlib
import warnings

import tensorflow as tf

from memsave import inputs, rewrite
from memsave import report as report_lib
from memsave.errors import MemsaveWarning
from memsave.graph import _tf_private
from memsave.graph.select import TensorMap, get_backward_walk_ops, get_forward_walk_ops

_said_eager = []
_EAGER = ("memsave.GradientTape.gradient was called eagerly, where there is no graph to "
          "rewrite")


# memsave builds graphs; AutoGraph must not transpile it when a tf.function calls it
# (that is slow, and would turn its Python `if`s into graph conditionals).
_graph_code = tf.autograph.experimental.do_not_convert


class GradientTape(tf.GradientTape):
    """`tf.GradientTape` whose `gradient` keeps only checkpoints (memsave.gradients).

    Args:
      persistent, watch_accessed_variables: as tf.GradientTape's.
      checkpoints: as memsave.gradients' (default 'memory': the lowest predicted peak).
      offload: as memsave.gradients'.
    """

    def __init__(self, persistent=False, watch_accessed_variables=True, checkpoints="memory",
                 offload=False):
        super().__init__(persistent=persistent,
                         watch_accessed_variables=watch_accessed_variables)
        self._memsave_checkpoints = checkpoints
        self._memsave_offload = offload
        self._as_tape = False  # (answer as tf.GradientTape: jacobians, outside a patch)
        self._clear_records()

    def _clear_records(self):
        self._ranges = []  # (graph, first op index recorded, last op index or None)
        self._watched = TensorMap()  # a watched graph tensor -> op index when watched
        self._consumed = False  # (a non-persistent tape that gave its gradients)

    # -- what was recorded -------------------------------------------------------
    def __enter__(self):
        if self._consumed:  # (tf.GradientTape starts a new tape then)
            self._clear_records()
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
        self._clear_records()
        if recording:
            self._start_range()

    def watch(self, tensor):
        for t in tf.nest.flatten(tensor, expand_composites=True):
            if isinstance(t, tf.Tensor) and not _tf_private.is_eager_tensor(t):
                if t not in self._watched:
                    self._watched[t] = _tf_private.ops_made(t.graph)
        super().watch(tensor)

    def _start_range(self):
        if not tf.executing_eagerly():
            graph = tf.compat.v1.get_default_graph()
            self._ranges.append((graph, _tf_private.ops_made(graph) + 1, None))

    def _end_range(self):
        if self._ranges and self._ranges[-1][2] is None:
            graph, first, _ = self._ranges[-1]
            self._ranges[-1] = (graph, first, _tf_private.ops_made(graph))

    def _in_a_range(self, op):
        index = _tf_private.creation_index(op)
        return any(graph is op.graph and first <= index and (last is None or index <= last)
                   for graph, first, last in self._ranges)

    def _recorded_ops(self, graph):
        """The ops of `graph` the tape recorded: made while it recorded, reading a tensor it
        watched (after the watch), a variable it watched, or the output of such an op."""
        handles = [_tf_private.graph_tensor_of_variable(v, graph) for v in self.watched_variables()]
        frontier = [(c, -1) for h in handles if getattr(h, "graph", None) is graph
                    for c in h.consumers()]
        frontier += [(c, index) for t, index in self._watched.items() if t.graph is graph
                     for c in t.consumers()]
        recorded = set()
        while frontier:
            op, watched_at = frontier.pop()
            if (op in recorded or not self._in_a_range(op)
                    or _tf_private.creation_index(op) <= watched_at):
                continue
            recorded.add(op)
            frontier.extend((c, -1) for t in op.outputs for c in t.consumers())
        return recorded

    # -- gradients -----------------------------------------------------------------
    @_graph_code
    def jacobian(self, *args, **kwargs):
        """As tf.GradientTape.jacobian (the tape's own: it records and differentiates
        one row at a time, in a loop it builds)."""
        with self._the_tapes_own():
            return super().jacobian(*args, **kwargs)

    @_graph_code
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

    @_graph_code
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """As tf.GradientTape.gradient, computed by memsave.gradients in a graph."""
        targets = tf.nest.flatten(target)
        flat_sources = tf.nest.flatten(sources)
        if not self._memsave_can_answer(targets, flat_sources):
            return super().gradient(target, sources, output_gradients, unconnected_gradients)
        if self._consumed:
            raise RuntimeError("A non-persistent GradientTape can only be used to compute one "
                               "set of gradients (or jacobians)")
        if self._recording and not self._persistent:
            self._end_range()  # (tf.GradientTape stops recording here too)
        recorded = self._recorded_ops(targets[0].graph)
        handles = {id(v.handle) for v in self.watched_variables()}
        watched = [self._is_watched(s, recorded, handles) for s in flat_sources]
        xs = [s for s, w in zip(flat_sources, watched) if w]
        grads = self._memsave_gradients(targets, xs, recorded, output_gradients,
                                        unconnected_gradients)
        if not self._persistent:
            self._consumed = True
            self._tape = None  # (as tf.GradientTape leaves a tape it used up)
        result, found = [], iter(grads)
        zeros = tf.UnconnectedGradients(unconnected_gradients) == tf.UnconnectedGradients.ZERO
        for source, is_watched in zip(flat_sources, watched):
            if is_watched:
                result.append(next(found))
            else:
                result.append(_zeros_like(source) if zeros else None)
        return tf.nest.pack_sequence_as(sources, result)

    def _memsave_can_answer(self, targets, sources):
        """Whether memsave computes this call (else the plain tape answers)."""
        graph_tensors = all(isinstance(t, tf.Tensor) and not _tf_private.is_eager_tensor(t)
                            for t in targets)
        plain_sources = all(inputs.is_variable(s) or isinstance(s, tf.Tensor) for s in sources)
        if tf.executing_eagerly():
            self._say_eager()
            return False
        return (not self._as_tape and bool(targets) and graph_tensors and plain_sources
                and any(graph is targets[0].graph for graph, _, _ in self._ranges)
                and not _tf_private.a_tape_is_recording())

    def _say_eager(self):
        """Eagerly there is no graph to rewrite: last_report() says so, and a warning
        once per process (a user who forgot tf.function would never learn why memory
        did not drop)."""
        checkpoints = self._memsave_checkpoints
        name = checkpoints if isinstance(checkpoints, str) else getattr(
            checkpoints, "__name__", type(checkpoints).__name__)
        report_lib.record(report_lib.RewriteReport(strategy=name, region_ops=0, fallback=(
            f"memsave: {_EAGER}, so it answered as tf.GradientTape and saved no memory")))
        if not _said_eager:
            _said_eager.append(True)
            warnings.warn(f"memsave: {_EAGER}; it answers as tf.GradientTape and saves no "
                          "memory: call it inside a tf.function (this warning is given once)",
                          MemsaveWarning, stacklevel=4)

    def _is_watched(self, source, recorded, watched_handles):
        if inputs.is_variable(source):  # (a Keras 3 variable wraps the tf.Variable watched)
            return id(source.handle) in watched_handles
        return source in self._watched or source.op in recorded

    def _memsave_gradients(self, targets, xs, recorded, output_gradients, unconnected_gradients):
        if not xs:
            return []
        stops = self._not_recorded(targets, xs, recorded)
        grad_ys = None if output_gradients is None else tf.nest.flatten(output_gradients)
        return rewrite.gradients(targets, xs, grad_ys=grad_ys,
                                 checkpoints=self._memsave_checkpoints,
                                 offload=self._memsave_offload,
                                 stop_gradients=stops or None,
                                 unconnected_gradients=unconnected_gradients)

    @staticmethod
    def _not_recorded(targets, xs, recorded):
        """The outputs of the ops between `xs` and `targets` that the tape did not record:
        gradients stop there, as the tape's do."""
        graph = targets[0].graph
        seeds = [_tf_private.graph_tensor_of_variable(x, graph) if inputs.is_variable(x) else x
                 for x in xs]
        downstream = set(get_forward_walk_ops(seeds, inclusive=True))  # (from their readers)
        path = [op for op in get_backward_walk_ops([t.op for t in targets], inclusive=True)
                if op in downstream]
        return [t for op in path if op not in recorded for t in op.outputs]


def _zeros_like(source):
    if inputs.is_variable(source) and source.shape.is_fully_defined():
        return tf.zeros(source.shape, source.dtype)
    return tf.zeros_like(source)
