"""The batch a step will run with, where its graph leaves it unknown.

A training step is often traced before its batch is known: Keras traces `fit`'s train
function with inputs of shape [None, ...], and a `tf.function` with an input signature
of [None, ...] does the same. The memory model must still size every activation, and
sized at 1 they make weights look dominant: a plan for a batch of 1 keeps other
tensors, and predicts a fraction of the peak, than a plan for the batch that runs.

    with memsave.batch_size(64):
        loss = train_step(x, y)        # traced here: unknown dimensions count as 64

memsave.keras (a MemsaveModel's `fit`, `memsave.keras.enable`d models, plain `fit`
under `memsave.patch`) sets it from what `fit` is given (`fit_batch_size`). An explicit
`unknown_dim_size=` (memsave.plan, memsave.budget) wins; the report names where the
size came from.
"""

import contextlib

from memsave.errors import MemsaveError
from memsave.scoped import ScopedValues

_active = ScopedValues()


def check_batch_size(value, what="batch_size"):
    """`value` if it is a positive int, else a MemsaveError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MemsaveError(f"{what} is {value!r}; pass a positive int, the number of "
                           "examples one step runs with")
    return value


@contextlib.contextmanager
def batch_size(size, source=None):
    """Plans the gradients calls traced inside for steps of `size` examples.

    The memory model counts each unknown dimension of the step's tensors (a batch of
    None) as `size`. Nests: the innermost wins; restored on exit.

    Args:
      size: the batch, a positive int.
      source: where it came from, for the report (default "memsave.batch_size(size)").
    Raises:
      MemsaveError: if `size` is not a positive int.
    """
    check_batch_size(size)
    with _active.active((size, source or f"memsave.batch_size({size})")):
        yield size


def current():
    """(size, source) of this thread's innermost active `batch_size`; where this thread
    has none, the latest active in any thread (a replica's trace under tf.distribute);
    None where none is active."""
    return _active.current()
