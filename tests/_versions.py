"""TensorFlow version facts the tests depend on, measured, with the reason."""

import pytest
import tensorflow as tf


def _tf_version():
    return tuple(int(part) for part in tf.__version__.split(".")[:2])


# memsave's XLA savings are measured with TensorFlow 2.21's XLA:CPU. TensorFlow 2.16's
# XLA:CPU schedules both steps with far more memory (the 48-layer MLP: tf.gradients 396 MiB
# of XLA buffers against 228 MiB on 2.21, memsave 200 MiB against 84 MiB), so the same
# step saves less there (0.51x of XLA's own bytes, 0.73x of the allocator peak), and a
# Keras fit step under XLA peaks above plain Keras. Versions 2.17-2.20 were not measured.
XLA_SAVINGS_MEASURED = pytest.mark.skipif(
    _tf_version() < (2, 21),
    reason=f"XLA savings are measured on TensorFlow >= 2.21 (this is {tf.__version__}; see "
           "tests/_versions.py)")
