"""What a while_v2 loop keeps for its gradient: the memory model's view of a loop.

TensorFlow differentiates a loop by keeping, from every iteration, each body tensor the
body's gradient reads (memsave.graph.loops): a 100-step LSTM keeps 100 copies of its
gates. The model counts them with the op knowledge it has for the step itself
(`opinfo`): what each body op's gradient reads, per iteration, times the number of
iterations, held from the loop's forward run to its gradient. memsave's recomputing copy
of the loop keeps instead the core's inputs per iteration, from the copy's run in the
backward pass to the end of its gradient, plus the copy's outputs and one iteration's
recomputed core.
"""

import dataclasses
import math
from typing import Optional

import tensorflow as tf

from memsave.graph import _tf_private
from memsave.graph import loops as graph_loops
from memsave.graph.select import TensorSet, get_backward_walk_ops, get_forward_walk_ops
from memsave.planner import costs as costs_lib
from memsave.planner import opinfo
from memsave.region import estimated_bytes


@dataclasses.dataclass(frozen=True)
class LoopMemory:  # (see `recomputed` for the decision)
    """A loop's memory for its gradient.

    Attributes:
      iterations: how many times the body runs at most (its maximum_iterations, or the
        length of the sequence it reads: `known`), or 1 where the graph does not say.
      known: whether `iterations` was read from the graph.
      kept_by_tensorflow: bytes TensorFlow's gradient keeps from the forward loop.
      kept_by_copy: bytes memsave's recomputing copy holds while its gradient runs, or
        None where the loop is not recomputed (`why_kept`).
      chunk: iterations per chunk of the copy (`chunk_for`; 1: it keeps every
        iteration's carry).
      why_kept: why memsave differentiates the loop as TensorFlow does, or None.
      gradient_run_ahead: bytes the gradient loop may hold besides: the executor runs
        it up to parallel_iterations iterations ahead (half of that is counted) of where
        it sums the gradients of what the body reads from outside the loop (a weight's:
        one weight-sized product per iteration), less what it has freed of the loop's
        keep by then (it pops one iteration's per iteration). copy_run_ahead: the same
        for the copy's gradient (at most memsave.graph.loops.PARALLEL_ITERATIONS
        iterations at once). Both count the running sums of those gradients too.
      gradient_run_ahead_span: (least, most) of gradient_run_ahead: none of the
        parallel iterations run ahead, or all of them (`run_ahead`); None: as counted
        (under XLA, whose compiled loop runs one iteration after another).
      carried, carries: the bytes of one iteration's inputs the copy keeps (its carry),
        and how many of them it holds at once (`carries_kept`; in `kept_by_copy`).
      body_cost, core_cost: what one iteration of the body, and of the core the copy's
        gradient runs again, costs (memsave.planner.costs units, each op's overhead
        included; `iteration_cost`). sums_cost: what one iteration of its gradient
        loop adds to the running sums of the gradients of what the body reads from
        outside (a weight-sized add per weight), TensorFlow's or the copy's.
    """
    iterations: int
    known: bool
    kept_by_tensorflow: int
    kept_by_copy: Optional[int]
    why_kept: Optional[str]
    gradient_run_ahead: int = 0
    copy_run_ahead: int = 0
    chunk: int = 1
    carried: int = 0
    carries: int = 0
    gradient_run_ahead_span: Optional[tuple] = None
    body_cost: int = 0
    core_cost: int = 0
    sums_cost: int = 0

    @property
    def forward_cost(self):
        """What the loop's run in the forward pass costs: every iteration's body."""
        return self.iterations * self.body_cost

    @property
    def recompute_cost(self):
        """What differentiating the loop through its recomputing copy adds to the step
        (0 where it is not recomputed: `why_kept`): the copy runs the loop again, a
        chunked copy's gradient runs each chunk once more before differentiating it,
        and the gradient loop runs the core again every iteration (memsave.graph.loops)."""
        if self.kept_by_copy is None:
            return 0
        runs = 2 if self.chunk > 1 else 1
        return self.iterations * (runs * self.body_cost + self.core_cost)

    def run_ahead(self, end=None):
        """gradient_run_ahead as counted (`end` None), or its least (0) or most (1): how
        far ahead TensorFlow's executor runs a gradient loop varies from process to
        process, so one step may peak at either end (RUN_AHEAD_ENDS)."""
        span = self.gradient_run_ahead_span
        return self.gradient_run_ahead if end is None or span is None else span[end]

    @property
    def run_ahead_varies(self):
        """Whether how far TensorFlow runs this loop's gradient ahead moves its memory."""
        return self.run_ahead(0) != self.run_ahead(1)


