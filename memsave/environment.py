"""What a plan is made for: the machine, the graph's compiler, the call's settings.

Read once per call (`Environment.read`) and handed to the planner and the builder,
so within a call no layer asks TensorFlow or the process environment again and the two
never see different answers. (Helpers for tests and benchmarks that build a memory model
outside a call, `planner.model_of` and `allocator.of_device`, read it themselves.)
"""

import dataclasses
import os
from typing import Optional

import tensorflow as tf

from memsave.graph import _tf_private
from memsave.scoped import ScopedValues

# Which kernels run a step's ops on a machine without a GPU.
ONEDNN, EIGEN = "onednn", "eigen"

ALWAYS_REWRITE_ENV = "MEMSAVE_ALWAYS_REWRITE"


@dataclasses.dataclass(frozen=True)
class Environment:
    """The facts a plan depends on besides the graph.

    Attributes:
      under_xla: the ops are compiled by XLA (tf.function(jit_compile=True)): it drops
        control inputs and schedules ops itself.
      accelerator: a GPU is visible to TensorFlow.
      kernels: ONEDNN or EIGEN (TensorFlow's own CPU kernels, oneDNN off) on a machine
        without a GPU; None with one (its kernels' workspaces are not modelled).
      conv_threads: intra-op threads of TensorFlow's own CPU convolution gradients
        (kernels EIGEN), whose im2col buffers are part of the peak; else 0.
      inter_op_threads: how many gradient steps the memory model runs side by side
        (the CPU executor's inter-op threads, at most MAX_SIDE_BY_SIDE); 1 with a GPU,
        whose kernels run in order, and under XLA.
      allocator: TensorFlow's allocator for the step's tensors ("BFC (GPU)",
        "BFC (GPU, growing)", "BFC (CPU, growing)"), or None for the CPU's default.
      gate_gradients: tf.gradients' gate_gradients=True: a weight's gradient is
        grouped with its input's, so none may be made last.
      always_rewrite: build the rewrite even where no saving is predicted
        (memsave.always_rewrite(), MEMSAVE_ALWAYS_REWRITE=1).
      recompute_loops: 'auto', 'always' or 'never' (memsave.recompute_loops()): which
        loops the rewrite differentiates through a recomputing copy.
      loop_chunk: 'auto' or iterations per chunk (memsave.recompute_loops(chunk=)):
        how many iterations a recomputing copy's gradient recomputes from one kept
        carry.
      folds_constants: Grappler's constant folding runs on the step (its default; not
        under XLA, which compiles the step itself): it moves constant factors of some
        gradients into the forward pass (memsave.planner.opinfo.PRODUCT_GRADIENTS).
    """
    under_xla: bool = False
    accelerator: bool = False
    kernels: Optional[str] = ONEDNN
    conv_threads: int = 0
    inter_op_threads: int = 1
    allocator: Optional[str] = None
    gate_gradients: bool = False
    always_rewrite: bool = False
    recompute_loops: str = "auto"
    loop_chunk: object = "auto"
    folds_constants: bool = True

    @classmethod
    def read(cls, graph, gate_gradients=False, always_rewrite=False, recompute_loops="auto",
             loop_chunk="auto"):
        """The environment of a call building in `graph`.

        Args:
          graph: the graph the gradients are built in (None: no XLA).
          gate_gradients: the call's tf.gradients argument.
          always_rewrite: whether memsave.always_rewrite() is in force.
          recompute_loops: the memsave.recompute_loops() mode in force.
          loop_chunk: the memsave.recompute_loops() chunk in force.
        """
        accelerator = bool(tf.config.list_physical_devices("GPU"))
        kernels = None if accelerator else (ONEDNN if _tf_private.onednn_enabled() else EIGEN)
        under_xla = graph is not None and _tf_private.in_xla_context(graph)
        return cls(under_xla=under_xla, accelerator=accelerator,
                   kernels=kernels, conv_threads=_eigen_conv_threads(kernels),
                   inter_op_threads=_inter_op_threads(kernels, under_xla),
                   allocator=_allocator(accelerator), gate_gradients=bool(gate_gradients),
                   always_rewrite=bool(always_rewrite), recompute_loops=recompute_loops,
                   loop_chunk=loop_chunk, folds_constants=not under_xla and _folds_constants())

    @property
    def holds_a_limit(self):
        """Whether the plan is for a device that holds a capped memory as one region
        (ONE_REGION: memsave.capacity's question, will the step run within a limit?).
        There a step must fit however the executor schedules it, so where the model
        would count the middle of a range (how far a loop's gradient runs ahead), it
        counts the top."""
        return self.allocator == ONE_REGION

    @property
    def may_read_checkpoints(self):
        """Whether segments may read their checkpoints as the forward pass made them: not
        under XLA, where the reads go through conditionals (as the copies' inputs do,
        see memsave.xla_gates) and XLA's buffers for the small CNN of
        tests/test_memory.py grew from 0.41x to 0.47x of tf.gradients' with them."""
        return not self.under_xla

    @property
    def may_read_last_segment(self):
        """Whether the last segment may read its tensors as the forward pass made them:
        not under XLA, for the reason checkpoints may not be read there (the same small
        CNN's buffers: 0.47x of tf.gradients' with the last segment read, 0.41x without)."""
        return self.may_read_checkpoints

    @property
    def may_recompute_ahead(self):
        """Whether segments may recompute ahead (MemoryModel.predict's recompute_ahead):
        not under XLA, which orders the copies by the data they read and schedules
        them itself."""
        return not self.under_xla


