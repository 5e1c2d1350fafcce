"""What the planner asks of each op type: what its gradient reads, which buffers its
kernels share, what temporaries its gradient makes, and how much it costs to run again.

The facts themselves are in memsave.planner.op_facts, one record per op type; this
module answers questions about ops from them (and from an op's shapes and attributes).
An op type not listed there is assumed to read all its inputs and outputs, which can
only over-predict memory. What one platform's kernels allocate besides (workspaces)
is in memsave.planner.kernels.
"""

import functools
import math

from memsave.planner.op_facts import ALL, by_type, facts_of, types_where
from memsave.region import sized_dims


# The tables the other modules read, derived from the one record per op type.
SPARSE_GRADIENT_INPUTS = by_type("sparse_gradient_inputs")
ALIAS_OP_TYPES = types_where(lambda f: f.aliases_input)
PRODUCT_GRADIENTS = by_type("product_gradient_output")
CONSTANT_SCALINGS = by_type("constant_scaling_inputs")
FORWARDED_OUTPUTS = by_type("forwarded_output")
ELEMENTWISE_GRADIENTS = types_where(lambda f: f.elementwise_gradient)
ELEMENTWISE_KERNELS = types_where(lambda f: f.elementwise_kernel)
GRADIENT_INTO_OUTPUT = by_type("gradient_into_output")
MATMUL_LIKE = types_where(lambda f: f.flops_kind == "matmul")
CONV_LIKE = types_where(lambda f: f.flops_kind == "conv")
HEAVY_OP_TYPES = types_where(lambda f: f.heavy)
NORMALISATION_OP_TYPES = types_where(lambda f: f.normalisation)
EXPENSIVE_OP_TYPES = types_where(lambda f: f.expensive)
REDUCTION_OP_TYPES = types_where(lambda f: f.reduction)
NO_DATA_OP_TYPES = types_where(lambda f: f.moves_no_data)


def passes_gradient(op):
    """Whether tf.gradients sends a gradient through `op` to its inputs: not through an
    op registered without one, nor through one none of whose outputs can carry one
    (tf.gradients backpropagates through floating, complex, resource and variant
    tensors only: not through a Shape's integers or a comparison's booleans)."""
    return facts_of(op.type).differentiable and any(
        t.dtype.is_floating or t.dtype.is_complex or t.dtype.name in ("resource", "variant")
        for t in op.outputs)


@functools.lru_cache(maxsize=None)
def gradient_reads(op_type, num_inputs, num_outputs):
    """The forward tensors the gradient of an op of `op_type` reads.

    Returns:
      (input indices, output indices). Unknown op types, and `op_type` None (a gradient
      that is not its type's own), read everything.
    """
    inputs, outputs = facts_of(op_type).gradient_reads
    return _indices(inputs, num_inputs), _indices(outputs, num_outputs)


def _indices(indices, count):
    """`indices` (ALL or a tuple) among `count` positions."""
    if indices == ALL:
        return tuple(range(count))
    return tuple(i for i in indices if i < count)


def passes_gradient_through(op_type, index):
    """Whether the gradient of an op of `op_type` for its input `index` is the incoming
    gradient itself when that input has the output's size."""
    through = facts_of(op_type).passes_through_inputs
    return through == ALL or index in through


def element_reads(op):
    """The input indices a TensorList write's gradient reads besides `gradient_reads`'
    (its type's): the element, where its shape is not fully known (a Keras RNN's batch
    of None); none for other ops."""
    index = facts_of(op.type).element_input
    if index is None or index >= len(op.inputs) or op.inputs[index].shape.is_fully_defined():
        return ()
    return (index,)


def differentiated_reads(op_type, num_inputs, num_outputs, differentiated):
    """The forward tensors the gradient of an op of `op_type` reads when only the inputs
    `differentiated` get a gradient (the others' part is never run).

    Returns:
      (input indices, output indices), as gradient_reads.
    """
    per_input = facts_of(op_type).reads_per_input
    if per_input is None or num_inputs != 2:
        return gradient_reads(op_type, num_inputs, num_outputs)
    inputs, outputs = set(), set()
    for i in differentiated:
        reads_in, reads_out = per_input[i]
        inputs.update(reads_in)
        outputs.update(j for j in reads_out if j < num_outputs)
    return tuple(sorted(inputs)), tuple(sorted(outputs))


