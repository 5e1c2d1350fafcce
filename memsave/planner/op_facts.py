"""Everything the planner assumes about one op type, in one record.

`OP_FACTS[op_type]` is an `OpFacts`: what the op's gradient reads, which buffers its
kernels share, what temporaries its gradient makes and how it is priced. An op type
not listed gets `UNKNOWN`, whose gradient reads all its inputs and outputs and which
shares no buffer: that can only over-predict memory. `facts_of` answers for any type.

Facts are by op type (never by name). Those of gradients describe TensorFlow's
registered gradient functions (tensorflow/python/ops/*_grad.py); those of buffers,
its kernels. The table is written below as rows of facts, each followed by the op
types it holds for, beside the measurements that justify it; `_given` refuses a fact
given twice with different values. memsave.planner.opinfo asks the questions the
memory model and the cost model ask; other modules derive the sets they read with
`types_where`. This module imports nothing of memsave.
"""

import dataclasses

# A read of every input (or output), whatever their number.
ALL = "all"


@dataclasses.dataclass(frozen=True)
class OpFacts:
    """What memsave assumes about one op type. Indices are input or output positions."""

    # (input indices, output indices) the gradient reads of the forward pass, each ALL
    # or a tuple: ((), ()) reads nothing but static shapes.
    gradient_reads: tuple = (ALL, ALL)
    # Where the gradient of each input reads different tensors: input -> (input
    # indices, output indices); None where it does not.
    reads_per_input: dict = None
    # The input of a TensorList write whose shape the gradient reads, where the graph
    # does not know that shape whole; None for other ops.
    element_input: int = None
    # Inputs whose gradient is sparse (tf.IndexedSlices): the rows read.
    sparse_gradient_inputs: tuple = ()
    # Whether tf.gradients sends a gradient through the op at all.
    differentiable: bool = True
    # Inputs whose gradient is the incoming gradient itself (ALL: every input) where
    # the input has the output's size.
    passes_through_inputs: object = ()
    # Output-sized temporaries per input broadcast against a larger output.
    broadcast_temporaries: int = 0
    # Whether the gradient makes one input-sized temporary (a Tile, then a division).
    tile_temporary: bool = False
    # Whether output 0 shares input 0's buffer.
    aliases_input: bool = False
    # Whether the gradient is the output's gradient converted (deferral follows it).
    converts_gradient: bool = False
    # (input, output): the output the kernel writes into that input's buffer.
    forwarded_output: tuple = None
    # (input, output): the gradient for that input, written into that output's buffer.
    gradient_into_output: tuple = None
    # Whether elementwise kernels make the gradient (into an input they read last).
    elementwise_gradient: bool = False
    # Whether an elementwise kernel makes output 0, written into the first input of its
    # size that nothing else reads (not only `forwarded_output`'s one input).
    elementwise_kernel: bool = False
    # The output the gradient ends in a product with (a softmax's); None if none.
    product_gradient_output: int = None
    # The inputs a constant scaling may take its constant from; () if no scaling.
    constant_scaling_inputs: tuple = ()
    # How flops() counts the op: "matmul", "conv", "einsum"; None: per output element.
    flops_kind: str = None
    # Whether it is a batch or layer normalisation (priced per normalised element).
    normalisation: bool = False
    # Whether its outputs are worth keeping although flops() does not count it.
    expensive_kernel: bool = False
    # Whether it reduces input 0 (priced per element it reads, not per one it writes).
    reduction: bool = False
    # Whether it moves no data (output 0 is input 0's buffer, and it reads none of it): priced
    # at an op's overhead alone.
    moves_no_data: bool = False

    @property
    def heavy(self):
        """Whether its cost is dominated by multiply-adds (priced by FLOPs)."""
        return self.flops_kind is not None

    @property
    def expensive(self):
        """Whether its outputs are worth keeping rather than recomputing."""
        return self.heavy or self.expensive_kernel


UNKNOWN = OpFacts()

_ROWS = {}