# The ends of the range over which a gradient loop's run-ahead moves a step's peak
# (LoopMemory.run_ahead, MemoryModel's run_ahead_end).
RUN_AHEAD_ENDS = (0, 1)


# A chunked copy's gradient sums the gradients of what the body reads from outside the
# loop (a weight's) in two loops: the chunk's gradient loop returns its sum, which the
# copy's gradient loop adds to its own: two more weight-sized buffers than without
# chunks (on the LSTM benchmark, AMD EPYC: 5 of each LSTM kernel's gradients alive at the
# peak, against 3).
_CHUNK_SUMS = 2


def chunk_for(iterations, known, requested="auto", carries=0, lists=0):
    """Iterations per chunk of a recomputing copy of a loop running `iterations` times
    (`known`: as the graph says) under memsave.recompute_loops' `requested` chunk.

    'auto': the square root of the count, rounded, where the count is known and at
    least memsave.graph.loops.MIN_CHUNKED_ITERATIONS, and the carries the copy would keep
    without chunks (`carries` bytes) are more than twice the TensorLists the loop reads
    and writes (`lists` bytes); else 1. Where they are not, those lists, and their
    gradients, as large, bound what the copy's gradient holds, and chunks would cost a
    run of the loop for little (2 stacked Keras LSTMs, 100 steps, AMD EPYC: 30.0 MiB
    against 31.8, at 1.56x the step time of tf.gradients against 1.44x; one LSTM over
    400 steps, which outputs its last step only: 20.6 MiB against 63.2).
    An int: at most the count.

    Args:
      iterations: the loop's iteration count (1 where unknown).
      known: whether the graph says it.
      requested: 'auto' or an int (memsave.recompute_loops' chunk).
      carries: bytes of the carries a copy without chunks keeps.
      lists: bytes of the TensorLists the loop reads and writes.
    Returns:
      Iterations per chunk (1: no chunks).
    """
    if requested == "auto":
        if (not known or iterations < graph_loops.MIN_CHUNKED_ITERATIONS
                or carries <= 2 * lists):
            return 1
        return max(1, round(math.sqrt(iterations)))
    return max(1, min(int(requested), iterations)) if known else int(requested)


