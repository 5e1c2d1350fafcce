"""Loops: a copy of a `tf.while_loop` whose gradient keeps only what each iteration reads.

TensorFlow differentiates a while_v2 loop (a `While` op whose body is a library
function) by rewriting the forward loop to push, every iteration, each body tensor the
body's gradient reads onto a list (an accumulator), and popping them in the gradient
loop. For a Keras LSTM that is every step's gates, their activations, c, tanh(c), the
input slice and the state: most of a recurrent network's training memory.

`recomputing_copy` builds a second loop op with the same inputs, whose body is the
original body with its *core* wrapped in a gradient that recomputes the core from the
tensors it reads. The core is every op of the body that may run again with the same
result: no stateful op (a variable read of a handle the loop passes on unchanged is
allowed, and nothing in the step may write that variable: see `calls`), no op making or
reading a TensorList or another resource, no constant (the gradient copies those
itself), no function call. The gradient of the copy then pushes only the core's inputs:
the carry of the loop and the slices it reads (a slice of a TensorList shares the list's
buffer), one per iteration, and the
backward loop runs the core once more per iteration before differentiating it.
Gradient functions inside the core are called once, with their whole gradient, as
tf.gradients calls them; nothing the core does not hold runs twice.

memsave differentiates the copy in place of the loop (the loop itself, which nothing
differentiates, then keeps nothing for the backward pass), and makes it wait for the
gradients of the loop's outputs, so it runs in the backward pass: one extra forward
pass of the loop, plus one of the core per iteration inside the gradient loop.
"""

import tensorflow as tf

from memsave.graph import _tf_private, calls
from memsave.graph.select import (
    TensorMap, TensorSet, get_backward_walk_ops, topological_sort)
from memsave.graph.transform import CopyResult, copy_into_graph

# The gradient function of the graph being rewritten, taken before memsave.patch can
# replace it.
_tf_gradients = tf.compat.v1.gradients

LOOP_OP_TYPES = frozenset(["While", "StatelessWhile"])

# The copy, and so its gradient loop, runs at most this many iterations at once. The
# executor otherwise runs a gradient loop's independent work up to parallel_iterations
# (Keras: 32) iterations ahead, each holding its weight-sized gradient product: 35 MiB of
# the 45 the LSTM benchmark's memsave step held (AMD EPYC, 2 cores), 37 MiB with 2.
PARALLEL_ITERATIONS = 2

# Below this many iterations the copy keeps every iteration's carry by default: chunks
# of about sqrt(T) keep 2 sqrt(T) (8 of 16) for one more run of the loop.
MIN_CHUNKED_ITERATIONS = 16


def is_loop(op):
    """Whether `op` is a while_v2 loop (its body a function of the library)."""
    return op.type in LOOP_OP_TYPES and "body" in op.node_def.attr


def why_loop_not_recomputed(op, body=None):
    """Why memsave keeps loop `op`'s gradient as TensorFlow builds it, or None. `body`:
    the loop's body graph where the caller read it already (`loop_body_to_read`).

    Returns:
      None, or a short reason: the loop runs a stateful op, may write a variable it
      reads, or a variable it reads is written elsewhere in the step; its body could
      not be read back from the library; its body has a `tf.custom_gradient`, whose
      gradient function holds the original body's tensors, or runs library functions of
      its own (a nested loop, a `tf.cond`, a call).
    """
    why = calls.why_call_not_repeatable(op)
    if why is not None:
        return why.replace("its function", "its body")
    if body is None:
        body = _tf_private.loop_body_to_read(op, _tf_private.loop_output_shapes(op))
    for inner in body.get_operations():
        if _tf_private.gradient_reads_a_closure(inner):
            return (f"its body has a custom gradient ({inner.name}), whose function reads "
                    "the loop's own tensors, not a copy's")
        if calls.names_functions(inner.node_def):
            # (A copy would run the same library functions: TensorFlow's gradients of the
            # loop and of its copy would both rewrite them, under the same names.)
            return (f"its body runs a nested loop, conditional or function call "
                    f"({inner.name}, {inner.type})")
    return None


class Core:
    """The ops of a loop body recomputed in the gradient loop.

    Attributes:
      ops: the ops, topologically sorted.
      inputs: tensors they read from outside them (the only ones the forward loop
        keeps for them), in the order first read.
      outputs: their tensors read outside them or returned by the body.
    """

    def __init__(self, ops, inputs, outputs):
        self.ops, self.inputs, self.outputs = ops, inputs, outputs


