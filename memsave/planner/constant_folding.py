"""What Grappler's constant folding makes of the tensors a step computes from constants.

Before a step runs, Grappler folds each op whose inputs are all constants (Consts, and
the Shape of a tensor whose shape is static: its MaterializeShapes) into a Const, and
keeps one of identical ones (its common-subgraph elimination). A causal attention mask
built from static shapes in each of six attention layers (Keras' MultiHeadAttention:
LogicalAnd(ones_like, band), read by the SelectV2 and by its gradient) is so one
constant, made with the function's kernels and held for the function's life, not a
forward tensor per layer kept to the gradient. Measured on an AMD EPYC without
AVX-512, TensorFlow 2.21: the Keras-layer GPT's tf.function step (6 layers, 256
tokens) allocates nothing for its masks during the step, and what its allocator holds
between steps grows with one mask, 4 MiB at batch 8; in a tf.compat.v1 Session,
RunMetadata's partition graph holds the mask as one Const of 200 MiB at batch 400 (no
size limit). A shape that is not static (a batch of None) keeps the mask in the step.

So the memory model counts a folded tensor as resident, once per distinct value, where
an op that is not folded reads it or a gradient does, and not at all where only folded
ops read it (what Grappler prunes).
"""

import hashlib

from memsave.planner.op_kinds import FORWARD, RESIDENT

_CONSTANT_TYPES = frozenset({"Const", "HostConst"})
# Replaced by a Const where their input's shape is static (MaterializeShapes).
_SHAPE_TYPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})
_DATA_DTYPES_EXCLUDED = ("resource", "variant")


def fold(step):
    """Marks the ops of `step` (a StepGraph) that Grappler folds into constants as
    RESIDENT, and their outputs' bytes as described in the module's docstring, where an
    output is larger than the step's small tensors (`_large`); records every folded op,
    with the Consts, in `step.constants`."""
    constants = {op for op, t in enumerate(step.ops) if t.type in _CONSTANT_TYPES}
    folded = []
    for op in range(len(step.ops)):  # (topological order: producers first)
        if step.kind[op] == FORWARD and _folds(step, op, constants):
            constants.add(op)
            folded.append(op)
    step.constants = frozenset(constants)
    if not folded:
        return
    read_at_run_time = _read_at_run_time(step, set(folded))
    signatures, kept = {}, set()
    for op in _large(step, folded):
        step.kind[op] = RESIDENT
        for position, tid in enumerate(step.outputs[op]):
            step.alias_of[tid] = -1  # (a Const of its own, whatever the op forwarded)
            key = (_signature(step, op, signatures), position)
            if tid in read_at_run_time and key not in kept:
                kept.add(key)
            else:
                step.size[tid] = 0


def _large(step, folded):
    """The folded ops with an output larger than StepGraph.small_bytes (1/1024 of the
    region's largest tensor). Smaller ones (a shape's Pack, a band of a few KiB) are left
    as the graph shows them: what they hold is nothing to the step, and the allocator
    replay places chunks in the order the tensors come, so moving a few bytes of them
    moved a replayed peak by a whole 25-MiB buffer (a Keras U-Net's tf.gradients step:
    221.0 MiB predicted, 246.0 as before, 249.9 measured)."""
    return [op for op in folded
            if any(step.size[t] > step.small_bytes for t in step.outputs[op])]


def _folds(step, op, constants):
    """Whether Grappler folds op `op` of `step` into a Const, given the ops known to
    make constants. (What the graph's lists answer first: most ops read a tensor that is
    no constant, and reading an op's NodeDef costs more than the lists.)"""
    tf_op = step.ops[op]
    if tf_op.type in _SHAPE_TYPES:
        if not all(t.shape.is_fully_defined() for t in tf_op.inputs):
            return False
    elif not (tf_op.inputs and len(step.inputs[op]) == len(tf_op.inputs)
              and all(step.producer[t] in constants for t in step.inputs[op])):
        return False
    if not tf_op.outputs or any(t.dtype.name in _DATA_DTYPES_EXCLUDED for t in tf_op.outputs):
        return False
    try:
        if tf_op.op_def.is_stateful:
            return False
    except (AttributeError, ValueError):  # (no OpDef: a function's own op type)
        return False
    # (a call, a loop, a conditional: not folded as a whole)
    return not any(value.HasField("func") or value.list.func
                   for value in tf_op.node_def.attr.values())


def _read_at_run_time(step, folded):
    """Ids of the folded tensors that a Const must still hold when the step runs: read
    by an op that is not folded, or by a gradient."""
    read_by_gradients = {t for reads in step.grad_reads for t in reads}
    return {t for op in folded for t in step.outputs[op]
            if t in read_by_gradients or any(c not in folded for c in step.consumers[t])}


def _signature(step, op, signatures):
    """A key equal for ops Grappler finds identical: type, attributes and inputs (a
    Const's value, a static shape's dimensions)."""
    if op in signatures:
        return signatures[op]
    tf_op = step.ops[op]
    if tf_op.type in _CONSTANT_TYPES:
        key = ("Const", hashlib.sha1(tf_op.get_attr("value").SerializeToString()).hexdigest())
    elif tf_op.type in _SHAPE_TYPES:
        key = (tf_op.type, tuple(tuple(t.shape.as_list()) for t in tf_op.inputs),
               tuple(t.dtype.name for t in tf_op.outputs))
    else:
        attrs = tuple(sorted((name, value.SerializeToString())
                             for name, value in tf_op.node_def.attr.items()
                             if not name.startswith("_")))
        inputs = tuple((_signature(step, step.producer[t], signatures),
                        step.outputs[step.producer[t]].index(t)) for t in step.inputs[op])
        key = (tf_op.type, attrs, inputs)
    signatures[op] = key
    return key
