"""What the planner knows about each op type: what its gradient reads, whether its
output shares its input's buffer, and how much it costs to run again.

Facts are by op type (never by name). They describe TensorFlow's registered
gradient functions (tensorflow/python/ops/*_grad.py): an op whose gradient reads
only its outputs (Relu, Tanh, Softmax) lets the forward free its inputs; one whose
gradient reads nothing but shapes (Add, Reshape, Sum) keeps nothing alive. An op
type not listed here is assumed to read all its inputs and outputs, which can only
over-predict memory.
"""

import functools
import math

from memsave.environment import EIGEN, ONEDNN  # noqa: F401 (named once, there)
from memsave.graph import _tf_private
from memsave.region import SHAPE_READER_OP_TYPES, sized_dims


# Gradient reads nothing of the forward pass but static shapes.
_READS_NOTHING = frozenset([
    "Add", "AddV2", "AddN", "Sub", "Neg", "Identity", "IdentityN", "Snapshot", "StopGradient",
    "Reshape", "Squeeze", "ExpandDims", "Transpose", "ConjugateTranspose", "BiasAdd",
    "BiasAddV1", "Sum", "Mean", "ConcatV2", "Concat", "Pack", "Unpack", "Split", "SplitV",
    "Slice", "StridedSlice", "Tile", "Pad", "PadV2", "MirrorPad", "Cast", "ZerosLike",
    "OnesLike", "Fill", "BroadcastTo", "AvgPool", "AvgPool3D", "PreventGradient",
    "ReadVariableOp", "Shape", "Size", "Rank", "ShapeN", "Sign", "Floor", "Ceil", "Round",
    "EnsureShape", "CheckNumerics", "DepthToSpace", "SpaceToDepth", "Reverse", "ReverseV2",
])

# Gradient reads the op's outputs only.
_READS_OUTPUTS = frozenset([
    "Relu", "Relu6", "Elu", "Selu", "Tanh", "Sigmoid", "Exp", "Sqrt", "Rsqrt", "Reciprocal",
    "Inv", "Softmax", "LogSoftmax", "Expm1", "Asinh", "Acosh",
])

# Gradient reads specific inputs/outputs: (input indices, output indices).
_READS = {
    "MatMul": ((0, 1), ()), "BatchMatMul": ((0, 1), ()), "BatchMatMulV2": ((0, 1), ()),
    "BatchMatMulV3": ((0, 1), ()), "Einsum": ((0, 1), ()),
    "Conv2D": ((0, 1), ()), "Conv3D": ((0, 1), ()), "DepthwiseConv2dNative": ((0, 1), ()),
    "Conv2DBackpropInput": ((1, 2), ()),
    "Mul": ((0, 1), ()), "RealDiv": ((0, 1), ()), "Div": ((0, 1), ()), "DivNoNan": ((0, 1), ()),
    "Maximum": ((0, 1), ()), "Minimum": ((0, 1), ()), "SquaredDifference": ((0, 1), ()),
    "Pow": ((0, 1), (0,)), "Square": ((0,), ()), "Log": ((0,), ()), "Log1p": ((0,), ()),
    "Sin": ((0,), ()), "Cos": ((0,), ()), "Abs": ((0,), ()), "Erf": ((0,), ()),
    "Softplus": ((0,), ()), "LeakyRelu": ((0,), ()), "Atan": ((0,), ()),
    "Erfc": ((0,), ()), "Tan": ((0,), ()), "Sinh": ((0,), ()), "Cosh": ((0,), ()),
    "Asin": ((0,), ()), "Acos": ((0,), ()), "Atanh": ((0,), ()), "Lgamma": ((0,), ()),
    "Digamma": ((0,), ()),
    "Select": ((0,), ()), "SelectV2": ((0,), ()),
    "MaxPool": ((0,), (0,)), "MaxPoolV2": ((0,), (0,)), "MaxPool3D": ((0,), (0,)),
    "Max": ((0,), (0,)), "Min": ((0,), (0,)), "Prod": ((0,), ()),
    "FusedBatchNorm": ((0, 1), (3, 4)), "FusedBatchNormV2": ((0, 1), (3, 4)),
    "FusedBatchNormV3": ((0, 1), (3, 4, 5)),
    "SoftmaxCrossEntropyWithLogits": ((), (1,)),
    "SparseSoftmaxCrossEntropyWithLogits": ((), (1,)),
    "L2Loss": ((0,), ()),
    "GatherV2": ((1,), ()), "Gather": ((1,), ()), "ResourceGather": ((1,), ()),
    # TensorList writes and reads: their gradients read the index, and of the element
    # only its shape, which a loop's gradient computes in the forward loop and keeps
    # instead (an RNN's h written to its output sequence is not kept per iteration),
    # where the graph knows it (`element_reads`).
    "TensorListSetItem": ((1,), ()), "TensorListGetItem": ((1,), ()),
    "TensorListPushBack": ((), ()), "TensorListPopBack": ((), ()),
    "TensorListFromTensor": ((), ()), "TensorListStack": ((), ()),
}
# The input of a TensorList write whose shape its gradient reads (zeros_like, shape):
# TensorFlow keeps the input itself where the graph does not know the shape whole.
_ELEMENT_INPUT = {"TensorListSetItem": 2, "TensorListPushBack": 1, "TensorListFromTensor": 0}
_READS.update({t: ((), ()) for t in _READS_NOTHING if t not in _READS})

