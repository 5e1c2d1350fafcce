"""The builder: builds a memsave.planning.Plan into the graph, and nothing else.

It decides nothing about the plan: the Plan says which tensors are kept, which are
offloaded, the parts of the backward pass in their order and the ops of each segment,
whether segments read their checkpoints, recompute ahead, order their large gradient
ops (and which are large), which weight gradients come last. What it works out is how:
which gradients actually arrived (a checkpoint in stop_gradients, or one no gradient
reaches, ends nothing, so its segment copies only what the others need), and where each
wait goes. For each part, in the Plan's order:

- a segment's ops are copied, reading their inputs (checkpoints, kept ops' outputs,
  tensors from outside the region) through identities of their own, which its
  `tf.gradients` call treats as xs and stops (an identity, not a `stop_gradient`:
  the gradients memsave returns stay differentiable, e.g. for a gradient penalty or
  a Hessian-vector product), and differentiated with the accumulated gradient of
  what it ends at; its gradient ops read small tensors (and, where the plan says so,
  the checkpoint it ends at) as the forward pass made them, so the copies that would
  only remake them never run;
- the copies wait, through control inputs, for what must come first (the forward
  ys, or the gradient of their checkpoints and the whole backward pass of the
  segment built before), or they would run during the forward pass and nothing
  would be saved; weight gradients larger than what they read
  (StepGraph.deferred) wait for the last segment's backward pass;
- ops that are not recomputed (control flow, stateful ops) are differentiated as
  they are, each once, with the whole gradient of their outputs;

then the gradients of the xs are summed, kept sparse where possible (a variable
read's gradient is its variable's). Before returning, the new ops are checked for a
cycle. Under XLA, which drops control inputs, the waits are data dependencies
through conditionals (memsave.xla_gates).
"""

import contextlib
import logging

import tensorflow as tf

from memsave import aggregate, backward, ordering, xla_gates
from memsave import offload as offload_lib
from memsave import report as report_lib
from memsave.graph import _tf_private
from memsave.graph import loops as graph_loops
from memsave.graph.select import TensorMap, TensorSet
from memsave.graph.transform import copy_with_input_replacements
from memsave.region import estimated_bytes

logger = logging.getLogger(__name__)

# The real tf.gradients, captured at import: memsave.patch() may replace the public
# names, and the per-segment calls must still reach TensorFlow's own implementation.
tf_gradients = tf.compat.v1.gradients


def build(plan, ys, xs, grad_ys, options):
    """Builds `plan` (a memsave.planning.Plan without a fallback) into the graph.

    Args:
      plan: the Plan.
      ys, xs, grad_ys: the call's, normalised (memsave.inputs).
      options: the call's tf.gradients options (memsave.rewrite's _Options).
    Returns:
      (the gradients of `xs`, a Built saying what was built).
    Raises:
      MemsaveError: where the new ops would close a cycle (none is left runnable).
    """
    graph = ys[0].graph
    made_before = len(graph.get_operations())
    builder = _Builder(plan, ys, xs, grad_ys, options)
    with tf.name_scope(options.name):
        result = builder.run()
    ordering.check_acyclic(graph.get_operations()[made_before:])
    return result, builder.built


class Built:
    """What the builder built, for the report: the segments, the checkpoints read back
    from the host, the bytes moved there and back, the weight gradients made last."""

    def __init__(self):
        self.segments = []
        self.offloaded = []
        self.moved_bytes = 0
        self.deferred_gradients = 0

    def into(self, report):
        report.segments = list(self.segments)
        report.offloaded = list(self.offloaded)
        report.offload_moved_bytes = self.moved_bytes
        report.deferred_gradients = self.deferred_gradients
        return report