def _given(op_types, **facts):
    """Records `facts` for each of `op_types`; a fact given twice must agree."""
    for op_type in op_types:
        row = _ROWS.setdefault(op_type, {})
        for name, value in facts.items():
            if row.get(name, value) != value:
                raise ValueError(f"{op_type}: {name} given as {row[name]!r} and {value!r}")
            row[name] = value


def _given_each(field, values):
    """Records one fact, `field`, whose value differs by op type: `values` maps op
    type -> value."""
    for op_type, value in values.items():
        _given([op_type], **{field: value})


# --- What the gradient reads ---------------------------------------------------------
# An op whose gradient reads only its outputs (Relu, Tanh, Softmax) lets the forward
# free its inputs; one whose gradient reads nothing but shapes (Add, Reshape, Sum)
# keeps nothing alive.

# Gradient reads nothing of the forward pass but static shapes.
_given([
    "Add", "AddV2", "AddN", "Sub", "Neg", "Identity", "IdentityN", "Snapshot", "StopGradient",
    "Reshape", "Squeeze", "ExpandDims", "Transpose", "ConjugateTranspose", "BiasAdd",
    "BiasAddV1", "Sum", "Mean", "ConcatV2", "Concat", "Pack", "Unpack", "Split", "SplitV",
    "Slice", "StridedSlice", "Tile", "Pad", "PadV2", "MirrorPad", "Cast", "ZerosLike",
    "OnesLike", "Fill", "BroadcastTo", "AvgPool", "AvgPool3D", "PreventGradient",
    "ReadVariableOp", "Shape", "Size", "Rank", "ShapeN", "Sign", "Floor", "Ceil", "Round",
    "EnsureShape", "CheckNumerics", "DepthToSpace", "SpaceToDepth", "Reverse", "ReverseV2",
], gradient_reads=((), ()))

# Gradient reads the op's outputs only.
_given([
    "Relu", "Relu6", "Elu", "Selu", "Tanh", "Sigmoid", "Exp", "Sqrt", "Rsqrt", "Reciprocal",
    "Inv", "Softmax", "LogSoftmax", "Expm1", "Asinh", "Acosh",
], gradient_reads=((), ALL))

# Gradient reads specific inputs/outputs: (input indices, output indices).
_given_each("gradient_reads", {
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
    # where the graph knows it (`element_input`).
    "TensorListSetItem": ((1,), ()), "TensorListGetItem": ((1,), ()),
    "TensorListPushBack": ((), ()), "TensorListPopBack": ((), ()),
    "TensorListFromTensor": ((), ()), "TensorListStack": ((), ()),
})
# The input of a TensorList write whose shape its gradient reads (zeros_like, shape):
# TensorFlow keeps the input itself where the graph does not know the shape whole.
_given_each("element_input", {"TensorListSetItem": 2, "TensorListPushBack": 1,
                              "TensorListFromTensor": 0})

# Ops whose gradient with respect to each input reads different tensors: (input
# indices, output indices) per differentiated input. tf.gradients builds the gradient of
# every input, but TensorFlow never runs the part no x needs (a Mul by a constant, a
# MatMul with a fixed matrix): its reads are only those of the inputs that get a
# gradient. Keras' attention scales its scores by a constant, so the scores themselves
# are not kept for the backward pass.
_given(["Mul", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D",
        "Conv3D", "DepthwiseConv2dNative"],
       reads_per_input={0: ((1,), ()), 1: ((0,), ())})
_given(["RealDiv", "Div", "DivNoNan"], reads_per_input={0: ((1,), ()), 1: ((0, 1), ())})
# (Pow's output only for the exponent's gradient, which a constant exponent never gets:
# GELU's tanh approximation takes pow(x, 3), and holding its output put a GELU MLP's
# tf.gradients peak at +17%, keras-hub's GPT-2 under fit at +18%.)
_given(["Pow"], reads_per_input={0: ((0, 1), ()), 1: ((0,), (0,))})

# Ops whose gradient with respect to these inputs is sparse (tf.IndexedSlices): the rows
# read, not the whole input.
_given(["GatherV2", "Gather"], sparse_gradient_inputs=(0,))