# Ops whose gradient with respect to these inputs is sparse (tf.IndexedSlices): the rows
# read, not the whole input.
SPARSE_GRADIENT_INPUTS = {"GatherV2": (0,), "Gather": (0,)}

# Gradients that, for an input broadcast against a larger output, first compute an
# output-sized product and then reduce it: how many such temporaries at once.
_BROADCAST_TEMPORARIES = {
    "Mul": 1, "SquaredDifference": 1, "Maximum": 1, "Minimum": 1,
    "RealDiv": 2, "Div": 2, "DivNoNan": 2, "Pow": 2,
}
# Gradients that broadcast the incoming gradient to the input's size and then
# scale it (Mean: a Tile, then a division): one input-sized temporary.
_TILE_TEMPORARIES = frozenset(["Mean"])

# Outputs that share the buffer of input 0 (no new memory) when the kernel runs.
ALIAS_OP_TYPES = frozenset([
    "Identity", "Snapshot", "StopGradient", "Reshape", "Squeeze", "ExpandDims",
    "EnsureShape", "CheckNumerics", "PreventGradient", "ReadVariableOp",
])

# Gradients that end in a product with a tensor of the forward pass which they also
# read elsewhere: op type -> that tensor's output index. Where the op's input is scaled
# by a constant (`scores / sqrt(d)` before a softmax, Keras' attention scores times
# theirs) and read by nothing else, the gradient of that scaling multiplies the product
# by the constant, and Grappler's constant folding pushes the constant down onto the
# forward tensor: `g * (softmax * c)`, whose `softmax * c` the executor makes as soon
# as the softmax is made, in the forward pass, and holds until the gradient beside the
# softmax (its gradient's sum reads it too). buffer_links.link_folded_products. The
# project's own transformer (8 layers, a [16, 4, 128, 128] softmax each): 8 x 4 MiB
# alive at tf.gradients' peak that no op of the graph shows (measured 213-223 MiB,
# predicted 188 without them; AMD EPYC). Where the gradient reads the tensor in the
# product only (an Exp's output, a Mul's other input), the folded product takes its
# place: nothing more is held.
PRODUCT_GRADIENTS = {"Softmax": 0}
# The ops scaling by a constant that the pushdown goes through: op type -> the inputs
# the constant may be.
CONSTANT_SCALINGS = {"Mul": (0, 1), "RealDiv": (1,)}

# Outputs a kernel writes into an input's buffer when nothing else reads that input
# (OpKernelContext::forward_input_or_allocate_output): op type -> (input, output). The
# sparse cross-entropy's backprop takes the logits' buffer (a language model's largest),
# a BiasAdd its input's (a Dense head's matmul output): the GPT benchmark's tf.gradients
# prediction went from +17% to +8% with it (AMD EPYC). No kernel does so where the plan
# keeps that input for a later segment (forward_pass.unforwardable_outputs): counted anyway, the
# 'memory' plan chosen kept the head's matmul output, predicted -19%.
FORWARDED_OUTPUTS = {"SparseSoftmaxCrossEntropyWithLogits": (0, 1), "BiasAdd": (0, 0)}