class _Builder:
    """One build: the parts of the Plan, and the gradient contributions between them."""

    def __init__(self, plan, ys, xs, grad_ys, options):
        self.ys, self.xs = ys, xs
        self.plan = plan
        # grad_ys may be Python numbers or numpy arrays (checked by memsave.inputs).
        self.grad_ys = None if grad_ys is None else [
            None if g is None else tf.convert_to_tensor(g, dtype=y.dtype.base_dtype)
            for g, y in zip(grad_ys, ys)]
        self.region = plan.region
        self.step_graph = plan.step_graph
        self.checkpoints = TensorSet(plan.checkpoint_tensors)
        self.options = options
        self.built = Built()
        self.pending = TensorMap()  # tensor -> list of gradient contributions
        self.totals = TensorMap()  # an x made from other xs -> its whole gradient
        self.under_xla = plan.environment.under_xla  # (see memsave.xla_gates)
        self.offloader = offload_lib.Offloader(plan.offload, self.step_graph.unknown_dim_size)
        self.triggers = []  # each segment's trigger ops, in the order the backward runs them
        self.trigger_tensors = []  # and one tensor of each (under XLA, the gate's)
        # Weight gradients made after the last segment (StepGraph.deferred; none under
        # gate_gradients): per segment, the op sets that make them, and the segment's
        # other gradients.
        self.defer = bool(plan.deferred)
        self.deferred_cones, self.other_gradients = [], []
        # Per segment, the ops making its gradients but the deferred ones, sparse ones
        # included (what the next segment's copies wait for: _previous_backward).
        self.backward_ops = []

    def run(self):
        self._seed_ys_outside_the_last_segment()
        for part in self.plan.parts:
            if part.kind == backward.KEPT:
                self._kept_part(part)
            elif part.is_last_segment:
                self._last_segment(part.ops)
            else:
                self._earlier_segment(part.checkpoint_group, part.ops)
        self._defer_weight_gradients()
        result = self._gradients_of_xs()
        self.built.moved_bytes = self.offloader.moved_bytes
        return result

    # -- steps 4 and 5 -----------------------------------------------------------
    def _seed_ys_outside_the_last_segment(self):
        """The gradients of the ys the last segment does not end at (made by an op that is
        not recomputed, xs, and checkpoints) start as their grad_ys."""
        grad_ys = self.grad_ys or [None] * len(self.ys)
        for y, g in zip(self.ys, grad_ys):
            if (y.op not in self.region or y in self.checkpoints) and self.region.depends_on_xs(y):
                self._add(y, g if g is not None else tf.ones_like(y))

    def _last_segment(self, ops):
        grad_ys = self.grad_ys or [None] * len(self.ys)
        seg_ys, seg_grads, seen = [], [], TensorSet()
        for y, g in zip(self.ys, grad_ys):
            if y.op not in self.region or y in self.checkpoints:
                continue
            # A y that an op that is not recomputed reads gets that op's gradient too
            # (once, however often the y is listed).
            from_kept = [] if y in seen else self.pending_of(y)
            seen.add(y)
            if from_kept:
                g = self._summed(y, [g if g is not None else tf.ones_like(y)] + from_kept)
            seg_ys.append(y)
            seg_grads.append(g)
        if all(g is None for g in seg_grads):
            seg_grads = None
        else:
            seg_grads = [g if g is not None else tf.ones_like(y) for y, g in zip(seg_ys, seg_grads)]
        self._segment(seg_ys, seg_grads, [y.op for y in self.ys], seg_ys[0], "last_segment", ops)

    def _earlier_segment(self, group, ops):
        seg_ys, seg_grads = [], []
        for c in group:
            d_c = self._summed(c, self.pending_of(c))
            if d_c is not None and c not in self.options.stop:
                seg_ys.append(c)
                seg_grads.append(d_c)
        if seg_ys:
            self._segment(seg_ys, seg_grads, [g.op for g in seg_grads], seg_grads[0],
                          f"segment_{self.region.position[group[0].op]}",
                          ops if len(seg_ys) == len(group) else
                          backward.needed_ops(seg_ys, ops, self.checkpoints))

    def _kept_part(self, part):
        """Differentiates ops that are not recomputed (memsave.backward), as they are,
        once, with the whole gradient of their outputs: every part sending gradient to
        them came before. An x among their outputs gets that whole gradient as its
        result (tf.gradients' answer for an x computed from other xs)."""
        ends_at, grads = [], []
        for t in part.ends_at:
            contributions = self.pending_of(t)
            if not contributions:
                continue
            if self.region.is_x(t):
                self.totals[t] = self._summed(t, contributions, keep_sparse=True)
            ends_at.append(t)
            grads.append(self._summed(t, contributions))
        if not ends_at:
            return
        # tf.gradients answers an x that its op makes beside outputs with a gradient with
        # zeros, not None: asked for here too, it answers the same.
        quiet_xs = [t for op in part.ops for t in op.outputs
                    if self.region.is_x(t) and t not in self.totals]
        with tf.name_scope("kept"):
            copy = None if quiet_xs else self._recomputing_copy(part, ends_at)
            if copy is not None:
                ends_at = [copy.outputs[t.value_index] for t in ends_at]
            quiet_ys, quiet_grads = (graph_loops.quiet_list_gradients(copy, ends_at)
                                     if copy is not None else ([], []))
            results = tf_gradients(ends_at + quiet_ys, part.reads + quiet_xs,
                                    grad_ys=grads + quiet_grads,
                                    stop_gradients=part.reads + list(self.options.stop),
                                    **self.options.passed)
            if copy is not None:
                # (After tf.gradients, which adds the inputs its gradient reads to the
                # loop: a NodeDef lists control inputs last.)
                ordering.wait_for({copy}, [g.op for g in grads])
        for t, g in zip(part.reads, results):
            if g is not None:
                self._add(t, g)
        for t, g in zip(quiet_xs, results[len(part.reads):]):
            if g is not None:
                self.totals[t] = g

    def _recomputing_copy(self, part, ends_at):
        """For a loop the plan recomputes, its recomputing copy (memsave.graph.loops), whose
        gradient the part takes in place of the loop's; None otherwise. The copy reads the
        loop's inputs and waits for the loop's output gradients, so it runs in the backward
        pass, and the loop itself, which nothing differentiates, keeps nothing for it."""
        if len(part.ops) != 1 or part.ops[0] not in self.plan.recomputed_loops:
            return None
        loop = part.ops[0]
        return graph_loops.recomputing_copy(loop, f"{loop.name.split('/')[-1]}_recompute",
                                            [t.value_index for t in ends_at],
                                            chunk=dict(self.plan.loop_chunks).get(loop, 1))

    def _segment(self, seg_ys, seg_grad_ys, trigger_ops, trigger, label, ops):
        """Copies `ops` (the planned segment's that `seg_ys` needs) and differentiates them.

        The copies wait for `trigger_ops` and the backward pass of the segment built
        before (`_previous_backward`; control inputs), or where the plan recomputes ahead
        for the previous segment's, which the backward pass completes earlier, so they
        run beside that segment's backward pass; under XLA, which drops control inputs
        and merges equal computations, they read their inputs through a data dependency
        on `trigger` (or the previous segment's) as well (see `xla_gates.gate_from`).
        """
        local_inputs = backward.segment_reads(ops, self.region, self.checkpoints)
        # (Identities of a call's outputs, made before the copies: a segment reroutes the
        # readers of the tensors it recomputes that are made after its copies.)
        after = trigger_ops + self._previous_backward(trigger_ops)
        self.triggers.append(ordering.done_ops(after))
        self.trigger_tensors.append(trigger)
        wait = -2 if self.plan.recomputes_ahead and len(self.triggers) > 1 else -1
        with tf.name_scope(label):
            gate = xla_gates.gate_from(self.trigger_tensors[wait]) if self.under_xla else None
            replacements = TensorMap((t, self._local_input(t, gate)) for t in local_inputs)
            copy = copy_with_input_replacements(ops, replacements, name_scope="recompute")
            for op in ops:
                # A copy runs where its original ran, and its gradient ops are colocated
                # with the original, as tf.gradients colocates them.
                _tf_private.colocate(copy.transformed(op), op)
            locals_ = [replacements[t] for t in local_inputs]
            self._order_after(copy, locals_, self.triggers[wait])
            copied_ys = [copy.transformed(y) for y in seg_ys]
            stop = [copy.transformed(t) for t in self.options.stop if copy.transformed(t) is not None]
            made_before = max(_tf_private.creation_index(t.op) for t in copied_ys + locals_)
            grads = tf_gradients(copied_ys, locals_, grad_ys=seg_grad_ys,
                                  stop_gradients=stop + locals_, **self.options.passed)
            self._read_copies(ops, copy, made_before)
            _trace_to_originals(copy, made_before)
            self._read_from_forward(ops, copy, made_before, gate)
            deferred = self._deferred_cones(local_inputs, grads, made_before)
            if self.plan.orders_backward:
                ordering.one_after_another(ordering.large_ops_needed_by(
                    grads, made_before, deferred, self.plan.large_bytes,
                    self.step_graph.unknown_dim_size))
            if gate is not None:
                # The gradients leave the segment materialised too: XLA would otherwise
                # fuse their last elementwise ops into the next segments' readers and keep
                # this segment's activations alive until then.
                grads = [xla_gates.gated(g, gate) for g in grads]
            if self.plan.serializes_conv_gradients:
                ordering.serialize_conv_gradients(copy.ops, deferred)
        for t, g in zip(local_inputs, grads):
            if g is not None:
                self._add(t, g)
        running = ordering.copies_that_run(copy.ops, made_before)
        self.built.segments.append(report_lib.SegmentInfo(
            ends_at=[y.name for y in seg_ys], copied_ops=len(copy), recomputed_ops=len(running),
            recomputed_bytes=sum(estimated_bytes(t, self.step_graph.unknown_dim_size)
                                 for op in running for t in op.outputs)))
        logger.debug("memsave: %s recomputes %d ops ending at %s", label, len(running),
                     [y.name for y in seg_ys])

    def _read_copies(self, ops, copy, made_before):
        """Gradient ops of the segment (made after `made_before`) that read a tensor of
        the forward pass the segment recomputes read its copy instead. Registered
        gradients read their own op's (the copy's) inputs and outputs; a custom
        gradient (`tf.custom_gradient`: Keras' swish, a user's) reads the tensors its
        closure holds, the forward pass's, which would otherwise stay alive from the
        forward pass to this segment's backward. Tensors ForwardReads names stay read
        from the forward pass (`_read_from_forward`)."""
        graph = self.step_graph
        for op in ops:
            for t in op.outputs:
                tid = graph.tensor_id.get((op, t.value_index))
                if tid is None or self.plan.forward_reads(tid):
                    continue
                ordering.reroute_readers(t, copy.transformed(t), made_before)

    def _read_from_forward(self, ops, copy, made_before, gate):
        """The segment's gradient ops (made after `made_before`) read the tensors that
        ForwardReads names as the forward pass made them, not from their
        copies; a copy that nothing else reads is never run (TensorFlow prunes it).
        Under XLA they read them through the segment's conditional, as the copies read
        their inputs (see `xla_gates.gate_from`)."""
        graph = self.step_graph
        for op in ops:
            for t in op.outputs:
                tid = graph.tensor_id.get((op, t.value_index))
                if tid is None or not self.plan.forward_reads(tid):
                    continue
                copied = copy.transformed(t)
                if not ordering.readers_made_after(copied, made_before):
                    continue
                source = t if gate is None else xla_gates.gated(t, gate, name="forward")
                ordering.reroute_readers(copied, source, made_before)

    def _deferred_cones(self, local_inputs, grads, made_before):
        """Records the ops that make this segment's deferred weight gradients (one set
        per gradient: the ops made by its tf.gradients call that nothing else reads), the
        segment's other gradients, and the ops making those; returns all the deferred
        ops."""
        cones = []
        # The segment's gradients are read later, by segments not yet built: no op
        # making one may wait, but the deferred one's own.
        returned = TensorSet(g for g in grads if isinstance(g, tf.Tensor))
        if self.defer:
            deferred_tensors = self.plan.deferred
            tensor_id = self.step_graph.tensor_id
            for t, g in zip(local_inputs, grads):
                if (isinstance(g, tf.Tensor)
                        and tensor_id.get((t.op, t.value_index)) in deferred_tensors):
                    cone = ordering.exclusive_cone(g, made_before, returned)
                    if cone:
                        cones.append(cone)
        deferred = set().union(*cones)
        self.deferred_cones.append(cones)
        self.other_gradients.append(
            [g for g in grads if isinstance(g, tf.Tensor) and g.op not in deferred])
        made = [t.op for g in grads if g is not None for t in (
            (g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,))
            if t.op not in deferred]
        self.backward_ops.append(
            [op for op in made if not ordering.made_from_only(op, returned, made_before)])
        return deferred

    def _defer_weight_gradients(self):
        """Makes the deferred weight gradients wait for the backward pass of the last
        segment built (the first in the forward pass): for its other gradients, or, where
        it has none, for what its own deferred gradients read. Through control inputs;
        under XLA, which drops those, by reading their inputs through a conditional on
        a value computed from all of those tensors (as copies wait, see `xla_gates.gate_from`)."""
        if not any(self.deferred_cones):
            return
        last_cones = self.deferred_cones[-1]
        trigger = self.other_gradients[-1] or list(TensorSet(
            t for cone in last_cones for op in cone for t in op.inputs if t.op not in cone))
        trigger = [t for t in trigger if xla_gates.is_number(t.dtype)]
        if not trigger:
            return
        with tf.name_scope("deferred"):
            if self.under_xla:
                # (a sum of 1s: it exists only once every trigger does)
                wait = xla_gates.gate_inputs
                after = tf.add_n([xla_gates.gate_from(t) for t in trigger])
            else:
                wait, after = ordering.wait_for, [t.op for t in trigger]
            count = 0
            for cones in self.deferred_cones[:-1]:
                for cone in cones:
                    wait(cone, after)
                    count += 1
        self.built.deferred_gradients = count + len(last_cones)

    def _local_input(self, t, gate):
        """The segment's own view of outside tensor `t` (the module's `_local_input`); of
        a narrowed checkpoint (ForwardReads.narrowed), a Cast of the view of its narrower
        input, as the Cast that made it, on its device."""
        tid = self.step_graph.tensor_id.get((t.op, t.value_index))
        source = self.plan.forward_reads.narrowed.get(tid)
        if source is None:
            return xla_gates.local_input(self._source_of(t), gate)
        narrow = xla_gates.local_input(self.step_graph.tensors[source], gate)
        with tf.device(t.op.device) if t.op.device else contextlib.nullcontext():
            return tf.raw_ops.Cast(x=narrow, DstT=t.dtype, Truncate=t.op.get_attr("Truncate"),
                                   name="narrowed_input")

    def _source_of(self, t):
        """Where a segment reads input `t` from: an offloaded checkpoint's copy back, which
        leaves the host once the segment a prefetch distance earlier in the backward
        pass has its gradient and the segment before it its whole backward pass
        (memsave.offload, `_previous_backward`); `t` itself otherwise."""
        if t not in self.checkpoints or t.name not in self.plan.offloaded:
            return t
        prefetch_from = max(len(self.triggers) - 1 - self.plan.offload.prefetch, 0)
        self.built.offloaded.append(t.name)
        return self.offloader.copy_back(t, self.triggers[prefetch_from])

    def _previous_backward(self, trigger_ops):
        """A NoOp waiting for the ops making the gradients of the segment built last (but
        its deferred weight gradients, which wait for later segments), or nothing where
        those are all among `trigger_ops`: what follows a trigger waits for these too,
        as the memory model has that segment's backward pass done when its last
        gradient is. Waiting for the trigger alone, an executor ran the next segment's
        recomputation while a weight gradient still held the segment's activation
        (AMD EPYC without AVX-512, a float64 16 x tanh(256) MLP's budget plan: median 63.0
        MiB for 54.5 predicted; 50-55.5 with it). (The model may recompute ahead earlier
        than this lets it: an over-prediction, on the safe side.)"""
        previous = self.backward_ops[-1] if self.backward_ops else []
        if all(op in trigger_ops for op in previous):  # (a chain's: the trigger is all of it)
            return []
        # (One NoOp waiting for them all: the copies then wait for one op each, not for
        # every gradient of the segment before.)
        return [tf.group(*ordering.done_ops(previous), name="previous_backward_done")]

    @staticmethod
    def _order_after(copy, locals_, trigger_ops):
        """Step 6: the copies wait for `trigger_ops`, through the segment's local inputs
        (`locals_`) where they read one: Grappler does not fuse a node with a control
        input of its own (a recomputed batch norm and its ReLU would run as two oneDNN
        kernels instead of one, as in the forward pass)."""
        ordering.wait_for(set(copy.ops) | {t.op for t in locals_}, trigger_ops)

    # -- bookkeeping ---------------------------------------------------------------
    def _summed(self, t, contributions, keep_sparse=False):
        """The sum of `t`'s gradient contributions (dense, or sparse where all are), made
        where tf.gradients makes it: with t's op when colocating gradients with ops,
        under the caller's device scope otherwise."""
        placement = contextlib.nullcontext()
        if self.options.colocate:
            placement = tf.compat.v1.get_default_graph().colocate_with(t.op, ignore_existing=True)
        with placement:
            if keep_sparse:
                return aggregate.sum_keeping_sparse(contributions)
            return aggregate.sum_dense(contributions)

    def _add(self, t, gradient):
        contributions = self.pending.get(t)
        if contributions is None:
            self.pending[t] = contributions = []
        contributions.append(gradient)

    def pending_of(self, t):
        return self.pending.get(t, [])

    # -- step 7 ----------------------------------------------------------------------
    def _add_variable_reads(self, per_x):
        """Adds the gradient of each read of a variable that is one of the xs to that x's
        contributions, as tf.gradients does (a read's gradient is the variable's, sparse
        where every contribution is: a Keras Embedding reads its whole table and gathers
        rows). A training step reads thousands of variables: a gradient call per read
        would build an identity and a gradient op for each."""
        positions = TensorMap()
        for i, x in enumerate(self.xs):
            if x.dtype == tf.resource:
                positions[x] = positions.get(x, []) + [i]
        for t in self.pending.keys():
            if t.op.type != "ReadVariableOp" or t.op.inputs[0] not in positions:
                continue
            gradient = self._summed(t, self.pending_of(t), keep_sparse=True)
            for i in positions[t.op.inputs[0]]:
                per_x[i].append(gradient)

    def _gradients_of_xs(self):
        per_x = [list(self.pending_of(x)) for x in self.xs]
        self._add_variable_reads(per_x)
        result = [self.totals[x] if x in self.totals else self._summed(x, c, keep_sparse=True)
                  for x, c in zip(self.xs, per_x)]
        if self.options.unconnected == tf.UnconnectedGradients.ZERO:
            result = [g if g is not None else _tf_private.zero_gradient_like(x)
                      for g, x in zip(result, self.xs)]
        return result


def _trace_to_originals(copy, made_before):
    """The gradient ops of a segment's copies (made after `made_before`) name the user's
    forward op as the op they came from, as tf.gradients' do: TensorFlow's error messages
    about a gradient op then point at the user's code, not at memsave's copy."""
    if not copy.ops:
        return
    for op in _tf_private.ops_made_after(copy.ops[0].graph, made_before):
        source = _tf_private.original_op(op)
        original = copy.original(source) if source is not None else None
        if original is not None:
            _tf_private.set_original_op(op, original)
