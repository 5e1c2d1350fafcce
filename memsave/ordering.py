"""What waits for what in a built rewrite: the control edges the builder adds, and
the walks that find where they go (the ops made after a point, a gradient's own cone).

An op's inputs exist before it is made, so every data edge runs from an earlier-made
op to a later-made one; the edges added here follow that order, but those that make
a deferred weight gradient wait for a later segment, TensorFlow's own CPU
convolution gradients, ordered pairwise, and the ops of one gradient function that
read nothing of each other, chained last made first (`_first_input_last`). Before a
rewrite returns, `check_acyclic` makes sure its new ops close no cycle.
"""

import tensorflow as tf

from memsave.errors import DEBUG_HINT, MemsaveError
from memsave.graph import _tf_private, calls
from memsave.graph.reroute import reroute_ts
from memsave.graph.select import get_ops_on_cycles, tensor_key
from memsave.region import SHAPE_READER_OP_TYPES, estimated_bytes


def serialize_conv_gradients(copied_ops, deferred=frozenset()):
    """Makes the Conv2DBackpropInput of each copied Conv2D wait for its
    Conv2DBackpropFilter, unless that one is deferred (it runs after the last
    segment). The two read the convolution's input and filter and the
    same incoming gradient, so they are found among those tensors' consumers."""
    for op in copied_ops:
        if op.type != "Conv2D":
            continue
        filter_grads = {tensor_key(c.inputs[2]): c for c in op.inputs[0].consumers()
                        if c.type == "Conv2DBackpropFilter" and c not in deferred}
        for consumer in op.inputs[1].consumers():
            if consumer.type == "Conv2DBackpropInput":
                partner = filter_grads.get(tensor_key(consumer.inputs[2]))
                if partner is not None:
                    _tf_private.add_control_inputs(consumer, [partner])


def large_ops_needed_by(grads, made_before, excluded, min_bytes, unknown_dim_size=1):
    """The ops made after the op numbered `made_before` (a segment's tf.gradients call)
    that its gradients `grads` need, but those in `excluded` (deferred weight gradients)
    and in v1 control-flow frames, that hold at least `min_bytes` (`_holds_large_tensors`,
    unknown dimensions sized as `unknown_dim_size`, as the plan sized them: counted as
    1, a step traced with a batch of None had no op large and no order), in the order
    they were made but within one gradient function (`_first_input_last`).
    (Ops nothing needs are left out: a control input from one would make TensorFlow
    run it.)"""
    seeds = [t.op for g in grads if g is not None
             for t in ((g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,))]
    needed = _walk_needed(seeds, made_before, stop_ops=excluded)
    large = [op for op in needed if _tf_private.control_flow_context(op) is None
             and _holds_large_tensors(op, min_bytes, unknown_dim_size)]
    return _first_input_last(sorted(large, key=_tf_private.creation_index), made_before)


def _first_input_last(ops, made_before):
    """`ops` (in the order they were made) with each run of ops made by one gradient
    function (one name scope, `MatMul_grad/`) that do not read one another reversed:
    the gradient of an op's first input, which the rest of the backward pass reads on
    from, then comes after its weight's (a MatMul's kernel gradient, a convolution's
    filter gradient), as the memory model runs them: one step, the op's inputs freed
    before its input gradient's readers run. Measured (AMD EPYC with AVX-512): a Keras
    GPT's 'memory' plan ran the next segment's copies beside the vocabulary head's
    kernel gradient, which holds the 16 MiB logits gradient, in a quarter of steps
    (30.5-32.0 MiB against 24.0). The reversed ops read nothing of each other, so the
    chain closes no cycle."""
    result, run, run_scope = [], [], None
    for op in ops + [None]:
        scope = None if op is None else _gradient_function(op)
        if run and scope is not None and scope == run_scope and not _reads_any(
                op, run, made_before):
            run.append(op)
            continue
        result.extend(reversed(run))
        run, run_scope = ([op], scope) if op is not None else ([], None)
    return result


def _gradient_function(op):
    """The name scope tf.gradients made `op` in for one op's gradient ('.../MatMul_3_grad'),
    or None (an AddN summing contributions, say)."""
    scope = op.name.rpartition("/")[0]
    return scope if scope.endswith("_grad") else None


