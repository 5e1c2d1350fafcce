"""What a training step holds beside its gradients: an optimizer's state and update.

`memsave.gradients` sees the forward pass and the gradients; a training step holds more.
An optimizer's slots (Adam's two per weight) are alive through the whole step, and its
update, which runs once every gradient is made, adds temporaries while the gradients
are still alive. A prediction that leaves them out is short by twice the weights under
Adam, and a budget meant for the device would plan for memory the step does not have.

    with memsave.beside.holding(lambda: Beside(slot_sizes, "Adam's state", 2, True)):
        step(x)                       # traced here: planned with them

memsave.keras (a MemsaveModel's `fit`, `memsave.keras.enable`d models, plain `fit`
under `memsave.patch`) sets it from the model's optimizer; the report names it.
"""

import dataclasses
from typing import Tuple

from memsave.scoped import ScopedValues

_active = ScopedValues()


@dataclasses.dataclass(frozen=True)
class Beside:
    """What a step holds beside what its gradients call builds.

    Attributes:
      resident_sizes: the bytes of each buffer alive through the whole step (an
        optimizer's variables: its slots, its iteration count), one per variable: a
        device's allocator places each apart.
      source: what they are, for the report (e.g. "Adam's state").
      update_temporaries: what updating one weight makes, in its gradient's bytes
        (Adam computes new moments and the step before assigning them: about 2).
      updates_each_gradient: each weight is updated as soon as its gradient is made
        (TensorFlow runs an op once its inputs are ready, and Keras' update of one
        weight waits for nothing else), so a weight's gradient is freed then;
        otherwise every gradient is alive until the update after the last (a loss
        scale checking all gradients, a global norm clipping them).
    """
    resident_sizes: Tuple[int, ...]
    source: str
    update_temporaries: float = 0.0
    updates_each_gradient: bool = False

    def __post_init__(self):
        if any(nbytes < 0 for nbytes in self.resident_sizes) or self.update_temporaries < 0:
            raise ValueError(f"memsave: negative bytes held beside the step: {self}")

    @property
    def resident_bytes(self):
        """Bytes alive through the whole step."""
        return sum(self.resident_sizes)


def holding(describe):
    """Plans the gradients calls traced inside with `describe()` held beside them.

    Args:
      describe: a callable returning a Beside (or None: nothing), asked when a call
        plans (an optimizer builds its slots after `fit` starts, before it traces).
    Returns:
      A context manager; nests, the innermost wins.
    """
    return _active.active(describe)


def current():
    """The Beside of the innermost active `holding` (see ScopedValues.current), or None."""
    describe = _active.current()
    return None if describe is None else describe()
