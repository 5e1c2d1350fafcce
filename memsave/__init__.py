"""memsave: memory-saving gradients for TensorFlow 2.x.

A drop-in replacement for `tf.gradients` that keeps only chosen checkpoint
tensors of the forward pass and recomputes the rest, segment by segment, during
the backward pass.
"""

from memsave._version_check import check_tensorflow_version as _check_tensorflow_version

_check_tensorflow_version()

from memsave.errors import MemsaveError  # noqa: E402
from memsave.errors import MemsaveWarning  # noqa: E402
from memsave.rewrite import (  # noqa: E402
    always_rewrite, gradients, gradients_collection, gradients_memory, gradients_speed, plan,
    recompute_loops)
from memsave.strategies import (  # noqa: E402
    CHECKPOINT_COLLECTION, STRATEGIES, budget, mark_checkpoint)
from memsave.report import RewriteReport, last_report  # noqa: E402
from memsave.offload import Offload  # noqa: E402
from memsave.integrations.optimizers import MemsaveOptimizer, gradient_function  # noqa: E402
from memsave.integrations.patch import patch  # noqa: E402
from memsave.calibration import calibrate, calibrate_memory  # noqa: E402
from memsave.tape import GradientTape  # noqa: E402
from memsave.batch import batch_size  # noqa: E402
from memsave.capacity import Capacity, max_batch_size  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "gradients", "gradients_speed", "gradients_memory", "gradients_collection",
    "mark_checkpoint", "CHECKPOINT_COLLECTION", "STRATEGIES", "MemsaveError",
    "RewriteReport", "last_report", "plan", "MemsaveWarning",
    "patch", "gradient_function", "MemsaveOptimizer", "budget", "always_rewrite", "Offload",
    "calibrate", "calibrate_memory", "GradientTape", "recompute_loops", "batch_size",
    "max_batch_size", "Capacity",
]


def __getattr__(name):
    # memsave.keras is imported on first use, so `import memsave` never imports Keras.
    if name == "keras":
        import importlib
        import sys
        module = importlib.import_module("memsave.integrations.keras")
        sys.modules.setdefault("memsave.keras", module)
        globals()["keras"] = module
        return module
    raise AttributeError(f"module 'memsave' has no attribute {name!r}")
