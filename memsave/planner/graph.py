"""The training step as the planner sees it: ops and tensors as integers.

`StepGraph.build(region)` walks the forward pass once (every op the ys depend
on) and records, in plain Python lists indexed by integers, what the memory and
cost models need: tensor sizes, producers and consumers, which ops may be
recomputed, what each op's gradient reads, which outputs share their input's
buffer. Planning then never touches TensorFlow objects again, so evaluating a
candidate plan costs a pass over lists, not thousands of graph API calls.
"""

import logging

import tensorflow as tf

from memsave.environment import Environment
from memsave.graph.select import BACK_EDGE_OP_TYPES, get_backward_walk_ops
from memsave.graph import _tf_private
from memsave.graph import loops as graph_loops
from memsave.planner import (buffer_links, call_gradients, constant_folding, costs,
                             custom_gradients, deferral, kernels, opinfo, shapes, xla_buffers)
from memsave.planner.loops import (gradient_reads_output, list_bytes, list_length,
                                   loop_memory, recomputed, tensor_bytes)
from memsave.planner.op_kinds import FORWARD, KEPT, REGION, RESIDENT

logger = logging.getLogger(__name__)

# How an op takes part in the step (StepGraph.kind): RESIDENT, REGION, KEPT, FORWARD
# (memsave.planner.op_kinds); the planner's modules import them from here. A region
# tensor of at most 1/SMALL_FRACTION of the largest is read from the forward pass
# rather than recomputed (StepGraph.small).
SMALL_FRACTION = 1024