def _reads_any(op, run, made_before):
    """Whether `op` needs one of `run` (ops made before it). Only ops made after the
    op numbered `made_before` and from the first of `run` on are walked: an op made
    earlier cannot read one of them."""
    members = set(run)
    floor = max(made_before, min(_tf_private.creation_index(m) for m in run) - 1)
    seeds = [t.op for t in op.inputs] + list(op.control_inputs)
    return any(needed in members for needed in _walk_needed(seeds, floor))


def _walk_needed(seed_ops, made_before, stop_ops=frozenset()):
    """Yields `seed_ops` and the ops they need, through inputs and control inputs, each
    once, that were made after the op numbered `made_before` and are not in `stop_ops`
    (whose own inputs are not walked)."""
    seen, stack = set(), list(seed_ops)
    while stack:
        op = stack.pop()
        if op in seen or op in stop_ops or _tf_private.creation_index(op) <= made_before:
            continue
        seen.add(op)
        yield op
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)


def _holds_large_tensors(op, min_bytes, unknown_dim_size=1):
    """Whether `op`'s outputs hold at least `min_bytes`, or it reads a tensor that
    large (its run decides when that is freed: a filter gradient, a small output, holds
    the convolution's input until it runs). Not an op that reads only shapes: Grappler
    folds it into a constant, which a control input would tie into a cycle (measured:
    a Conv2D gradient's ShapeN in a bfloat16 CNN)."""
    def size(t):
        return estimated_bytes(t, unknown_dim_size)

    if sum(size(t) for t in op.outputs) >= min_bytes:
        return True
    return op.type not in SHAPE_READER_OP_TYPES and any(size(t) >= min_bytes for t in op.inputs)


def made_from_only(op, tensors, made_before):
    """Whether `op` computes from `tensors` (a TensorSet) alone: each input is one of
    them, a constant, a shape read, or made after the op numbered `made_before` by an
    op that computes so. A segment's gradient op computed from the gradients it returns
    (a bias's BiasAddGrad, and a Keras bias's reshape of it) holds nothing the next
    segment does not, and the next segment's copies do not wait for it: oneDNN's graph
    pass merges a BiasAddGrad with the Conv2DBackpropFilter reading the same gradient,
    in the next segment, and the wait closed a cycle ("104 nodes in a cycle", a Keras 2
    conv-BN CNN's 'speed' plan; "7 nodes", a Keras ViT's patch convolution under a
    budget; AMD EPYC with AVX-512)."""
    known = {}

    def computed_so(node):
        if node not in known:
            known[node] = False  # (until shown: a cycle of the walk is not)
            known[node] = node.type == "Const" if not node.inputs else all(
                t in tensors or t.op.type in SHAPE_READER_OP_TYPES or t.op.type == "Const"
                or (_tf_private.creation_index(t.op) > made_before and computed_so(t.op))
                for t in node.inputs)
        return known[node]
    return computed_so(op)


def one_after_another(ops):
    """Each of `ops` (as large_ops_needed_by orders them) waits for the one before it,
    through control inputs. An op's inputs exist before it is made, so every edge runs
    from an earlier-made op to a later-made one but the control inputs memsave adds
    pointing back (deferred weight gradients, which are left out; TensorFlow's own CPU
    convolution gradients, where no order is made) and the chain's own within one
    gradient function, between ops that need nothing of each other: the chain closes
    no cycle. (Where `later` reads an output of `earlier` already, none is added:
    _tf_private.)"""
    for earlier, later in zip(ops, ops[1:]):
        _tf_private.add_control_inputs(later, [earlier])


def readers_made_after(t, made_before):
    """The ops reading `t` that were made after the op numbered `made_before`."""
    return [r for r in t.consumers() if _tf_private.creation_index(r) > made_before]


def reroute_readers(old, new, made_before):
    """Ops made after `made_before` that read `old` read `new` instead."""
    reroute_ts([new], [old], can_modify=readers_made_after(old, made_before))


def copies_that_run(copied_ops, made_before):
    """The copies a step runs: those whose outputs a gradient op (made after
    `made_before`) or another copy that runs reads; TensorFlow prunes the others."""
    members = set(copied_ops)
    running = set()
    for op in reversed(copied_ops):  # copies are made producers first
        if any((c in running) if c in members else _tf_private.creation_index(c) > made_before
               for t in op.outputs for c in t.consumers()):
            running.add(op)
    return [op for op in copied_ops if op in running]


