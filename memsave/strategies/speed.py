"""'speed': keep the outputs of the expensive ops, recompute only cheap ones.

Ops are chosen by op type, never by name.
"""

from memsave.strategies.base import keep_if

EXPENSIVE_OP_TYPES = frozenset([
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "SparseMatMul",
    "Einsum", "Conv2D", "Conv3D", "Conv1D", "DepthwiseConv2dNative",
    "Conv2DBackpropInput", "Conv3DBackpropInputV2", "FusedConv2DBiasActivation",
    "_FusedConv2D", "_FusedMatMul", "_MklMatMul", "_MklConv2D", "CudnnRNN", "CudnnRNNV2",
    "CudnnRNNV3",
])


def expensive_op_outputs(op_types=EXPENSIVE_OP_TYPES):
    """A strategy keeping the outputs of ops whose type is in `op_types`."""
    op_types = frozenset(op_types)
    return keep_if(lambda t, region: t.op.type in op_types and t.dtype.is_floating,
                   "output of an expensive {op_type} op")