class StepGraph:
    """The forward pass of one gradients call, compiled to integer lists.

    Attributes:
      ops: tf.Operations in topological order (index = op id).
      kind: per op, RESIDENT / REGION / KEPT / FORWARD.
      inputs, outputs: per op, tensor ids.
      tensors: tf.Tensors (index = tensor id).
      size: per tensor, bytes (a variable handle counts its variable's bytes).
      producer: per tensor, op id.
      consumers: per tensor, op ids reading it.
      alias_of: per tensor, the tensor whose buffer it shares, or -1.
      grad_reads: per op, tensor ids its gradient reads.
      grad_inputs: per op, (input tensor id, gradient bytes) for inputs that receive
        a gradient (they depend on the xs).
      grad_temporaries: per op, bytes of short-lived tensors its gradient makes
        (output-sized products reduced to a broadcast input's size, kernel workspaces).
      rewrite_grad_temporaries: op -> the same in memsave's rewrite, where it differs
        (convolution gradients that the rewrite runs one after the other).
      cost: per region or kept op, what running it once costs (memsave.planner.costs:
        matmul FLOPs; a loop: all its iterations), without the per-op overhead.
      costs: the Costs those come from (the one active when the step was built).
      is_x, is_y: per tensor, booleans.
      deferred: op id -> the (tensor id, gradient bytes) of its gradient that the
        rewrite computes last, after every segment's backward pass (see
        `_find_deferred`).
      deferred_tensors: the tensor ids whose gradients those are (every op reading
        one, that gives it a gradient, is in `deferred` for it).
      deferred_through: op id -> the (tensor id, gradient bytes) of its gradient the
        rewrite makes last because they make a deferred gradient: a convolution's
        filter gradient of a weight read through a Cast (deferral._defer_through).
      conv_workspaces: op id -> (filter gradient's, input gradient's) im2col bytes
        of a convolution's gradient (the kernels' conv_gradient_workspace), where any.
      unknown_dims: names of floating tensors with unknown dimensions, whose size
        assumed `unknown_dim_size` for them.
      largest_bytes: the region's largest tensor.
      small_bytes: 1/1024 of it.
      workspaces: ids of the tensors whose size the graph does not give but the
        kernels on this machine decide (the kernels' workspace_bytes: a batch norm's
        third reserve space); `size` holds that size.
      custom_gradient_ops: ids of the ops whose gradient is not their type's own (a
        tf.custom_gradient's IdentityN): what it reads, where it sends gradients and
        its temporaries come from building it once in a scratch graph
        (memsave.planner.custom_gradients), or, where that fails, it reads everything.
        An op none of whose outputs gets a gradient (a custom gradient's forward ops)
        has none: its grad_reads, grad_inputs and grad_temporaries are empty.
      held: op id -> bytes its gradient keeps of its forward run that no tensor of the
        graph shows, from the op (or its recomputed copy) to its gradient: a
        tf.function call's intermediates (memsave.planner.call_gradients).
      call_runs: op id -> the memsave.planner.call_gradients.BackwardRun of a tf.function
        call's backward function: what of what it reads it has freed by its peak, and
        its temporaries then (in grad_temporaries).
      folded: op id -> bytes of the product Grappler's constant folding makes of its
        output in the forward pass, held to its gradient (buffer_links.link_folded_products).
      constants: ids of the ops whose outputs are constants when the step runs: Consts, and
        what Grappler folds into one (memsave.planner.constant_folding; kind RESIDENT).
      pieces: tensor id -> how many allocations of equal size its bytes are, where more
        than one: a TensorList's elements (loops.list_length). grad_pieces: the same for
        the gradient of every TensorList that gets one (1 where its length is unknown).
      boundaries: ids of the region tensors every plan keeps (segments end there), so
        that each op's gradient is taken once, with its whole gradient (memsave.backward):
        those that ops which are not recomputed read (floating, complex or variant: a
        TensorList), and ys that
        region ops read (a y upstream of another: its gradient is its grad_y plus what
        comes back from the later one).
      loops: op id -> memsave.planner.loops.LoopMemory, for each while_v2 loop on the path
        (never recomputed as an op: TensorFlow's gradient keeps what its body's gradient
        reads from every iteration, the rewrite may differentiate a recomputing copy).
      loop_mode: the memsave.recompute_loops mode the step was built under.
      xla_cpu: whether XLA programs run on a CPU (no GPU): a jit-compiled call's gradient
        then holds the temporaries its program hides (memsave.planner.xla_buffers).
      kernels: the profile of the kernels that run the step (memsave.planner.kernels,
        from Environment.kernels): the workspaces they allocate.
      conv_threads: intra-op threads of TensorFlow's own CPU convolution gradients, whose
        im2col buffers count among their temporaries (Environment.conv_threads), or 0.
      inter_op_threads: how many gradient steps run side by side where they do not wait
        for each other (Environment.inter_op_threads; memsave.planner.schedule).
      forwarded: ids of the tensors whose alias_of is an input whose buffer the kernel
        writes into (opinfo.FORWARDED_OUTPUTS): shared only where that input is made in
        the same pass, not a checkpoint read from the forward pass.
      gradient_into: op id -> (input tensor id, output tensor id) where the op's gradient
        for that input is written into that output's buffer (opinfo.GRADIENT_INTO_OUTPUT:
        nothing but the gradient reads the output).
      small: ids of the region tensors of known size no larger than that: cheaper to
        keep from the forward pass than to recompute, a segment's gradients read them
        as the forward pass made them (segments.ForwardReads), e.g. a batch norm's
        saved mean and variance. (Not a tensor of unknown size, which may be a
        kernel's workspace of any size.)
    """

    def __init__(self):
        self.ops, self.kind, self.inputs, self.outputs = [], [], [], []
        self.tensors, self.size, self.producer, self.consumers, self.alias_of = [], [], [], [], []
        self.grad_reads, self.grad_inputs, self.grad_temporaries, self.cost = [], [], [], []
        self.is_x, self.is_y = [], []
        self.tensor_id, self.op_id = {}, {}
        self.unknown_dims = []
        self.unknown_dim_size = 1
        self.kernels = kernels.gpu  # (sizes no workspace; build sets the step's)
        self.conv_threads = 0
        self.inter_op_threads = 1
        self.rewrite_grad_temporaries = {}
        self._temporary_pieces = {}
        self.deferred, self.deferred_tensors, self.deferred_through = {}, set(), {}
        self.conv_workspaces = {}
        self.workspaces = set()
        self.custom_gradient_ops = set()
        self.held, self.call_runs = {}, {}
        self.folded, self.constants = {}, frozenset()
        self.pieces, self.grad_pieces = {}, {}
        self.largest_bytes, self.small_bytes = 0, 0
        self.small = frozenset()
        self.boundaries = []
        self.loops = {}
        self.loop_mode = "auto"
        self.forwarded, self.gradient_into = set(), {}
        self.xla_cpu = False
        self.costs = costs.active()

    @classmethod
    def build(cls, region, environment=None, unknown_dim_size=1, defer=True):
        """Compiles the forward pass of `region` (a memsave.region.ForwardRegion).

        Args:
          region: the ForwardRegion.
          environment: the memsave.environment.Environment the step runs in (which
            kernels, XLA); None reads this process's.
          unknown_dim_size: the size assumed for unknown dimensions (a batch fed
            through a placeholder of shape [None, ...]).
          defer: whether the rewrite may make weight gradients last (`deferred`;
            not with tf.gradients' gate_gradients=True, which groups a weight's
            gradient with its input's).
        """
        if environment is None:
            environment = Environment.read(region.ys[0].graph)
        step = cls()
        step.loop_mode = environment.recompute_loops
        step.kernels = kernels.profile(environment.kernels)
        step.conv_threads = environment.conv_threads
        step.inter_op_threads = environment.inter_op_threads
        step.xla_cpu = environment.kernels is not None  # (no GPU: XLA compiles for the CPU)
        ops = _forward_ops_in_order(region.ys)
        # A batch of None, counted as the batch where TensorFlow says what follows from it
        # (a flattened [batch * length, vocab] is not [batch, vocab]).
        unknown_dim_size = shapes.inferred(ops, unknown_dim_size)
        step.unknown_dim_size = unknown_dim_size
        kept = {op for op, _ in region.kept_ops}
        for op in ops:
            step._add_op(op, _kind_of(op, region, kept))
            if op in kept and graph_loops.is_loop(op):
                index = step.op_id[op]
                step.loops[index] = loop_memory(
                    op, unknown_dim_size, stopped=op in region.stopped_ops,
                    under_xla=environment.under_xla, chunk=environment.loop_chunk,
                    whole_run_ahead=environment.holds_a_limit, costs=step.costs)
                step.cost[index] = step.loops[index].forward_cost
        if not environment.under_xla:  # (XLA's kernels make workspaces of their own)
            step._size_workspaces()
        region_tensors = [t for op in step.region_op_ids() for t in step.outputs[op]]
        step.largest_bytes = max((step.size[t] for t in region_tensors), default=0)
        step.small_bytes = step.largest_bytes // SMALL_FRACTION  # (linking folds above it)
        step._link(region, environment.folds_constants)
        step.small = frozenset(t for t in region_tensors if step.size[t] <= step.small_bytes
                               and (step.tensors[t].shape.is_fully_defined()
                                    or t in step.workspaces))
        step.boundaries = step._boundaries()
        if defer:
            step._find_deferred()
        return step

    # -- construction ------------------------------------------------------------------
    def _add_op(self, op, kind):
        index = len(self.ops)
        self.op_id[op] = index
        self.ops.append(op)
        self.kind.append(kind)
        self.inputs.append([])
        outputs = []
        for t in op.outputs:
            tid = len(self.tensors)
            self.tensor_id[(op, t.value_index)] = tid
            self.tensors.append(t)
            self.size.append(tensor_bytes(t, self.unknown_dim_size))
            length = list_length(t) if t.dtype == tf.variant and self.size[tid] else 1
            if length > 1:
                self.pieces[tid] = length
            if t.shape.rank is not None and None in t.shape.as_list() and t.dtype.is_floating:
                self.unknown_dims.append(t.name)
            self.producer.append(index)
            self.consumers.append([])
            self.alias_of.append(-1)
            self.is_x.append(False)
            self.is_y.append(False)
            outputs.append(tid)
        self.outputs.append(outputs)
        self.grad_reads.append([])
        self.grad_inputs.append([])
        self.grad_temporaries.append(0)
        self.cost.append(self.costs.of(op, self.unknown_dim_size) if kind in (REGION, KEPT) else 0)

    def _size_workspaces(self):
        for tid, t in enumerate(self.tensors):
            if t.shape.rank is None:
                nbytes = self.kernels.workspace_bytes(t.op, t.value_index)
                if nbytes is not None:
                    self.size[tid] = nbytes
                    self.workspaces.add(tid)

    def _link(self, region, folds_constants=True):
        for x in region.xs:
            tid = self.tensor_id.get((x.op, x.value_index))
            if tid is not None:
                self.is_x[tid] = True
        for y in region.ys:
            self.is_y[self.tensor_id[(y.op, y.value_index)]] = True
        for index, op in enumerate(self.ops):
            for t in op.inputs:
                tid = self.tensor_id.get((t.op, t.value_index))
                if tid is None:
                    continue
                self.inputs[index].append(tid)
                self.consumers[tid].append(index)
            self._link_variable_read(index, op)
            if op.type in opinfo.ALIAS_OP_TYPES and self.inputs[index] and self.outputs[index]:
                self.alias_of[self.outputs[index][0]] = self.inputs[index][0]
            elif op.type == "IdentityN" and len(self.inputs[index]) == len(op.inputs):
                for source, tid in zip(self.inputs[index], self.outputs[index]):
                    self.alias_of[tid] = source
        buffer_links.link_gradients_into_outputs(self)
        stops = set()
        for index, op in enumerate(self.ops):
            if self.kind[index] in (REGION, KEPT):
                self._link_gradient(index, op, region, stops)
        self._drop_gradients_nothing_reaches()
        buffer_links.link_forwarded_outputs(self)  # (after the gradients: what they read is kept)
        if folds_constants:
            buffer_links.link_folded_products(self)
            constant_folding.fold(self)

    def _drop_gradients_nothing_reaches(self):
        """tf.gradients makes no gradient for an op none of whose outputs gets one (its
        readers send none back: a custom gradient's forward ops, what only a
        StopGradient reads): such an op's gradient reads nothing and makes nothing."""
        pending = [t for t, is_y in enumerate(self.is_y) if is_y]
        active = set()
        while pending:  # (a worklist: v1 while loops' back edges break any one order)
            op = self.producer[pending.pop()]
            if op not in active:
                active.add(op)
                pending.extend(t for t, _ in self.grad_inputs[op])
        for index in range(len(self.ops)):
            if index not in active:
                self.held.pop(index, None)
                self.call_runs.pop(index, None)
                self.grad_reads[index], self.grad_inputs[index] = [], []
                self.grad_temporaries[index] = 0
                self.rewrite_grad_temporaries.pop(index, None)

    def _set_temporary_pieces(self, index, pieces):
        if pieces > 1:  # (one tensor: nothing to record)
            self._temporary_pieces[index] = (self.grad_temporaries[index], pieces)

    def temporary_pieces(self, op, nbytes):
        """About how many tensors hold `nbytes` of op `op`'s gradient temporaries: their count
        where `nbytes` are the bytes they were counted for (a custom gradient's SiLU
        makes two input-sized tensors, not one buffer of twice the size: replayed as
        one, it took a chunk of its own, +15% to +25% over the measured 'memory' step of
        a SiLU MLP on an AMD EPYC); 1 where a kernel's workspace is added to them."""
        counted, pieces = self._temporary_pieces.get(op, (None, 1))
        return pieces if counted == nbytes else 1

    def _link_variable_read(self, index, op):
        """A variable's bytes belong to its handle, which lives for the whole step: the
        value its handle data describes, else (no shape there) what a ReadVariableOp of
        it reads. (Not what another reader makes: a call's output, a gather's rows.)"""
        for t in op.inputs:
            handle = self.tensor_id.get((t.op, t.value_index))
            if t.dtype != tf.resource or handle is None or self.size[handle]:
                continue
            value = _tf_private.resource_value(t)
            if value is not None and value[0].is_fully_defined():
                self.size[handle] = value[0].num_elements() * value[1].size
            elif op.type == "ReadVariableOp" and self.outputs[index]:
                self.size[handle] = self.size[self.outputs[index][0]]

    def _link_gradient(self, index, op, region, stops):
        """What the gradient of op `index` reads, where it sends gradients, and its
        temporaries. `stops` (updated; ops come in topological order) holds the ids of
        path tensors whose gradient goes nowhere: made by an op that sends none back
        (a StopGradient, a Shape), and not an x. tf.gradients still builds the gradient
        a reader sends such a tensor, but nothing reads it and TensorFlow never runs it:
        Keras' batch norm takes its variance around stop_gradient(mean), and the
        output-sized product a SquaredDifference's gradient would reduce to the mean's
        shape is never made."""
        ins, outs = self.inputs[index], self.outputs[index]
        custom = custom_gradients.has_custom_gradient(op)
        probe = custom_gradients.probe(
            op, [i for i, t in enumerate(op.inputs) if region.depends_on_xs(t)],
            self.unknown_dim_size) if custom else None
        if custom:
            self.custom_gradient_ops.add(index)
        if probe is not None:
            self.grad_reads[index] = sorted({
                self.tensor_id[(t.op, t.value_index)] for t in probe.reads
                if (t.op, t.value_index) in self.tensor_id and is_data(t)})
            passes = set(probe.differentiated)
        else:
            passes = set(range(len(ins))) if opinfo.passes_gradient(op) else set()
        differentiated = []
        for i, tid in enumerate(ins):
            t = self.tensors[tid]
            if i not in passes or not region.depends_on_xs(t) or tid in stops:
                continue
            # A resource input is a variable handle: its gradient is the variable's size.
            if t.dtype == tf.resource or t.dtype.is_floating or t.dtype.is_complex:
                self.grad_inputs[index].append((tid, self.size[tid]))
                differentiated.append(i)
            elif t.dtype == tf.variant:  # a TensorList's: its elements' gradients
                self.grad_inputs[index].append((tid, list_bytes(t, self.unknown_dim_size)))
                self.grad_pieces[tid] = list_length(t)
        if probe is None:
            reads_in, reads_out = (
                opinfo.gradient_reads(None, len(op.inputs), len(op.outputs)) if custom
                else opinfo.differentiated_reads(op.type, len(op.inputs), len(op.outputs),
                                                 differentiated))
            if len(ins) == len(op.inputs):
                reads_in = tuple(reads_in) + opinfo.element_reads(op)
                self.grad_reads[index] = [ins[i] for i in reads_in
                                          if is_data(self.tensors[ins[i]])]
            self.grad_reads[index] += [outs[i] for i in reads_out
                                       if gradient_reads_output(op, self.tensors[outs[i]])]
        if not self.grad_inputs[index]:
            stops.update(t for t in outs if not self.is_x[t])
        if probe is not None:
            self.grad_temporaries[index] = probe.temporaries
            self._set_temporary_pieces(index, probe.temporary_pieces)
        elif outs and len(ins) == len(op.inputs):
            temporaries, pieces = opinfo.gradient_temporaries(
                op.type, [self.size[t] for t in ins], self.size[outs[0]], differentiated)
            self.grad_temporaries[index] = temporaries
            self._set_temporary_pieces(index, pieces)
        held = call_gradients.held_bytes(op, self.unknown_dim_size) if differentiated else 0
        if held:
            self.held[index] = held
        run = (call_gradients.backward_run(op, differentiated, self.unknown_dim_size)
               if differentiated and len(ins) == len(op.inputs)
               and len(outs) == len(op.outputs) else None)
        if run is not None:
            self.call_runs[index] = run
            self.grad_temporaries[index] += run.temporaries
            self._set_temporary_pieces(index, run.temporary_pieces)
        if self.xla_cpu:
            self.grad_temporaries[index] += xla_buffers.gradient_temporary_bytes(op)
        if self.conv_threads:
            for_filter, for_input = self.kernels.conv_gradient_workspace(
                op, differentiated, self.conv_threads, self.unknown_dim_size)
            if for_filter or for_input:
                self.conv_workspaces[index] = (for_filter, for_input)
            # tf.gradients runs the two side by side; the rewrite one after the other.
            self.grad_temporaries[index] += for_filter + for_input
            self.rewrite_grad_temporaries[index] = (self.grad_temporaries[index]
                                                    - min(for_filter, for_input))

    def _find_deferred(self):
        """The weight gradients worth making last (memsave.planner.deferral)."""
        deferral.find_deferred(self)

    def _boundaries(self):
        found = set()
        for op, kind in enumerate(self.kind):
            if kind not in (REGION, KEPT):
                continue
            for tid in self.inputs[op]:
                dtype = self.tensors[tid].dtype
                if (self.kind[self.producer[tid]] == REGION
                        and (kind == KEPT or self.is_y[tid])
                        and (dtype.is_floating or dtype.is_complex or dtype == tf.variant)):
                    found.add(tid)
        return sorted(found)

    # -- queries -----------------------------------------------------------------------
    def gradient_passes_through(self, op, tid):
        """Whether op `op`'s gradient for its input `tid` is its incoming gradient itself,
        sharing its buffer: an identity's (a reshape's), an Add's of an input shaped as
        its output, a BiasAdd's of its value (a custom gradient makes its own)."""
        outs = self.outputs[op]
        if not outs or op in self.custom_gradient_ops:
            return False
        if self.alias_of[outs[0]] >= 0 and outs[0] not in self.forwarded:  # (a view)
            return True
        tf_op = self.ops[op]
        return self.size[tid] == self.size[outs[0]] and any(
            opinfo.passes_gradient_through(tf_op.type, i)
            for i, t in enumerate(tf_op.inputs)
            if self.tensor_id.get((t.op, t.value_index)) == tid)

    def gradient_into_output(self, op):
        """(input tensor id, output tensor id) where op `op`'s gradient for that input is
        written into that output's buffer (`gradient_into`), else None."""
        return self.gradient_into.get(op)

    def buffer_of(self, tid):
        """The tensor whose buffer `tid` shares (itself when it owns one)."""
        while self.alias_of[tid] >= 0:
            tid = self.alias_of[tid]
        return tid

    def id_of(self, t):
        return self.tensor_id[(t.op, t.value_index)]

    def recomputed_loops(self):
        """The op ids of the loops the rewrite differentiates through a recomputing copy
        (memsave.planner.loops.recomputed, under memsave.recompute_loops' mode)."""
        return [op for op, memory in sorted(self.loops.items())
                if recomputed(memory, self.loop_mode)]

    def region_op_ids(self):
        return [i for i, k in enumerate(self.kind) if k == REGION]

    def resident_bytes(self):
        """Bytes alive before the step starts: inputs, constants and variables."""
        return sum(self.size[t] for i, k in enumerate(self.kind) if k == RESIDENT
                   for t in self.outputs[i])