# Ops registered without a gradient (ops.NotDifferentiable) although an output may be
# floating: tf.gradients sends nothing through them to their inputs. The shape readers
# (memsave.region.SHAPE_READER_OP_TYPES) read their inputs' shapes, not their values.
_given(["Shape", "ShapeN", "Size", "Rank", "StopGradient", "ZerosLike", "OnesLike"],
       differentiable=False)

# Ops whose gradient for these inputs is the incoming gradient itself, the same tensor,
# where the input is shaped as the output (Add's of equal shapes, BiasAdd's of its
# value, AddN's of every input): it takes no buffer of its own.
_given_each("passes_through_inputs", {"Add": (0, 1), "AddV2": (0, 1), "Sub": (0,),
                                      "BiasAdd": (0,), "BiasAddV1": (0,), "AddN": ALL})

# --- Temporaries the gradient makes --------------------------------------------------
# Gradients that, for an input broadcast against a larger output, first compute an
# output-sized product and then reduce it: how many such temporaries at once.
_given_each("broadcast_temporaries", {
    "Mul": 1, "SquaredDifference": 1, "Maximum": 1, "Minimum": 1,
    "RealDiv": 2, "Div": 2, "DivNoNan": 2, "Pow": 2,
})
# Gradients that broadcast the incoming gradient to the input's size and then
# scale it (Mean: a Tile, then a division): one input-sized temporary.
_given(["Mean"], tile_temporary=True)

# --- Buffers the kernels share -------------------------------------------------------
# Outputs that share the buffer of input 0 (no new memory) when the kernel runs.
_given([
    "Identity", "Snapshot", "StopGradient", "Reshape", "Squeeze", "ExpandDims",
    "EnsureShape", "CheckNumerics", "PreventGradient", "ReadVariableOp",
], aliases_input=True)
# Ops whose gradient is their output's gradient, converted (besides those above, whose
# output is their input): memsave.planner.deferral follows a weight's gradient through
# them to the op that makes it.
_given(["Cast"], converts_gradient=True)

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
_given(["Softmax"], product_gradient_output=0)
# The ops scaling by a constant that the pushdown goes through: op type -> the inputs
# the constant may be.
_given_each("constant_scaling_inputs", {"Mul": (0, 1), "RealDiv": (1,)})

# Outputs a kernel writes into an input's buffer when nothing else reads that input
# (OpKernelContext::forward_input_or_allocate_output): op type -> (input, output). The
# sparse cross-entropy's backprop takes the logits' buffer (a language model's largest),
# a BiasAdd its input's (a Dense head's matmul output): the GPT benchmark's tf.gradients
# prediction went from +17% to +8% with it (AMD EPYC). No kernel does so where a copy that
# runs reads that input again (forward_pass.unforwardable_outputs): counted anyway, the
# 'memory' plan chosen kept the head's matmul output, predicted -19%.
_given_each("forwarded_output", {"SparseSoftmaxCrossEntropyWithLogits": (0, 1),
                                 "BiasAdd": (0, 0)})

# Ops whose gradient is elementwise, made by elementwise kernels (cwise_ops_common.h's
# UnaryOp and BinaryOp, the *Grad kernels of tanh, sigmoid, relu, ...), which write
# their output into an input of its shape and dtype they read last. Their own kernels
# are elementwise too (UnaryOp, UnaryElementWiseOp, BinaryOp): each writes its output
# into the first input of the output's shape and type that nothing reads after it
# (`forward_input_or_allocate_output({0, 1}, 0, ...)`). A Keras Dense layer's `x @ w + b`
# then `tanh` holds one buffer, not two for a moment: a 'memory' plan's peak is in a
# segment's recomputation, where an MLP of 36 x tanh(256) was predicted 39.3 MiB for
# 35.7 measured without this (AMD EPYC with AVX-512).
_given([
    "Neg", "Abs", "Exp", "Expm1", "Log", "Log1p", "Sqrt", "Rsqrt", "Square", "Reciprocal",
    "Inv", "Tanh", "Sigmoid", "Erf", "Erfc", "Sin", "Cos", "Tan", "Sinh", "Cosh", "Asin",
    "Acos", "Atan", "Asinh", "Acosh", "Atanh", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu",
    "Softplus", "Softsign", "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan",
    "MulNoNan", "Maximum", "Minimum", "SquaredDifference", "Pow", "Atan2", "Xlogy", "Xdivy",
], elementwise_gradient=True, elementwise_kernel=True)

