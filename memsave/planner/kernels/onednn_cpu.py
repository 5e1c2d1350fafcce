"""oneDNN's CPU kernels, as TensorFlow runs them by default on CPUs with AVX-512
(TF_ENABLE_ONEDNN_OPTS=1 elsewhere).

What they allocate that the graph does not show:

- A Conv2D's gradients hold no im2col buffer the model counts: with none, the default
  CNN of benchmarks/compare.py is predicted at 413 MiB under tf.gradients (409
  measured) and 73 MiB under 'memory' (70.5-77 measured; AMD EPYC with AVX-512,
  TensorFlow 2.21, 2026-11-27; benchmarks/RESULTS.md).
- A FusedBatchNormV3's third reserve space (output 5) is empty, but where Grappler's
  remapper fuses the batch norm with the Relu that alone reads its output
  (_MklNativeFusedBatchNormEx), it is the ReLU's mask: half a byte per element of the
  output. Measured with TensorFlow 2.16 and 2.21, float32, against the allocation
  records (tests/test_planner.py).
"""

from memsave.graph import _tf_private
from memsave.planner import opinfo


def workspace_bytes(op, index):
    """A batch norm's third reserve space, output `index` of `op`: the mask of the ReLU
    fused with it (half a byte per output element), else empty; None for any other
    output (its size is the graph's).

    Args:
      op: a tf.Operation.
      index: one of its outputs.
    Returns:
      Bytes, or None.
    """
    if opinfo.is_reserve_space_3(op, index):
        return opinfo.elements(op.outputs[0].shape.as_list()) // 2 if _fused_with_relu(op) else 0
    return None


def conv_gradient_workspace(op, differentiated, threads, unknown_dim_size=1):
    """No im2col buffer: (0, 0) for the (filter, input) gradients of any `op` (the
    arguments as memsave.planner.kernels.eigen_cpu's)."""
    return 0, 0


def _fused_with_relu(op):
    """Whether Grappler's remapper fuses this batch norm with the Relu after it: in
    training, float32 or bfloat16, output 0 read by that Relu alone, and neither op
    waiting for or waited on through control edges."""
    readers = op.outputs[0].consumers()
    if (not opinfo.op_attr(op, "is_training")
            or getattr(opinfo.op_attr(op, "T"), "name", None) not in ("float32", "bfloat16")
            or len(readers) != 1 or readers[0].type != "Relu"):
        return False
    return not any(o.control_inputs or _tf_private.control_outputs(o) for o in (op, readers[0]))