def _folds_constants():
    """Whether Grappler's constant folding is on (tf.config.optimizer's options)."""
    options = tf.config.optimizer.get_experimental_options()
    return (not options.get("disable_meta_optimizer", False)
            and options.get("constant_folding", True))


def gpu_placed():
    """Whether TensorFlow places ops on a GPU in this process (its logical devices: GPUs
    hidden with tf.config.set_visible_devices count as none). Not part of `read`:
    listing logical devices starts TensorFlow's runtime, so it is asked only where a
    call may offload (planner.Problem.offload_accelerator)."""
    return bool(tf.config.list_logical_devices("GPU"))


def _eigen_conv_threads(kernels):
    if kernels != EIGEN:
        return 0
    return tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count() or 1


# The most gradient steps the memory model runs side by side on a CPU. The executor
# starts as many ready ops as it has inter-op threads (one per core by default), but
# only two were ever measured (2-core machines: a ResNet block's two branches, two
# deferred filter gradients); more would make 'memory' decline rewrites on a guess.
MAX_SIDE_BY_SIDE = 2


def _inter_op_threads(kernels, under_xla):
    """How many ops the executor runs side by side: 1 on a GPU (a stream runs its
    kernels in order) and under XLA (which schedules its own), else the inter-op
    threads TensorFlow uses (tf.config.threading, TF_NUM_INTEROP_THREADS, or one per
    core this process may use), at most MAX_SIDE_BY_SIDE."""
    if kernels is None or under_xla:
        return 1
    configured = inter_op_threads_set()
    if not configured:
        configured = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1)
    return max(1, min(configured, MAX_SIDE_BY_SIDE))


def inter_op_threads_set():
    """The executor's inter-op threads where this process sets them (tf.config.threading,
    else TF_NUM_INTEROP_THREADS), else 0: TensorFlow's default, one per core."""
    configured = tf.config.threading.get_inter_op_parallelism_threads()
    if configured:
        return configured
    setting = os.environ.get("TF_NUM_INTEROP_THREADS", "").strip()
    return int(setting) if setting.isdigit() else 0


# The allocator a device whose memory is capped holds it with: one region, as a GPU's
# (memsave.capacity plans for such a device on a CPU too).
ONE_REGION = "BFC (one region)"
# The CPU's BFC allocator as TF_CPU_ALLOCATOR_USE_BFC runs it: regions grown on demand.
CPU_GROWING = "BFC (CPU, growing)"
_assumed_allocator = ScopedValues()


def assuming_allocator(name):
    """A context manager: calls read inside it plan for allocator `name` (e.g.
    ONE_REGION) instead of this process's."""
    return _assumed_allocator.active(name)


def _allocator(accelerator):
    assumed = _assumed_allocator.current()
    if assumed is not None:
        return assumed
    if accelerator:
        growing = os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "").lower() == "true"
        return "BFC (GPU, growing)" if growing else "BFC (GPU)"
    if cpu_uses_bfc():
        return CPU_GROWING
    return None


def cpu_uses_bfc():
    """Whether TensorFlow's CPU allocator is BFC (TF_CPU_ALLOCATOR_USE_BFC)."""
    return os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("true", "1")
