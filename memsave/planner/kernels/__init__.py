"""What the kernels of each platform allocate that the graph does not show.

The same graph holds different buffers on different kernels: TensorFlow's own (Eigen)
CPU kernels give a convolution's gradients im2col workspaces, oneDNN's keep a fused
batch norm's ReLU mask, cuDNN's choose their workspaces as they run. Each module here
is one platform's profile, with the same two functions:

- `workspace_bytes(op, index)`: the bytes of an output the graph gives no shape (a
  batch norm's third reserve space), or None where the profile does not know them;
- `conv_gradient_workspace(op, differentiated, threads, unknown_dim_size)`: the bytes
  of the buffers a Conv2D's filter and input gradients allocate besides their results
  (unknown dimensions counted as `unknown_dim_size`).

Profiles:

- eigen_cpu:  TensorFlow's own CPU kernels (oneDNN off, as on CPUs without AVX-512);
- onednn_cpu: oneDNN's CPU kernels (on by default on CPUs with AVX-512);
- gpu:        cuDNN's, whose sizes are not known here.

`profile` picks one from memsave.environment.Environment.kernels, read once per call.
"""

from memsave.environment import EIGEN, ONEDNN
from memsave.planner.kernels import eigen_cpu, gpu, onednn_cpu


def profile(kernels):
    """The profile of the kernels that run a step.

    Args:
      kernels: Environment.kernels: ONEDNN or EIGEN on a machine without a GPU, None
        with one.
    Returns:
      The profile module: eigen_cpu, onednn_cpu or gpu.
    """
    if kernels == EIGEN:
        return eigen_cpu
    if kernels == ONEDNN:
        return onednn_cpu
    return gpu