# Ops Grappler's arithmetic optimizer moves ahead of the value-preserving ops they read
# (ReorderCastLikeAndValuePreserving: Cast(Identity(w)) to bfloat16 becomes
# Identity(Cast(w))): the moved op keeps its own control inputs only.
_MOVED_AHEAD_BY_GRAPPLER = frozenset({"Cast"})


def wait_for(cone, trigger_ops):
    """The ops of `cone` that read nothing made within it wait for `trigger_ops`
    (through `done_ops`), and so do its Casts: Grappler moves a narrowing Cast ahead of
    the identity it reads (a segment's local input), where, without control inputs of
    its own, it would run as soon as its input exists. Measured (AMD EPYC, Keras
    ResNet50 96 px under mixed_bfloat16, a budget's plan of 217 segments): every
    segment's bfloat16 copies of its float32 kernels were made in the forward pass,
    64 MiB of them alive at the step's peak."""
    trigger_ops = done_ops(trigger_ops)
    for op in cone:
        if op.type in _MOVED_AHEAD_BY_GRAPPLER or not any(t.op in cone for t in op.inputs):
            _tf_private.add_control_inputs(op, trigger_ops)


def done_ops(ops):
    """Ops that run once `ops` have made their outputs: each op itself, but a tf.function
    call, for which identities of its outputs. TensorFlow inlines a call before the step
    runs, and a control edge from it then waits for its control outputs only (its
    stateful ops), not for its outputs: a copy waiting for a gradient a nested function
    makes (its backward function's call) would run in the forward pass. Measured (AMD
    EPYC, 24 nested calls, 5 segments): every segment's copies ran in the forward pass,
    110 MiB, as much as tf.gradients', before this."""
    result = []
    for op in ops:
        if not calls.is_call(op) or not op.outputs:
            result.append(op)
            continue
        with op.graph.as_default(), op.graph.name_scope(None), op.graph.colocate_with(op):
            result.extend(tf.identity(t, name=f"{op.name}_done").op for t in op.outputs)
    return result


def exclusive_cone(gradient, made_before, returned):
    """The op making `gradient` and the ops made after index `made_before` that only it
    needs: those whose every output, and every control output, is read only within
    the set, and that make none of the tensors in `returned` (a TensorSet of
    gradients that later segments will read).

    Returns the set, or an empty one where the op makes another of `returned`, is read
    by something else through a control input, or lives in a v1 control-flow frame (a
    control input from outside the frame would be invalid)."""
    op = gradient.op
    if (any(t in returned for t in op.outputs if t.value_index != gradient.value_index)
            or _tf_private.control_outputs(op)
            or _tf_private.control_flow_context(op) is not None):
        return set()
    cone, stack = {op}, [op]
    while stack:
        for t in stack.pop().inputs:
            p = t.op
            if (p in cone or _tf_private.creation_index(p) <= made_before
                    or _tf_private.control_flow_context(p) is not None
                    or any(out in returned for out in p.outputs)):
                continue
            if (all(c in cone for out in p.outputs for c in out.consumers())
                    and all(c in cone for c in _tf_private.control_outputs(p))):
                cone.add(p)
                stack.append(p)
    return cone


def check_acyclic(new_ops):
    """Raises where the rewrite's ops (`new_ops`) close a cycle, which TensorFlow would
    only refuse when the step runs; their control inputs are removed first, so what
    is left in the graph is never run and never fails.

    Raises:
      MemsaveError: naming ops on the cycle.
    """
    on_cycles = get_ops_on_cycles(new_ops)
    if not on_cycles:
        return
    for op in new_ops:
        _tf_private.remove_control_inputs(op)
    names = ", ".join(op.name for op in on_cycles[:6]) + (" ..." if len(on_cycles) > 6 else "")
    raise MemsaveError(
        f"the rewrite would close a cycle of {len(on_cycles)} ops ({names}), so no gradients "
        "were returned; this is a bug in memsave, please report it with the model. Meanwhile, "
        f"another strategy (e.g. checkpoints='memory' or a list) or tf.gradients avoids it "
        f"{DEBUG_HINT}")