def body_core(body, within_ops=None):
    """The Core of loop body graph `body` (of its ops `within_ops`, default all), or
    None where it has no op worth recomputing.

    The core is closed: no path, of data or control edges, leaves it and comes back (an
    op outside it that reads the core, a TensorList write say, would read the core's
    gradient-wrapped outputs while feeding its inputs: a cycle). Where one does, the core
    ops downstream of that op leave the core.
    """
    invariants = passed_on_unchanged(body)
    ops = topological_sort(body.get_operations())
    if within_ops is not None:
        within = set(within_ops)
        ops = [op for op in ops if op in within]
    core = {op for op in ops if _recomputable_in_body(op, invariants)}
    while True:
        downstream = _reading(ops, core)  # ops outside the core that read it
        leaving = {op for op in core if any(p in downstream for p in _predecessors(op))}
        if not leaving:
            break
        core -= leaving
    ordered = [op for op in ops if op in core]
    if not any(_is_computation(op) for op in ordered):
        return None
    returned = TensorSet(body.outputs)
    inputs, seen, outputs = [], TensorSet(), []
    for op in ordered:
        for t in op.inputs:
            if t.op not in core and t not in seen:
                seen.add(t)
                inputs.append(t)
        for t in op.outputs:
            # (Readers outside `within_ops` count: the caller drops them, so the output is
            # only passed on, never read through the wrong door.)
            if t in returned or any(c not in core for c in t.consumers()):
                outputs.append(t)
    return Core(ordered, inputs, outputs)


def _predecessors(op):
    """The ops `op` waits for: its inputs' and its control inputs."""
    return [t.op for t in op.inputs] + list(op.control_inputs)


def _reading(ordered_ops, members):
    """The ops of `ordered_ops` (producers first) outside `members` that wait for one of
    them, directly or through others (data or control edges)."""
    found = set()
    for op in ordered_ops:
        if op not in members and any(p in members or p in found for p in _predecessors(op)):
            found.add(op)
    return found


def passed_on_unchanged(body):
    """The body's inputs that it returns as they came (loop invariants: a variable the
    loop reads, a tensor it captures): TensorFlow's gradient reads those once, not per
    iteration, and the gradient loop reads a passed-on handle again instead of keeping
    the values read from it."""
    result = TensorSet()
    for t_in, t_out in zip(body.inputs, body.outputs):
        while t_out.op.type == "Identity":
            t_out = t_out.op.inputs[0]
        if t_out is t_in:
            result.add(t_in)
    return result


def _recomputable_in_body(op, invariants):
    """Whether body op `op` may be recomputed in the gradient loop: stateless, or a read
    of a variable the loop passes on (`invariants`); making or reading no other handle
    or list."""
    if not op.inputs or op.type == "Placeholder":
        return False
    if any(t.dtype in (tf.variant, tf.resource) for t in op.outputs):
        return False
    if op.type == "ReadVariableOp":
        return op.inputs[0] in invariants  # (a handle the loop passes on)
    if op.op_def is None or op.op_def.is_stateful:
        return False
    # (Not a list read, TensorListGetItem: its element shares the list's buffer, so
    # keeping it costs nothing, and the list's gradient would go through the core.)
    if any(t.dtype in (tf.variant, tf.resource) for t in op.inputs):
        return False
    return not calls.names_functions(op.node_def)


def _is_computation(op):
    return op.type not in ("Identity", "ReadVariableOp")