def is_data(t):
    """Whether `t` holds values (not a resource handle, variant or string)."""
    return t.dtype not in (tf.resource, tf.variant, tf.string)


def _kind_of(op, region, kept):
    if op in region:
        return REGION
    if op in kept:
        return KEPT
    return FORWARD if op.inputs else RESIDENT


def _forward_ops_in_order(ys):
    """Every op the ys depend on, producers first (back edges of v1 loops ignored)."""
    ops = get_backward_walk_ops([y.op for y in ys], inclusive=True, control_inputs=True)
    members = set(ops)
    pending, consumers = {}, {}
    for op in ops:
        candidates = list(op.control_inputs)
        if op.type not in BACK_EDGE_OP_TYPES:  # (a v1 loop's back edge)
            candidates = [t.op for t in op.inputs] + candidates
        producers = list(dict.fromkeys(p for p in candidates if p in members and p is not op))
        pending[op] = len(producers)
        for p in producers:
            consumers.setdefault(p, []).append(op)
    # Depth first, as an executor runs a chain: a consumer runs as soon as its
    # producers have. Lists only, so the order never depends on set iteration.
    ready = [op for op in ops if pending[op] == 0]
    result = []
    while ready:
        op = ready.pop()
        result.append(op)
        for c in reversed(consumers.get(op, [])):
            pending[c] -= 1
            if pending[c] == 0:
                ready.append(c)
    if len(result) != len(ops):
        # A cycle that is not a v1 loop back edge: fall back to discovery order.
        logger.debug("memsave: planner found a cycle; using discovery order")
        return list(reversed(ops))
    return result