# Ops whose gradient is elementwise, made by elementwise kernels (cwise_ops_common.h's
# UnaryOp and BinaryOp, the *Grad kernels of tanh, sigmoid, relu, ...), which write
# their output into an input of its shape and dtype they read last.
ELEMENTWISE_GRADIENTS = frozenset([
    "Neg", "Abs", "Exp", "Expm1", "Log", "Log1p", "Sqrt", "Rsqrt", "Square", "Reciprocal",
    "Inv", "Tanh", "Sigmoid", "Erf", "Erfc", "Sin", "Cos", "Tan", "Sinh", "Cosh", "Asin",
    "Acos", "Atan", "Asinh", "Acosh", "Atanh", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu",
    "Softplus", "Softsign", "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan",
    "MulNoNan", "Maximum", "Minimum", "SquaredDifference", "Pow", "Atan2", "Xlogy", "Xdivy",
])

# Gradients written into the buffer of an output of the op that only they read: op type
# -> (input, output). The sparse cross-entropy's gradient is its backprop output times
# the loss's gradient, made in place (a binary op forwards its input's buffer).
GRADIENT_INTO_OUTPUT = {"SparseSoftmaxCrossEntropyWithLogits": (0, 1)}

# What an op type costs to run again, in one table: the cost model
# (memsave.planner.costs) and the strategies (memsave.strategies) read it here.
#
# Ops whose cost is dominated by multiply-adds, priced by their FLOPs (flops() counts
# these); everything else is priced per output element.
MATMUL_LIKE = frozenset(["MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"])
CONV_LIKE = frozenset(["Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput"])
HEAVY_OP_TYPES = MATMUL_LIKE | CONV_LIKE | frozenset(["Einsum"])
# Batch/layer normalisations: computing the statistics and applying them takes
# several passes over the data (priced per normalised element).
NORMALISATION_OP_TYPES = frozenset([
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3",
    "_FusedBatchNormEx", "LayerNorm",
])
# Ops whose outputs are worth keeping rather than recomputing: 'speed' keeps them, and
# 'memory' (with a tolerance) and budgets add them to a plan while they fit. The heavy
# ops, and kernels flops() does not count (fused and oneDNN kernels, cuDNN's RNNs, a
# sparse matmul, a 3-D convolution's input gradient; Conv1D is no TensorFlow op type, a
# 1-D convolution runs as a Conv2D). The cost model prices those extra types per output
# element; moving them into HEAVY_OP_TYPES would change their price (and with it,
# possibly, plans), so the two sets stay apart.
EXPENSIVE_OP_TYPES = HEAVY_OP_TYPES | frozenset([
    "SparseMatMul", "Conv1D", "Conv3DBackpropInputV2", "FusedConv2DBiasActivation",
    "_FusedConv2D", "_FusedMatMul", "_MklMatMul", "_MklConv2D",
    "CudnnRNN", "CudnnRNNV2", "CudnnRNNV3",
])


# Ops registered without a gradient (ops.NotDifferentiable) although an output may be
# floating: tf.gradients sends nothing through them to their inputs.
_NOT_DIFFERENTIABLE = SHAPE_READER_OP_TYPES | frozenset(["StopGradient", "ZerosLike", "OnesLike"])


def passes_gradient(op):
    """Whether tf.gradients sends a gradient through `op` to its inputs: not through an
    op registered without one, nor through one none of whose outputs can carry one
    (tf.gradients backpropagates through floating, complex, resource and variant
    tensors only: not through a Shape's integers or a comparison's booleans)."""
    return op.type not in _NOT_DIFFERENTIABLE and any(
        t.dtype.is_floating or t.dtype.is_complex or t.dtype.name in ("resource", "variant")
        for t in op.outputs)


