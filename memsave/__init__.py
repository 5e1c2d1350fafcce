"""memsave: memory-saving gradients for TensorFlow 2.x.

A drop-in replacement for `tf.gradients` that keeps only chosen checkpoint
tensors of the forward pass and recomputes the rest, segment by segment, during
the backward pass.
"""

from memsave._version_check import check_tensorflow_version as _check_tensorflow_version

_check_tensorflow_version()

from memsave.errors import MemsaveError  # noqa: E402
from memsave.rewrite import (  # noqa: E402
    gradients, gradients_collection, gradients_memory, gradients_speed)
from memsave.strategies import CHECKPOINT_COLLECTION, STRATEGIES, mark_checkpoint  # noqa: E402
from memsave.report import RewriteReport, last_report  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "gradients", "gradients_speed", "gradients_memory", "gradients_collection",
    "mark_checkpoint", "CHECKPOINT_COLLECTION", "STRATEGIES", "MemsaveError",
    "RewriteReport", "last_report",
]