def recomputing_copy(loop, name, needed_outputs, chunk=1):
    """A new loop op with `loop`'s inputs and cond, whose gradient recomputes each
    iteration's core (`body_core`) instead of keeping it.

    The copy computes the outputs `needed_outputs` and what they depend on (and what
    the loop's condition reads); every other loop variable it passes on unchanged: the
    accumulators tf.gradients added to a loop it differentiated before, for one, which
    would otherwise keep what the copy exists not to keep.

    With `chunk` > 1 the copy runs `chunk` iterations per iteration of its own (an inner
    loop, `_chunked_body`), and its gradient keeps the loop variables only where each
    chunk starts, and recomputes the chunk (keeping each of its iterations' core inputs)
    before differentiating it: about iterations / chunk + chunk carries kept instead of
    one per iteration, for one more run of the loop (Gruslys et al. 2016).

    Args:
      loop: a while_v2 loop op (`is_loop`) for which `why_loop_not_recomputed` is None.
      name: the new op's name (made unique by the graph).
      needed_outputs: indices of the outputs the caller differentiates.
      chunk: iterations per chunk (1: none).
    Returns:
      The new op (its outputs are `loop`'s, index for index, for those needed), or None
      where the body has no core (nothing to save).
    """
    shapes = _tf_private.loop_output_shapes(loop)
    source = _tf_private.loop_body_to_read(loop, shapes)
    cond = _tf_private.loop_function_graph(loop, "cond", shapes)
    needed = _needed_variables(cond, source, needed_outputs)
    needed_ops = get_backward_walk_ops([source.outputs[i].op for i in sorted(needed)],
                                       inclusive=True, control_inputs=True)
    core = body_core(source, within_ops=needed_ops)
    if core is None:
        return None
    parallel = min(PARALLEL_ITERATIONS, loop.get_attr("parallel_iterations"))
    if chunk > 1:
        _counting_chunks(cond, chunk)
        _tf_private.rename_function_graph(cond, f"{name}_cond")
        body = _chunked_body(loop, source, core, needed, needed_ops, chunk, parallel,
                             _tf_private.unique_function_name(f"{name}_body"))
        # (One chunk at a time: each holds its iterations' carries in its gradient.)
        return _tf_private.build_loop(loop, cond, body, name, parallel_iterations=1)
    _tf_private.rename_function_graph(cond, f"{name}_cond")
    body = _rebuilt_body(loop.graph, source, core, needed, needed_ops,
                         _tf_private.unique_function_name(f"{name}_body"))
    return _tf_private.build_loop(loop, cond, body, name, parallel_iterations=parallel)


def quiet_list_gradients(loop, differentiated):
    """Zero gradients for a loop's TensorList outputs that a gradient is not asked for.

    tf.gradients gives such an output zeros_like: a list of zeros as large as the list
    (for a loop that reads a layer's whole input sequence and passes it on, the
    sequence's size). An empty list (`_tf_private.empty_list_like`) is the same zero.

    Args:
      loop: a while_v2 loop op.
      differentiated: its outputs the caller asks the gradient for.
    Returns:
      (ys, grad_ys): the other list outputs whose element dtype the graph says, and an
      empty list for each, to add to the tf.gradients call.
    """
    taken = TensorSet(differentiated)
    ys, grad_ys = [], []
    for t in loop.outputs:
        dtype = _tf_private.list_element_dtype(loop.inputs[t.value_index]) if (
            t.value_index < len(loop.inputs)) else None
        if t not in taken and dtype is not None:
            ys.append(t)
            grad_ys.append(_tf_private.empty_list_like(t, dtype))
    return ys, grad_ys


def why_not_in_chunks(loop, body=None):
    """Why a recomputing copy of while_v2 loop `loop` may not run in chunks, or None.

    A chunked copy counts chunks with the loop's counter (its first variable) and each
    chunk's loop counts from 0 (`_chunked_body`). That keeps the loop's iterations only
    where the counter does nothing but count: the condition reads it only to compare it
    with the maximum (the second variable), the body only to add 1 to it, as
    tf.while_loop builds them; a loop imported from elsewhere may read it otherwise.

    Args:
      loop: a while_v2 loop op (`is_loop`).
      body: its body graph where the caller read it already (`loop_body_to_read`).
    Returns:
      None, or a short reason.
    """
    shapes = _tf_private.loop_output_shapes(loop)
    cond = _tf_private.loop_function_graph(loop, "cond", shapes)
    if body is None:
        body = _tf_private.loop_body_to_read(loop, shapes)
    counter, maximum = cond.inputs[0], cond.inputs[1]
    if any(c.type != "Less" or list(c.inputs) != [counter, maximum]
           for c in counter.consumers()):
        return "its condition reads the iteration counter otherwise than against the maximum"
    if any(c.type not in ("Add", "AddV2") or _constant_value(c.inputs[1]) != 1
           for c in body.inputs[0].consumers()):
        return "its body reads the iteration counter otherwise than to count"
    return None


def _constant_value(t):
    value = tf.get_static_value(t)
    return None if value is None or value.ndim else int(value)


def _counting_chunks(cond, chunk):
    """Makes loop condition graph `cond` read its counter, which counts chunks in the
    chunked copy, as the iterations run before it: `chunk` times it. Every chunk runs
    whole but the last, after which the condition stops the loop: the last stops at
    the maximum, or where the loop's own condition turns false (which this condition
    then reads false too)."""
    counter = cond.inputs[0]
    readers = [(op, i) for op in counter.consumers()
               for i, t in enumerate(op.inputs) if t is counter]
    with cond.as_default():
        iterations = counter * chunk
    for op, i in readers:
        _tf_private.update_input(op, i, iterations)