@functools.lru_cache(maxsize=None)
def gradient_reads(op_type, num_inputs, num_outputs):
    """The forward tensors the gradient of an op of `op_type` reads.

    Returns:
      (input indices, output indices). Unknown op types, and `op_type` None (a gradient
      that is not its type's own), read everything.
    """
    reads = _READS.get(op_type)
    if reads is None:
        if op_type in _READS_OUTPUTS:
            return (), tuple(range(num_outputs))
        return tuple(range(num_inputs)), tuple(range(num_outputs))
    inputs, outputs = reads
    return (tuple(i for i in inputs if i < num_inputs),
            tuple(i for i in outputs if i < num_outputs))


# Ops whose gradient with respect to each input reads different tensors: (input
# indices, output indices) per differentiated input. tf.gradients builds the gradient of
# every input, but TensorFlow never runs the part no x needs (a Mul by a constant, a
# MatMul with a fixed matrix): its reads are only those of the inputs that get a
# gradient. Keras' attention scales its scores by a constant, so the scores themselves
# are not kept for the backward pass.
_READS_PER_INPUT = {
    "Mul": {0: ((1,), ()), 1: ((0,), ())},
    "MatMul": {0: ((1,), ()), 1: ((0,), ())},
    "BatchMatMul": {0: ((1,), ()), 1: ((0,), ())},
    "BatchMatMulV2": {0: ((1,), ()), 1: ((0,), ())},
    "BatchMatMulV3": {0: ((1,), ()), 1: ((0,), ())},
    "Einsum": {0: ((1,), ()), 1: ((0,), ())},
    "Conv2D": {0: ((1,), ()), 1: ((0,), ())},
    "Conv3D": {0: ((1,), ()), 1: ((0,), ())},
    "DepthwiseConv2dNative": {0: ((1,), ()), 1: ((0,), ())},
    "RealDiv": {0: ((1,), ()), 1: ((0, 1), ())},
    "Div": {0: ((1,), ()), 1: ((0, 1), ())},
    "DivNoNan": {0: ((1,), ()), 1: ((0, 1), ())},
    # (Pow's output only for the exponent's gradient, which a constant exponent never
    # gets: GELU's tanh approximation takes pow(x, 3), and holding its output put a
    # GELU MLP's tf.gradients peak at +17%, keras-hub's GPT-2 under fit at +18%.)
    "Pow": {0: ((0, 1), ()), 1: ((0,), (0,))},
}


# Ops whose gradient for these inputs is the incoming gradient itself, the same tensor,
# where the input is shaped as the output (Add's of equal shapes, BiasAdd's of its
# value, AddN's of every input): it takes no buffer of its own.
_PASS_THROUGH = {"Add": (0, 1), "AddV2": (0, 1), "Sub": (0,), "BiasAdd": (0,),
                 "BiasAddV1": (0,)}


def passes_gradient_through(op_type, index):
    """Whether the gradient of an op of `op_type` for its input `index` is the incoming
    gradient itself when that input has the output's size."""
    return op_type == "AddN" or index in _PASS_THROUGH.get(op_type, ())


def element_reads(op):
    """The input indices a TensorList write's gradient reads besides `gradient_reads`'
    (its type's): the element, where its shape is not fully known (a Keras RNN's batch
    of None); none for other ops."""
    index = _ELEMENT_INPUT.get(op.type)
    if index is None or index >= len(op.inputs) or op.inputs[index].shape.is_fully_defined():
        return ()
    return (index,)


def differentiated_reads(op_type, num_inputs, num_outputs, differentiated):
    """The forward tensors the gradient of an op of `op_type` reads when only the inputs
    `differentiated` get a gradient (the others' part is never run).

    Returns:
      (input indices, output indices), as gradient_reads.
    """
    per_input = _READS_PER_INPUT.get(op_type)
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
    factor = _BROADCAST_TEMPORARIES.get(op_type)
    if factor:
        count = factor * sum(1 for i in differentiated if input_bytes[i] < output_bytes)
        return count * output_bytes, max(count, 1)
    if op_type in _TILE_TEMPORARIES and 0 in differentiated:
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
