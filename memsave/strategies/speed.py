"""'speed': keep the outputs of the expensive ops, recompute only cheap ones.

Ops are chosen by op type, never by name: memsave.planner.opinfo.EXPENSIVE_OP_TYPES
(re-exported here and as memsave.strategies.EXPENSIVE_OP_TYPES).
"""

from memsave.planner.opinfo import EXPENSIVE_OP_TYPES
from memsave.strategies.base import keep_if


def expensive_op_outputs(op_types=EXPENSIVE_OP_TYPES):
    """A strategy keeping the outputs of ops whose type is in `op_types`."""
    op_types = frozenset(op_types)
    return keep_if(lambda t, region: t.op.type in op_types and t.dtype.is_floating,
                   "output of an expensive {op_type} op")