def carries_kept(iterations, chunk):
    """How many carries a copy's gradient holds at once, for `iterations` iterations in
    chunks of `chunk`: one per iteration without chunks (chunk 1), else one per chunk
    start and one per iteration of the chunk being differentiated."""
    if chunk <= 1:
        return iterations
    return -(-iterations // chunk) + min(chunk, iterations)


def loop_memory(loop, unknown_dim_size=1, stopped=False, under_xla=False, chunk="auto",
                whole_run_ahead=False, costs=None):
    """The LoopMemory of while_v2 loop op `loop` (`memsave.graph.loops.is_loop`);
    `stopped`: one of its outputs is in the call's stop_gradients (its copy's would not
    be: the loop is differentiated as it is); `under_xla`: the step is compiled by XLA,
    which drops the control inputs that hold a copy back to the backward pass (it would
    run beside the loop, keeping what it exists not to keep); `chunk`: the
    memsave.recompute_loops chunk (`chunk_for`); `whole_run_ahead`: count TensorFlow's
    gradient loop running its whole parallel_iterations ahead, not half (a step that
    must fit a limit: Environment.holds_a_limit); `costs`: the memsave.planner.costs.Costs
    its iterations are priced by (None: the active one)."""
    costs = costs_lib.active() if costs is None else costs
    iterations = _iterations(loop)
    body = _tf_private.loop_body_to_read(loop, _tf_private.loop_output_shapes(loop))
    invariant = graph_loops.passed_on_unchanged(body)
    per_iteration = sum(estimated_bytes(t, unknown_dim_size)
                        for t in _kept_by_tensorflow(body, invariant))
    count = iterations or 1
    why = ("one of its outputs is in stop_gradients" if stopped
           else "under XLA, which would run its copy in the forward pass" if under_xla
           else graph_loops.why_loop_not_recomputed(loop, body))
    core = graph_loops.body_core(body) if why is None else None
    if why is None and core is None:
        why = "its body has nothing to recompute"
    kept_by_copy, carried, carries, requested = None, 0, 0, chunk
    chunk = 1
    if core is not None:
        shared = _held_by_lists(body, invariant)
        carried = sum(estimated_bytes(t, unknown_dim_size) for t in core.inputs
                      if t not in invariant and t not in shared and _is_data(t)
                      and not _is_constant(t))
        lists = sum(list_bytes(t, unknown_dim_size) for t in loop.inputs
                    if t.dtype == tf.variant)
        if graph_loops.why_not_in_chunks(loop, body) is None:
            chunk = chunk_for(count, iterations is not None, requested, count * carried, lists)
        # (An output the body passes on unchanged is its input: no memory of its own.)
        outputs = sum(_output_bytes(loop, i, unknown_dim_size)
                      for i, t in enumerate(body.inputs[:len(loop.outputs)])
                      if t not in invariant)
        carries = carries_kept(count, chunk)
        kept_by_copy = carries * carried + outputs + per_iteration
    read_from_outside = _read_from_outside(body, invariant)
    products = sum(estimated_bytes(t, unknown_dim_size) for t in read_from_outside)
    parallel = min(loop.get_attr("parallel_iterations"), count)
    copy_parallel = min(parallel, graph_loops.PARALLEL_ITERATIONS)
    # (How far ahead the executor runs varies from step to step: on the LSTM benchmark
    # (AMD EPYC, 2 cores) tf.gradients' peak was 110-151 MiB over five runs, the whole
    # parallel_iterations ahead in the highest; on an AMD EPYC with AVX-512 (oneDNN on),
    # 111-113 or 135-146 MiB. Half of it is predicted: 125.6 MiB. Under a limit the
    # whole is: on the Intel Xeon with AVX-512, plain Keras' stack at batch 45 held 87-90
    # MiB in three runs of six and 131-136 in the others, each LSTM kernel's gradient
    # 32 times over, and max_batch_size's answer from half ran out of memory.)
    def held_ahead(iterations_ahead):
        return products + max(0, iterations_ahead * (products - per_iteration))

    counted = parallel if whole_run_ahead else max(1, parallel // 2)
    return LoopMemory(iterations=count, known=iterations is not None,
                      kept_by_tensorflow=count * per_iteration, kept_by_copy=kept_by_copy,
                      why_kept=why,
                      gradient_run_ahead=held_ahead(counted),
                      gradient_run_ahead_span=None if under_xla else (held_ahead(0),
                                                                      held_ahead(parallel)),
                      copy_run_ahead=(products + max(0, copy_parallel * (products - carried))
                                      + (_CHUNK_SUMS * products if chunk > 1 else 0)),
                      chunk=chunk, carried=carried, carries=carries,
                      body_cost=iteration_cost(body.get_operations(), costs, unknown_dim_size),
                      core_cost=(iteration_cost(core.ops, costs, unknown_dim_size)
                                 if core is not None else 0),
                      sums_cost=_sums_cost(read_from_outside, costs, unknown_dim_size))


def iteration_cost(ops, costs, unknown_dim_size=1, depth=0):
    """What running loop body ops `ops` once costs (memsave.planner.costs units): each
    op's price and overhead, a loop nested in them its body's times its iterations (1
    where the graph does not say). A body's arguments are not ops that run."""
    total = 0
    for op in ops:
        if op.type == "Placeholder":
            continue
        total += costs.op_overhead
        if graph_loops.is_loop(op) and depth < _NESTED_LOOPS_PRICED:
            inner = _tf_private.loop_body_to_read(op, _tf_private.loop_output_shapes(op))
            total += (_iterations(op) or 1) * iteration_cost(
                inner.get_operations(), costs, unknown_dim_size, depth + 1)
        else:
            total += costs.of(op, unknown_dim_size)
    return int(total)


def _sums_cost(read_from_outside, costs, unknown_dim_size):
    """What a gradient loop's iteration costs to add the gradient of each tensor of
    `read_from_outside` to its running sum: an elementwise add of its size."""
    return int(sum(costs.op_overhead + costs.per_element
                   * opinfo.elements(opinfo.sized_dims(t, unknown_dim_size) or [])
                   for t in read_from_outside))


# Loops nested deeper than this in a body are priced as ops that run once.
_NESTED_LOOPS_PRICED = 4


def _iterations(loop):
    """The loop's iteration count where the graph says: its maximum_iterations input (a
    while_v2 loop's second), else the length of a TensorList it is given to read."""
    value = tf.get_static_value(loop.inputs[1]) if len(loop.inputs) > 1 else None
    if value is not None and value.ndim == 0 and int(value) > 0:
        return int(value)
    for t in loop.inputs:
        if t.op.type == "TensorListFromTensor":
            first = t.op.inputs[0].shape
            if first.rank and first[0] is not None:
                return int(first[0])
    return None


def _held_by_lists(body, invariant):
    """The body's tensors whose buffers a TensorList holds anyway, which the copy's
    gradient keeps at no cost: an element read from a list (TensorListGetItem shares the
    element), and a loop variable whose next value the body writes into a list at an
    index that changes (an RNN's output sequence holds each step's h; written at a
    constant index, as Keras writes the last output only, each write frees the last)."""
    shared = TensorSet(t for op in body.get_operations() if op.type == "TensorListGetItem"
                       for t in op.outputs)
    for t_in, t_out in zip(body.inputs, body.outputs):
        while t_out.op.type == "Identity":
            t_out = t_out.op.inputs[0]
        if any(_keeps_each_write(c, t_out, invariant) for c in t_out.consumers()):
            shared.add(t_in)
    return shared


def _keeps_each_write(op, item, invariant):
    """Whether `op` writes `item` into a TensorList that keeps it past the next write:
    a push (inputs: list, item), or a set (inputs: list, index, item) at an index that
    changes: neither a constant nor a loop invariant."""
    if op.type == "TensorListPushBack":
        return op.inputs[1] is item
    index = op.inputs[1] if op.type == "TensorListSetItem" else None
    return (index is not None and op.inputs[2] is item and not _is_constant(index)
            and index not in invariant)


def _output_bytes(loop, index, unknown_dim_size):
    return tensor_bytes(loop.outputs[index], unknown_dim_size)


def list_bytes(t, unknown_dim_size=1):
    """Bytes of the elements of TensorList `t` where the graph says: a list made from a
    tensor (TensorListFromTensor, a copy of it), a list of known length and element shape
    (TensorListReserve: what an RNN writes its outputs to), or a loop's output of one
    of those. 0 where it does not."""
    op = _list_maker(t)
    if op.type == "TensorListFromTensor":
        return estimated_bytes(op.inputs[0], unknown_dim_size)
    if op.type == "TensorListReserve":
        count, shape = tf.get_static_value(op.inputs[1]), tf.get_static_value(op.inputs[0])
        if count is None or shape is None or shape.ndim != 1 or (shape < 0).any():
            return 0
        return int(count) * int(shape.prod()) * tf.as_dtype(op.get_attr("element_dtype")).size
    return 0


def gradient_reads_output(op, t):
    """Whether the gradient of op `op` reads its output `t`, as far as loops go: a
    while_v2 loop's reads none of the lists it wrote (an RNN's outputs; what it keeps of
    its iterations is LoopMemory's)."""
    return not (graph_loops.is_loop(op) and t.dtype == tf.variant)


def _list_maker(t):
    """The op that made TensorList `t`: through the loops it is an output of and the
    identities that pass it on (a v1 while_loop's outputs), the one that made the loop's
    input."""
    op = t.op
    while ((graph_loops.is_loop(op) and t.value_index < len(op.inputs))
           or op.type == "Identity"):
        t = op.inputs[t.value_index]
        op = t.op
    return op


def tensor_bytes(t, unknown_dim_size=1):
    """The bytes of tensor `t`'s buffers: a TensorList's, its elements' (none for a
    reserved list, whose elements are made as they are written)."""
    if t.dtype != tf.variant:
        return estimated_bytes(t, unknown_dim_size)
    return 0 if t.op.type == "TensorListReserve" else list_bytes(t, unknown_dim_size)


def list_length(t):
    """How many elements TensorList `t` holds where the graph says (as `list_bytes`
    reads it), else 1: each is a buffer of its own."""
    op = _list_maker(t)
    if op.type == "TensorListFromTensor":
        first = op.inputs[0].shape
        return int(first[0]) if first.rank and first[0] is not None else 1
    if op.type == "TensorListReserve":
        count = tf.get_static_value(op.inputs[1])
        return int(count) if count is not None and count.ndim == 0 and count > 0 else 1
    return 1


def _read_from_outside(body, invariant):
    """The floating values the body reads from outside the loop (a variable's value, a
    loop invariant): each iteration of the gradient loop makes a gradient of each."""
    result = []
    for op in body.get_operations():
        if op.type == "ReadVariableOp" and op.inputs[0] in invariant:
            result.extend(t for t in op.outputs if t.dtype.is_floating)
    result.extend(t for t in body.inputs if t in invariant and t.dtype.is_floating
                  and any(c.type != "Identity" for c in t.consumers()))
    return result


def _kept_by_tensorflow(body, invariant):
    """The body tensors TensorFlow's gradient keeps from each iteration: those the
    gradients of the ops between the body's differentiable inputs and outputs read,
    but constants, loop invariants and variable reads (which share the variable's
    buffer)."""
    sources = [t for t in body.inputs if graph_loops.differentiable(t)]
    source_set = TensorSet(sources)
    ends = [t.op for t in body.outputs if graph_loops.differentiable(t)]
    backward = get_backward_walk_ops(ends, inclusive=True)
    path = set(get_forward_walk_ops(sources, inclusive=True, within_ops=backward))
    kept, seen = [], TensorSet()
    for op in body.get_operations():
        if op not in path or op.type == "Placeholder" or not opinfo.passes_gradient(op):
            continue
        differentiated = [i for i, t in enumerate(op.inputs)
                          if t.op in path or t in source_set]
        if _tf_private.overridden_gradient_type(op) is not None:
            reads_in, reads_out = opinfo.gradient_reads(None, len(op.inputs), len(op.outputs))
        else:
            reads_in, reads_out = opinfo.differentiated_reads(
                op.type, len(op.inputs), len(op.outputs), differentiated)
            reads_in = tuple(reads_in) + opinfo.element_reads(op)
        for t in [op.inputs[i] for i in reads_in] + [op.outputs[j] for j in reads_out]:
            while t.op.type == "Identity":
                t = t.op.inputs[0]
            if (t in seen or t in invariant or _is_constant(t)
                    or t.op.type == "ReadVariableOp" or not _is_data(t)):
                continue
            seen.add(t)
            kept.append(t)
    return kept


def _is_constant(t):
    """A body tensor of an op without inputs but a placeholder: TensorFlow's gradient
    makes such a constant again rather than keep it."""
    return not t.op.inputs and t.op.type != "Placeholder"


def _is_data(t):
    return t.dtype not in (tf.resource, tf.variant, tf.string)


def recomputed(memory, mode):
    """Whether the rewrite differentiates a loop of LoopMemory `memory` through its
    recomputing copy under memsave.recompute_loops mode `mode` ('auto': where the copy
    holds less than TensorFlow's gradient keeps of the loop)."""
    if memory.kept_by_copy is None or mode == "never":
        return False
    return mode == "always" or (memory.kept_by_copy + memory.copy_run_ahead
                                < memory.kept_by_tensorflow + memory.gradient_run_ahead)


def why_not_recomputed(memory, mode, fallback=False):
    """The report's reason a loop is differentiated as TensorFlow does (None: it is not);
    `fallback`: plain tf.gradients answers the call."""
    if fallback:
        return "plain tf.gradients answers the call"
    if memory.why_kept is not None:
        return memory.why_kept
    if mode == "never":
        return "memsave.recompute_loops('never')"
    if not recomputed(memory, mode):
        return ("its copy would hold more than TensorFlow's gradient keeps of it "
                "(memsave.recompute_loops('always') recomputes it anyway)")
    return None