# Gradients written into the buffer of an output of the op that only they read: op type
# -> (input, output). The sparse cross-entropy's gradient is its backprop output times
# the loss's gradient, made in place (a binary op forwards its input's buffer).
_given_each("gradient_into_output", {"SparseSoftmaxCrossEntropyWithLogits": (0, 1)})

# --- What running it again costs -----------------------------------------------------
# The cost model (memsave.planner.costs) and the strategies (memsave.strategies) read
# these. Ops whose cost is dominated by multiply-adds, priced by their FLOPs (flops()
# counts these); everything else is priced per output element (but reductions and
# ops that move no data, below).
_given(["MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"], flops_kind="matmul")
_given(["Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput"], flops_kind="conv")
_given(["Einsum"], flops_kind="einsum")
# Batch/layer normalisations: computing the statistics and applying them takes
# several passes over the data (priced per normalised element).
_given(["FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "_FusedBatchNormEx",
        "LayerNorm"], normalisation=True)
# Reductions read every element of their input and write few: priced per element read.
# (Measured, Intel Xeon with AVX-512: keras-hub GPT-2's recomputed layer-norm Means took
# 11.7 ms of a step where their outputs priced them at nothing.)
_given(["Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin",
        "EuclideanNorm", "L2Loss", "SegmentSum", "UnsortedSegmentSum", "TopKV2"],
       reduction=True)
# Ops whose output is their input's buffer and that read none of it cost only an op's
# overhead (not CheckNumerics, which scans its input; not Snapshot, which copies where
# it cannot forward). A ReadVariableOp's output is its variable's buffer (a loop body
# reads its weights every iteration: memsave.planner.loops.iteration_cost).
_given(["Identity", "StopGradient", "Reshape", "Squeeze", "ExpandDims", "EnsureShape",
        "PreventGradient", "ReadVariableOp"], moves_no_data=True)
# Ops whose outputs are worth keeping rather than recomputing (`expensive`): 'speed'
# keeps them, and 'memory' (with a tolerance) and budgets add them to a plan while they
# fit. The heavy ops, and kernels flops() does not count (fused and oneDNN kernels,
# cuDNN's RNNs, a sparse matmul, a 3-D convolution's input gradient; Conv1D is no
# TensorFlow op type, a 1-D convolution runs as a Conv2D). The cost model prices those
# extra types per output element; giving them a flops_kind would change their price
# (and with it, possibly, plans), so the two facts stay apart.
_given(["SparseMatMul", "Conv1D", "Conv3DBackpropInputV2", "FusedConv2DBiasActivation",
        "_FusedConv2D", "_FusedMatMul", "_MklMatMul", "_MklConv2D",
        "CudnnRNN", "CudnnRNNV2", "CudnnRNNV3"], expensive_kernel=True)


OP_FACTS = {op_type: OpFacts(**row) for op_type, row in sorted(_ROWS.items())}
del _ROWS


def facts_of(op_type):
    """The facts of `op_type`: UNKNOWN where the table has none (or `op_type` is None)."""
    return OP_FACTS.get(op_type, UNKNOWN)


def types_where(holds):
    """The op types of the table whose facts `holds` (a predicate on OpFacts) is true of."""
    return frozenset(op_type for op_type, facts in OP_FACTS.items() if holds(facts))


def by_type(field):
    """Op type -> the value of `field` for the types where it is set (not its default)."""
    default = getattr(UNKNOWN, field)
    return {op_type: getattr(facts, field) for op_type, facts in OP_FACTS.items()
            if getattr(facts, field) != default}