def _chunk_cond(loop, shapes):
    """The condition graph of a chunk's loop: `loop`'s condition, and the counter
    below the second loop variable, which a chunk's loop is given as the number of
    iterations it may run (`_chunked_body`)."""
    cond = _tf_private.loop_function_graph(loop, "cond", shapes)
    with cond.as_default():
        go_on = tf.logical_and(cond.outputs[0], cond.inputs[0] < cond.inputs[1])
    _tf_private.set_function_graph_io(cond, cond.inputs, [go_on])
    _tf_private.rename_function_graph(cond, f"{loop.name.split('/')[-1]}_chunk_cond")
    return cond


def _chunked_body(loop, source, core, needed, needed_ops, chunk, parallel, name):
    """The body of a chunked copy (`recomputing_copy`): an inner loop running up to
    `chunk` iterations of `source` (rebuilt as `_rebuilt_body` rebuilds it), its
    outputs passed through an IdentityN whose gradient runs the chunk again and
    differentiates that (`_with_chunk_gradient`). Loop invariants and variables not
    `needed` are passed on unchanged; the counter counts chunks.

    TensorFlow's gradient of a while_v2 loop runs as many iterations as the loop's
    counter output says, so each loop, the chunk's and the copy's, counts its own
    iterations from 0; the condition of the copy reads its counter times `chunk`
    (`_counting_chunks`)."""
    shapes = _tf_private.loop_output_shapes(loop)
    invariant = passed_on_unchanged(source)
    body = _tf_private.new_loop_body_graph(loop.graph, name)
    with body.as_default():
        inputs = [_tf_private.placeholder_like(t) for t in source.inputs]

        def run_chunk(values):
            chunks_run, maximum = values[0], values[1]
            # (A loop without a maximum_iterations has -1 there.)
            left = tf.where(maximum >= 0, tf.minimum(chunk, maximum - chunks_run * chunk),
                            chunk)
            inner_body = _rebuilt_body(
                tf.compat.v1.get_default_graph(), source, core, needed, needed_ops,
                _tf_private.unique_function_name(f"{name}_chunk_body"))
            outputs = _tf_private.build_loop_from(
                loop, [tf.zeros_like(chunks_run), left] + list(values[2:]),
                _chunk_cond(loop, shapes), inner_body, "chunk", parallel)
            return [chunks_run + 1] + outputs[1:]

        passed = [i for i, t in enumerate(source.inputs)
                  if i != 1 and i in needed and t not in invariant]
        outputs = _with_chunk_gradient(inputs, run_chunk, passed,
                                       [_tf_private.list_element_dtype(t) for t in loop.inputs])
        _tf_private.set_function_graph_io(
            body, inputs, [outputs[i] if i in passed else t for i, t in enumerate(inputs)])
    return body


def differentiable(t):
    """Whether tf.gradients sends a gradient to tensor `t`: floating, complex, a
    variable handle or a TensorList."""
    return t.dtype.is_floating or t.dtype.is_complex or t.dtype in (tf.variant, tf.resource)


def _with_chunk_gradient(inputs, run_chunk, passed, element_dtypes):
    """The outputs of `run_chunk(inputs)` (a chunk's loop), passed through an IdentityN
    (with `inputs`, so the gradient reaches them) whose gradient runs the chunk again
    from its inputs, as kept by the copy's gradient, and differentiates that run with
    the gradients of the outputs at indices `passed` (what the copy's body returns);
    every other TensorList output gets an empty list (`element_dtypes`: of each loop
    variable that is a list) rather than tf.gradients' list of zeros."""
    outputs = run_chunk(inputs)
    count = len(outputs)

    def chunk_gradient(op, *output_gradients):
        del op
        local_inputs = [tf.identity(t) for t in inputs]
        again = run_chunk(local_inputs)
        ys, grad_ys = [], []
        for i, (t, dy) in enumerate(zip(again, output_gradients[:count])):
            if i in passed and dy is not None and differentiable(t):
                ys.append(t)
                grad_ys.append(dy)
            elif element_dtypes[i] is not None:
                ys.append(t)
                grad_ys.append(_tf_private.empty_list_like(t, element_dtypes[i]))
        xs = [t for t in local_inputs if differentiable(t)]
        found = iter(_tf_gradients(ys, xs, grad_ys=grad_ys) if ys else [None] * len(xs))
        return [None] * count + [next(found) if differentiable(t) else None
                                 for t in local_inputs]

    return _passed_with_gradient(outputs, inputs, chunk_gradient, "memsave_chunk_gradient",
                                 "chunk_recomputed_in_gradient")


