"""What the planner asks of each op type: what its gradient reads, which buffers its
kernels share, what temporaries and workspaces its gradient makes, and how much it
costs to run again.

The facts themselves are in memsave.planner.op_facts, one record per op type; this
module answers questions about ops from them (and from an op's shapes and attributes).
An op type not listed there is assumed to read all its inputs and outputs, which can
only over-predict memory.
"""

import functools
import math

from memsave.environment import EIGEN, ONEDNN  # noqa: F401 (named once, there)
from memsave.graph import _tf_private
from memsave.planner.op_facts import ALL, by_type, facts_of, types_where
from memsave.region import sized_dims


# The tables the other modules read, derived from the one record per op type.
SPARSE_GRADIENT_INPUTS = by_type("sparse_gradient_inputs")
ALIAS_OP_TYPES = types_where(lambda f: f.aliases_input)
PRODUCT_GRADIENTS = by_type("product_gradient_output")
CONSTANT_SCALINGS = by_type("constant_scaling_inputs")
FORWARDED_OUTPUTS = by_type("forwarded_output")
ELEMENTWISE_GRADIENTS = types_where(lambda f: f.elementwise_gradient)
GRADIENT_INTO_OUTPUT = by_type("gradient_into_output")
MATMUL_LIKE = types_where(lambda f: f.flops_kind == "matmul")
CONV_LIKE = types_where(lambda f: f.flops_kind == "conv")
HEAVY_OP_TYPES = types_where(lambda f: f.heavy)
NORMALISATION_OP_TYPES = types_where(lambda f: f.normalisation)
EXPENSIVE_OP_TYPES = types_where(lambda f: f.expensive)


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


# TensorFlow's own CPU kernels for the gradients of Conv2D (used when oneDNN is off)
# im2col into a temporary sized to fill a 30 MiB "L3 cache" working set
# (tensorflow/core/kernels/conv_grad_{filter,input}_ops.cc), whatever the batch.
_EIGEN_WORKING_SET = 30 << 20
_EIGEN_L2 = 256 << 10


def conv_gradient_workspace(op, differentiated, threads):
    """Bytes of the im2col buffers TensorFlow's CPU kernels allocate for the gradients
    of a Conv2D `op` (NHWC, static shapes); (0, 0) where that does not apply.

    Args:
      op: a Conv2D op.
      differentiated: indices of its inputs that receive a gradient (0: the input,
        1: the filter).
      threads: the CPU device's intra-op threads.
    Returns:
      (bytes of the filter gradient's buffer, bytes of the input gradient's buffer).
    """
    if op.type != "Conv2D" or _attr(op, "data_format") not in (None, "NHWC"):
        return 0, 0
    x, kernel, y = op.inputs[0].shape, op.inputs[1].shape, op.outputs[0].shape
    if not (x.is_fully_defined() and kernel.is_fully_defined() and y.is_fully_defined()):
        return 0, 0
    batch = x[0]
    dtype_size = op.outputs[0].dtype.size
    target = _EIGEN_WORKING_SET // dtype_size
    image = y[1] * y[2]                        # output positions per image
    window = kernel[0] * kernel[1] * kernel[2]  # filter_total_size
    depth = kernel[3]
    work = image * window + image * depth + window * depth
    for_filter = for_input = 0
    if 1 in differentiated:  # Conv2DBackpropFilter: always sharded
        for_filter = -(-target // work) * image * window * dtype_size
    if 0 in differentiated:  # Conv2DBackpropInput: one image at a time when work is large
        parallel = batch == 1 or work // max(threads, 1) >= _EIGEN_L2 // dtype_size
        shard = 1 if parallel else -(-target // work)
        for_input = shard * image * window * dtype_size
    return for_filter, for_input


# FusedBatchNormV3's third reserve space (output 5) is a kernel's workspace: the graph
# gives it no shape, the kernel chooses its size (measured with TensorFlow 2.16 and
# 2.21, float32):
# - oneDNN on a CPU: empty, but where Grappler's remapper fuses the batch norm with the
#   Relu that alone reads its output (_MklNativeFusedBatchNormEx), the ReLU's mask: half
#   a byte per element of the output;
# - TensorFlow's own CPU kernel (oneDNN off): one float.
# On a GPU it is cuDNN's reserve space, whose size is not known here.
_RESERVE_SPACE_3 = 5


def workspace_bytes(op, index, kernels):
    """Bytes of output `index` of `op` where it is a kernel's workspace of a size the
    graph does not give; None where that is not known.

    Args:
      op: a tf.Operation.
      index: one of its outputs.
      kernels: which CPU kernels run the step: ONEDNN, EIGEN, or None (a GPU, or not
        known).
    """
    if op.type != "FusedBatchNormV3" or index != _RESERVE_SPACE_3 or kernels is None:
        return None
    if kernels == EIGEN:
        return op.outputs[index].dtype.size
    if _fused_with_relu(op):
        return _elements(op.outputs[0].shape.as_list()) // 2
    return 0


def _fused_with_relu(op):
    """Whether Grappler's remapper fuses this batch norm with the Relu after it: in
    training, float32 or bfloat16, output 0 read by that Relu alone, and neither op
    waiting for or waited on through control edges."""
    readers = op.outputs[0].consumers()
    if (not _attr(op, "is_training")
            or getattr(_attr(op, "T"), "name", None) not in ("float32", "bfloat16")
            or len(readers) != 1 or readers[0].type != "Relu"):
        return False
    return not any(o.control_inputs or _tf_private.control_outputs(o) for o in (op, readers[0]))


def _elements(shape):
    return math.prod(1 if d is None else d for d in shape)


def output_elements(op, unknown_dim_size=1):
    """Elements of `op`'s outputs (unknown dimensions count as `unknown_dim_size`)."""
    dims = (sized_dims(t, unknown_dim_size) for t in op.outputs)
    return sum(_elements(d) for d in dims if d is not None)


def flops(op, unknown_dim_size=1):
    """Estimated cost of running `op` once, in floating-point operations.

    Matmuls and convolutions count 2 per multiply-add; other ops one per output
    element (memsave.planner.costs prices those by the machine). Unknown
    dimensions count as `unknown_dim_size` (the batch the step is planned for).
    """
    out_elements = output_elements(op, unknown_dim_size)
    if op.type in MATMUL_LIKE and op.inputs and op.inputs[0].shape.rank:
        a = sized_dims(op.inputs[0], unknown_dim_size)
        transpose_a = _attr(op, "transpose_a") or _attr(op, "adj_x")
        inner = a[-2] if transpose_a else a[-1]
        return 2 * out_elements * (inner or 1)
    if op.type in CONV_LIKE and len(op.inputs) > 1 and op.inputs[1].shape.rank:
        kernel = op.inputs[1].shape.as_list()
        if op.type == "DepthwiseConv2dNative":
            window = _elements(kernel[:-2])
        elif op.type == "Conv2DBackpropInput":
            window = _elements(kernel[:-2]) * (kernel[-1] or 1)
        else:
            window = _elements(kernel[:-1])
        return 2 * out_elements * window
    if op.type == "Einsum":
        return _einsum_flops(op, out_elements, unknown_dim_size)
    return out_elements


def _einsum_flops(op, out_elements, unknown_dim_size):
    """2 x the product of every distinct index's size (a contraction's multiply-adds)."""
    equation = _attr(op, "equation")
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


def _attr(op, name):
    try:
        value = op.get_attr(name)
    except ValueError:
        return None
    return value.decode() if isinstance(value, bytes) else value
