"""Checkpoint strategies: which forward tensors to keep.

One registry, `STRATEGIES`, maps the names users pass as `checkpoints=` to
strategies; `memsave.strategies.base` says what a strategy is and has the
factories (`keep_if`, `explicit`) and the combinator (`union`) to build more.
"""

from memsave.strategies.base import Choice, Selection, explicit, keep_if, selection_of, union
from memsave.strategies.collection import CHECKPOINT_COLLECTION, mark_checkpoint, marked_tensors
from memsave.strategies.memory import narrowest_cuts
from memsave.strategies.planned import budget, lowest_peak
from memsave.strategies.speed import EXPENSIVE_OP_TYPES, expensive_op_outputs

STRATEGIES = {
    "collection": marked_tensors(CHECKPOINT_COLLECTION),
    "memory": lowest_peak(),
    "speed": expensive_op_outputs(),
}

__all__ = [
    "STRATEGIES", "Choice", "Selection", "selection_of", "explicit", "keep_if", "union", "CHECKPOINT_COLLECTION",
    "mark_checkpoint", "marked_tensors", "narrowest_cuts", "lowest_peak", "budget", "EXPENSIVE_OP_TYPES",
    "expensive_op_outputs",
]
