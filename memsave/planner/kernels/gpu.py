"""cuDNN's kernels on a GPU: their workspaces' sizes are not known here.

No GPU was lent to this project's measurements, and cuDNN chooses its buffers as it
runs, so this profile sizes nothing: a batch norm's third reserve space stays of
unknown size (never read from the forward pass: a segment recomputes its batch norm),
and a convolution's gradients add nothing. What TensorFlow's source says of them
(tensorflow/core/kernels):

- FusedBatchNormV3's reserve space (output 5) is what cuDNN's batch norm asks for
  (`CudnnBatchNormAllocatorInOutput`, fused_batch_norm_op.cc): a size from cuDNN, or
  a scalar where it asks for none; its workspace is a temporary beside it.
- Convolutions and their gradients take cuDNN's workspace from a scratch allocator
  limited by TF_CUDNN_WORKSPACE_LIMIT_IN_MB (default 4 GiB: conv_ops*.cc,
  conv_grad_*_ops.cc); autotuning picks the algorithm, and so the size, per shape.
  Those temporaries are freed as the kernel returns, but they are part of a peak.

memsave.calibrate_memory measures a step where this matters.
"""


def workspace_bytes(op, index):
    """None for every output of every op: cuDNN sizes its reserve spaces as it runs
    (the arguments as memsave.planner.kernels.eigen_cpu's)."""
    return None


def conv_gradient_workspace(op, differentiated, threads, unknown_dim_size=1):
    """(0, 0): cuDNN's convolution workspaces come from a scratch allocator whose
    share of the limit autotuning decides; none is counted (the arguments as
    memsave.planner.kernels.eigen_cpu's)."""
    return 0, 0