def _needed_variables(cond, body, needed_outputs):
    """The loop variables the outputs `needed_outputs` depend on: those, the ones the
    condition reads, and the ones the body reads to compute those, until none is added;
    and the first two, the iteration counter and the maximum (TensorFlow's gradient runs
    as many iterations as the counter says)."""
    needed = ({0, 1} | set(needed_outputs)
              | {i for i, t in enumerate(cond.inputs) if t.consumers()})
    while True:
        ops = set(get_backward_walk_ops([body.outputs[i].op for i in needed], inclusive=True,
                                        control_inputs=True))
        reads = {i for i, t in enumerate(body.inputs) if t.op in ops}
        if reads <= needed:
            return needed
        needed |= reads


def _rebuilt_body(graph, source, core, needed, needed_ops, name):
    """A loop body graph computing what `source` computes for the loop variables
    `needed` (the ops `needed_ops`), its core's outputs passed through an IdentityN
    whose gradient recomputes the core (`_with_recompute_gradient`); it passes every
    other variable on unchanged."""
    body = _tf_private.new_loop_body_graph(graph, name)
    members = set(core.ops)
    ordered = [op for op in topological_sort(source.get_operations()) if op in needed_ops]
    reads_core = _reading(ordered, members)
    rest = [op for op in ordered if op not in members and op.type != "Placeholder"]
    with body.as_default():
        mapping = TensorMap((t, _tf_private.placeholder_like(t)) for t in source.inputs)
        copied = CopyResult()

        def copy(ops):
            copy_into_graph(ops, body, mapping, copy_control_inputs=True, result=copied)

        copy([op for op in rest if op not in reads_core])
        copy(core.ops)
        new_core = Core([copied.transformed(op) for op in core.ops],
                        [mapping[t] for t in core.inputs], [mapping[t] for t in core.outputs])
        for t, passed in zip(core.outputs, _with_recompute_gradient(new_core)):
            mapping[t] = passed  # (what reads the core outside it reads it passed)
        copy([op for op in rest if op in reads_core])
        inputs = [mapping[t] for t in source.inputs]
        _tf_private.set_function_graph_io(body, inputs, [
            mapping[t] if i in needed else inputs[i] for i, t in enumerate(source.outputs)])
    return body


def _with_recompute_gradient(core):
    """The core's outputs, passed through an IdentityN (with the core's inputs, so the
    gradient reaches them) whose gradient recomputes the core and differentiates the
    copies; the core's own ops get no gradient, so the loop keeps none of their outputs.
    """
    count = len(core.outputs)

    def recompute_gradient(op, *output_gradients):
        del op
        # Read in the gradient loop, each input is captured from the forward loop: pushed
        # there every iteration and popped here (a loop invariant is read as it is).
        local_inputs = [tf.identity(t) for t in core.inputs]
        copy = copy_into_graph(core.ops, tf.compat.v1.get_default_graph(),
                               TensorMap(zip(core.inputs, local_inputs)),
                               name_scope="recompute")
        ys, grad_ys = [], []
        for t, dy in zip(core.outputs, output_gradients[:count]):
            if dy is not None and (t.dtype.is_floating or t.dtype.is_complex):
                ys.append(copy.transformed(t))
                grad_ys.append(dy)
        if not ys:
            return [None] * (count + len(core.inputs))
        input_gradients = _tf_gradients(ys, local_inputs, grad_ys=grad_ys)
        return [None] * count + list(input_gradients)

    return _passed_with_gradient(core.outputs, core.inputs, recompute_gradient,
                                 "memsave_recompute_gradient", "recomputed_in_gradient")


def _passed_with_gradient(outputs, inputs, gradient, prefix, name):
    """`outputs` passed through an IdentityN that also takes `inputs` (so the gradient
    reaches them), its gradient `gradient` (registered under a new name starting with
    `prefix`) in place of the identity's: what reads the result differentiates into
    `gradient`, never into the ops that made `outputs`."""
    gradient_name = _tf_private.unique_function_name(prefix)
    tf.RegisterGradient(gradient_name)(gradient)
    with tf.compat.v1.get_default_graph().gradient_override_map({"IdentityN": gradient_name}):
        passed = tf.raw_ops.IdentityN(input=list(outputs) + list(inputs), name=name)
    return passed[:len(outputs)]
