"""Where TensorFlow's kernels share buffers the graph does not show, found once per step.

Each function records in a StepGraph (`step`) one habit of the kernels, from the
tables of memsave.planner.opinfo: a gradient written into an output nothing else
reads (`gradient_into`), an output written into its input's buffer (`forwarded`),
and a product Grappler folds a constant onto and holds to the gradient (`folded`).
StepGraph.build calls them while it links the step; the memory model reads what they
record.
"""

from memsave.planner import opinfo
from memsave.planner.op_kinds import RESIDENT


def link_folded_products(step):
    """Where an op's gradient ends in a product with a forward tensor it also reads
    elsewhere, and its input is a constant scaling read by it alone
    (opinfo.PRODUCT_GRADIENTS), Grappler folds the constant onto that tensor: a
    product of the forward pass (or of the recomputed copy) held to the gradient
    (`folded`). Which operand of the product takes the constant follows the ops'
    names (Grappler orders the inputs of a commutative op by name): in a
    tf.function, measured, the step's own softmaxes and memsave's recomputed copies
    take it (the benchmarks' attention, Keras' included); a tf.compat.v1 Session
    orders them the other way for some names (not modelled)."""
    for index, op in enumerate(step.ops):
        output = opinfo.PRODUCT_GRADIENTS.get(op.type)
        if output is None or len(step.inputs[index]) != len(op.inputs):
            continue
        if any(_scaled_by_a_constant(step, tid, index) for tid, _ in step.grad_inputs[index]):
            step.folded[index] = step.size[step.outputs[index][output]]


def _scaled_by_a_constant(step, tid, reader):
    """Whether tensor `tid`, read by op `reader` alone, is made by a Mul or RealDiv by
    a constant (opinfo.CONSTANT_SCALINGS) of a tensor whose gradient is taken."""
    op = step.producer[tid]
    positions = opinfo.CONSTANT_SCALINGS.get(step.ops[op].type)
    if (positions is None or step.consumers[tid] != [reader] or step.is_y[tid]
            or len(step.inputs[op]) != 2 or not step.grad_inputs[op]):
        return False
    return any(step.ops[step.producer[step.inputs[op][i]]].type == "Const"
               for i in positions)


def link_forwarded_outputs(step):
    """An output the kernel writes into an input's buffer (opinfo.FORWARDED_OUTPUTS;
    an elementwise kernel's output 0 into the first input of its size and type,
    opinfo.ELEMENTWISE_KERNELS) shares it, where that input, and every tensor sharing
    its buffer (a reshape of the logits), is read by the next alone, by no gradient,
    and it is made in the step. (Whether a plan keeps that buffer for a later segment
    is the memory model's to check: forward_pass.unforwardable_outputs.)"""
    read_by_gradients = {t for reads in step.grad_reads for t in reads}
    for index, op in enumerate(step.ops):
        if len(step.inputs[index]) != len(op.inputs):
            continue
        for position, out_position in _forwarding_candidates(step, index, op):
            read, out = step.inputs[index][position], step.outputs[index][out_position]
            if _read_last_by(step, read, index, read_by_gradients):
                step.alias_of[out] = read
                step.forwarded.add(out)
                break


def _forwarding_candidates(step, index, op):
    """(input, output) positions the kernel of op `index` may write into, in the
    order it tries them."""
    forwarded = opinfo.FORWARDED_OUTPUTS.get(op.type)
    if forwarded is not None:
        return [forwarded]
    if op.type not in opinfo.ELEMENTWISE_KERNELS or not step.outputs[index]:
        return []
    out = step.outputs[index][0]
    if step.alias_of[out] >= 0 or not step.size[out]:
        return []
    dtype = step.tensors[out].dtype
    return [(position, 0) for position, tid in enumerate(step.inputs[index])
            if step.size[tid] == step.size[out] and step.tensors[tid].dtype == dtype]


def _read_last_by(step, tid, reader, read_by_gradients):
    """Whether op `reader` is the last to read tensor `tid`'s buffer, made in the
    step: `tid`, and each tensor it shares its buffer with, read by the next op
    alone and by no gradient, and not a result."""
    source = tid
    while (step.consumers[source] == [reader] and not step.is_y[source]
           and source not in read_by_gradients):
        if step.alias_of[source] < 0:  # (the buffer's owner: a reshape of it may be read)
            return step.kind[step.producer[source]] != RESIDENT
        reader, source = step.producer[source], step.alias_of[source]
    return False


def link_gradients_into_outputs(step):
    """`gradient_into`: gradients written into an output nothing else reads
    (opinfo.GRADIENT_INTO_OUTPUT), found once rather than at every simulated step."""
    for index, op in enumerate(step.ops):
        into = opinfo.GRADIENT_INTO_OUTPUT.get(op.type)
        if into is not None and len(step.inputs[index]) == len(op.inputs):
            out = step.outputs[index][into[1]]
            if not step.consumers[out]:
                step.gradient_into[index] = (step.inputs[index][into[0]], out)
