"""TensorFlow's own CPU kernels (Eigen), as they run where oneDNN is off: on a CPU
without AVX-512, or with TF_ENABLE_ONEDNN_OPTS=0.

What they allocate that the graph does not show, each read from TensorFlow's source and
checked against its allocation records:

- A Conv2D's gradients (Conv2DBackpropFilter, Conv2DBackpropInput) im2col into a
  temporary sized to fill a 30 MiB "L3 cache" working set, whatever the batch
  (tensorflow/core/kernels/conv_grad_{filter,input}_ops.cc): on the default CNN of
  benchmarks/compare.py, [87, 256, 288] floats (25.7 MB) each, and tf.gradients runs
  the two of a convolution side by side. Counted, they explain why that CNN's
  tf.gradients step measured 430 MiB on an AMD EPYC without AVX-512 (408 with oneDNN)
  and its 'memory' step 113 MiB, 0.26x (0.17x with oneDNN), predicted within 4%
  (2026-11-27). tests/test_planner.py checks the sizes against the profiler's ([87,
  256, 144] and [159, 256, 144] on a stride-2 convolution).
- A FusedBatchNormV3's third reserve space (output 5) is one float: the kernel
  allocates it as a scalar (`allocate_output(5, {})` in fused_batch_norm_op.cc);
  measured with TensorFlow 2.16 and 2.21.
"""

from memsave.planner import opinfo
from memsave.region import sized_dims

# The working set TensorFlow's CPU convolution gradients fill with im2col rows, and
# the work per thread (an L2 cache) from which the input gradient takes one image at
# a time instead of a shard of images.
_WORKING_SET = 30 << 20
_L2 = 256 << 10


def workspace_bytes(op, index):
    """Bytes of output `index` of `op` where it is a kernel's workspace of a size the
    graph does not give: a batch norm's third reserve space is one float.

    Args:
      op: a tf.Operation.
      index: one of its outputs.
    Returns:
      Its bytes, or None where it is no such workspace.
    """
    if not opinfo.is_reserve_space_3(op, index):
        return None
    return op.outputs[index].dtype.size


def conv_gradient_workspace(op, differentiated, threads, unknown_dim_size=1):
    """Bytes of the im2col buffers these kernels allocate for the gradients of a
    Conv2D `op` (NHWC); (0, 0) where that does not apply.

    Args:
      op: a Conv2D op.
      differentiated: indices of its inputs that receive a gradient (0: the input,
        1: the filter).
      threads: the CPU device's intra-op threads.
      unknown_dim_size: what an unknown dimension counts as (memsave.region.sized_dims):
        under Keras' `fit` the batch is unknown when the step is traced, and the
        buffers are what they are at the batch it runs with (a conv-BN CNN's
        tf.gradients step was predicted 18% low, its 'memory' step 26% low, without them).
    Returns:
      (bytes of the filter gradient's buffer, bytes of the input gradient's buffer).
    """
    if op.type != "Conv2D" or opinfo.op_attr(op, "data_format") not in (None, "NHWC"):
        return 0, 0
    x, kernel, y = (sized_dims(t, unknown_dim_size) for t in (op.inputs[0], op.inputs[1],
                                                               op.outputs[0]))
    if x is None or kernel is None or y is None or len(kernel) != 4 or len(y) != 4:
        return 0, 0
    batch = x[0]
    dtype_size = op.outputs[0].dtype.size
    target = _WORKING_SET // dtype_size
    image = y[1] * y[2]                        # output positions per image
    window = kernel[0] * kernel[1] * kernel[2]  # filter_total_size
    depth = kernel[3]
    work = image * window + image * depth + window * depth
    for_filter = for_input = 0
    if 1 in differentiated:  # Conv2DBackpropFilter: always sharded
        for_filter = -(-target // work) * image * window * dtype_size
    if 0 in differentiated:  # Conv2DBackpropInput: one image at a time when work is large
        parallel = batch == 1 or work // max(threads, 1) >= _L2 // dtype_size
        shard = 1 if parallel else -(-target // work)
        for_input = shard * image * window * dtype_size
    return for_filter, for_input