def gradient_temporaries(op_type, input_bytes, output_bytes, differentiated):
    """The short-lived tensors the gradient of an op makes besides its results.

    Args:
      op_type: the op's type.
      input_bytes: bytes of each input.
      output_bytes: bytes of output 0.
      differentiated: indices of the inputs that receive a gradient.
    Returns:
      (their bytes, how many tensors hold them: each is an allocation of its own).
    """
    facts = facts_of(op_type)
    factor = facts.broadcast_temporaries
    if factor:
        count = factor * sum(1 for i in differentiated if input_bytes[i] < output_bytes)
        return count * output_bytes, max(count, 1)
    if facts.tile_temporary and 0 in differentiated:
        return input_bytes[0], 1
    return 0, 1


# FusedBatchNormV3's third reserve space (output 5) is a kernel's workspace: the graph
# gives it no shape, the kernel chooses its size (memsave.planner.kernels: one profile
# per platform says how large).
_RESERVE_SPACE_3 = 5


def is_reserve_space_3(op, index):
    """Whether output `index` of `op` is a batch norm's third reserve space."""
    return op.type == "FusedBatchNormV3" and index == _RESERVE_SPACE_3


def elements(shape):
    """Elements of a shape (a list; unknown dimensions count as 1)."""
    return math.prod(1 if d is None else d for d in shape)


def output_elements(op, unknown_dim_size=1):
    """Elements of `op`'s outputs (unknown dimensions count as `unknown_dim_size`)."""
    dims = (sized_dims(t, unknown_dim_size) for t in op.outputs)
    return sum(elements(d) for d in dims if d is not None)


def priced_elements(op, unknown_dim_size=1):
    """The elements the cost model prices an op that is not heavy by: none for an op
    that moves no data (a Reshape), those a reduction reads (input 0, where its rank is
    known), else its output elements."""
    if op.type in NO_DATA_OP_TYPES:
        return 0
    if op.type in REDUCTION_OP_TYPES and op.inputs:
        dims = sized_dims(op.inputs[0], unknown_dim_size)
        if dims is not None:
            return elements(dims)
    return output_elements(op, unknown_dim_size)


def flops(op, unknown_dim_size=1):
    """Estimated cost of running `op` once, in floating-point operations.

    Matmuls and convolutions count 2 per multiply-add; other ops one per output
    element (memsave.planner.costs prices those by the machine). Unknown
    dimensions count as `unknown_dim_size` (the batch the step is planned for).
    """
    out_elements = output_elements(op, unknown_dim_size)
    if op.type in MATMUL_LIKE and op.inputs and op.inputs[0].shape.rank:
        a = sized_dims(op.inputs[0], unknown_dim_size)
        transpose_a = op_attr(op, "transpose_a") or op_attr(op, "adj_x")
        inner = a[-2] if transpose_a else a[-1]
        return 2 * out_elements * (inner or 1)
    if op.type in CONV_LIKE and len(op.inputs) > 1 and op.inputs[1].shape.rank:
        kernel = op.inputs[1].shape.as_list()
        if op.type == "DepthwiseConv2dNative":
            window = elements(kernel[:-2])
        elif op.type == "Conv2DBackpropInput":
            window = elements(kernel[:-2]) * (kernel[-1] or 1)
        else:
            window = elements(kernel[:-1])
        return 2 * out_elements * window
    if op.type == "Einsum":
        return _einsum_flops(op, out_elements, unknown_dim_size)
    return out_elements


def _einsum_flops(op, out_elements, unknown_dim_size):
    """2 x the product of every distinct index's size (a contraction's multiply-adds)."""
    equation = op_attr(op, "equation")
    if not equation or "->" not in equation or "." in equation:
        return out_elements
    operands = equation.split("->")[0].split(",")
    sizes = {}
    for letters, t in zip(operands, op.inputs):
        dims = sized_dims(t, unknown_dim_size)
        if dims is None or len(letters) != len(dims):
            return out_elements
        for letter, d in zip(letters, dims):
            sizes[letter] = max(sizes.get(letter, 1), d or 1)
    return 2 * math.prod(sizes.values())


def op_attr(op, name):
    """Attribute `name` of `op` (bytes decoded), or None where it has none."""
    try:
        value = op.get_attr(name)
    except ValueError:
        return None
    return value.decode() if isinstance(value, bytes) else value
