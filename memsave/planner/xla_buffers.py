"""Buffers an XLA program holds on a CPU that the graph of its function does not show.

Keras runs a grouped convolution (`Conv2D(groups=...)`, ConvNeXt's depthwise 7x7 ones)
on a CPU as a function compiled with `jit_compile=True`, and its gradient as a compiled
function too. XLA's CPU backend has no grouped convolution: it computes the filter
gradient of one as a dense convolution, and the gradient's program holds a preallocated
temporary of two dense [kh, kw, channels in, channels out] filters. Measured on Keras'
ConvNeXtTiny (AMD EPYC, TF 2.21, XLA's buffer assignment dump): the stage-3 block's
gradient program, 7x7, 768 channels, holds 220.5 MiB (2 x 7*7*768*768*4 bytes) while the
filter it returns is 147 KiB; the stage-2 block's 55 MiB. That one temporary decides
tf.gradients' peak on that model (the model predicted 422 MiB without it, 622 measured).
On a GPU XLA calls cuDNN's grouped convolution, which holds no such filter.
"""

from memsave.graph import _tf_private, calls

_CONVOLUTION_TYPES = frozenset(["Conv2D"])
# Dense filters the gradient's program holds for a grouped convolution.
_DENSE_FILTERS = 2


def gradient_temporary_bytes(op):
    """Bytes of the temporaries the XLA program of the gradient of call op `op` holds on a
    CPU beyond what the graph shows: 0 where `op` is no call compiled by XLA, or its
    function runs no grouped convolution."""
    if not calls.is_call(op) or not _tf_private.compiled_by_xla(op):
        return 0
    function = _tf_private.called_function_graph(op)
    if function is None:
        return 0
    return max((_grouped_filter_gradient_bytes(inner, function, op)
                for inner in function.get_operations()), default=0)


def _grouped_filter_gradient_bytes(conv, function, call):
    """For a grouped convolution `conv` of `function` (run by `call`), the bytes of the
    dense filters XLA's CPU backend holds for its filter gradient; else 0."""
    if conv.type not in _CONVOLUTION_TYPES or conv.inputs[0].shape.rank != 4:
        return 0
    channels = conv.inputs[0].shape[-1]
    kernel = _filter_shape(conv.inputs[1], function, call)
    if channels is None or kernel is None or kernel.rank != 4 or not kernel.is_fully_defined():
        return 0
    height, width, per_group, out = kernel.as_list()
    if per_group in (0, channels):
        return 0
    return _DENSE_FILTERS * height * width * channels * out * conv.outputs[0].dtype.size


def _filter_shape(t, function, call):
    """The static shape of filter tensor `t` of `function`: its own, or, where it is read
    from an argument (a variable's handle, through reads and casts), the argument's."""
    while not t.shape.is_fully_defined() and t.op.type in ("Identity", "Cast",
                                                           "ReadVariableOp"):
        t = t.op.inputs[0]
    if t.shape.is_fully_defined() and t.dtype.name != "resource":
        return t.shape
    if t.op.type != "Placeholder" or t not in function.inputs:
        return None
    outer = call.inputs[function.inputs.index(t)]
    if outer.dtype.name == "resource":
        return _tf_private.resource_value_shape(outer)
    return outer.shape
