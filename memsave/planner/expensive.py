"""Which tensors a budget keeps to recompute less, and in what order it tries them.

A budget fills the room its plan leaves with the outputs of expensive ops (matmuls,
convolutions: memsave.planner.opinfo.EXPENSIVE_OP_TYPES), best saving per byte first
(memsave.planner.search). Often such an output flows alone through cheap ops of its
own size before anything else reads it: a Dense layer's MatMul through its BiasAdd, a
query-key product through the attention's scale and mask, a projection through
dropout. Keeping the last of those holds the same bytes and saves recomputing the
cheap ops too (a MatMul's gradient reads its inputs, not its output). A chain ends at
the first tensor a gradient reads (a Softmax's output, a Relu's, the input of x * x):
kept further on, that tensor would be recomputed all the same, and with it the chain
up to it. keras-hub GPT-2, budget(0.5): 12% less recomputation predicted (Intel Xeon,
2026-11-29; benchmarks/JOURNAL.md).

The budget tries both orders, the outputs themselves and their chains' ends, and keeps
the cheaper plan: the ends are no better where their consumers' order of freeing
differs (the Keras-layer transformer's time budget found a higher peak with the ends
alone).
"""

from memsave.planner.op_kinds import REGION
from memsave.planner.opinfo import EXPENSIVE_OP_TYPES
from memsave.planner.segments import Segmentation


def rankings(graph, expensive):
    """The orders (lists of tensor ids, best saving per byte first) in which a budget
    tries keeping `expensive` (tensor ids of expensive ops' outputs): as they are, and,
    where any flows through cheap ops of its size, with each replaced by the last of
    those (`chain_end`). Duplicate orders are given once."""
    direct = {t: graph.cost[graph.producer[t]] for t in expensive}
    read = read_by_gradients(graph)
    ends = {}  # (two outputs reach one end only through small tensors: the larger saving)
    for t in expensive:
        end, cost = chain_end(graph, t, read)
        ends[end] = max(ends.get(end, 0), direct[t] + cost)
    orders = [ranked(graph, direct)]
    if ends != direct:
        orders.append(ranked(graph, ends))
    return orders


def outside_last_segment(graph, plan, expensive):
    """`expensive` but for the tensors of `plan`'s last segment (the one ending at the
    ys): where that segment is read from the forward pass, as memsave.plan_variants
    mostly decides for 'memory', it recomputes nothing, and a checkpoint kept in it only
    splits it (on a stack of 16 Dense layers, 87.8 MFLOP recomputed instead of 84.3)."""
    last = Segmentation(graph, plan).last_segment_tensors()
    return [t for t in expensive if t not in last]


def read_by_gradients(graph):
    """The tensor ids some op's gradient reads (StepGraph.grad_reads)."""
    return {t for reads in graph.grad_reads for t in reads}


def chain_end(graph, tensor, read=None):
    """(end, cost): the last tensor of the chain of cheap ops that `tensor` flows
    through alone, and what running those ops costs (`tensor` itself and 0 where it
    flows through none).

    Each op of the chain is the only reader of the tensor before it, which no gradient
    reads (`read`: read_by_gradients(graph), given where chain_end is called often); is
    recomputable (a region op: never a stateful or random one), is not itself expensive,
    and makes one output of the same size and dtype that is not a y; its other inputs
    are small, or are never recomputed (variables, constants, the step's inputs, kept
    ops' outputs): so keeping the end instead spares the whole chain, and the op that
    made `tensor`, without holding anything larger.
    """
    read = read_by_gradients(graph) if read is None else read
    cost = 0
    while len(graph.consumers[tensor]) == 1 and tensor not in read:
        op = graph.consumers[tensor][0]
        outputs = graph.outputs[op]
        if (graph.kind[op] != REGION or graph.ops[op].type in EXPENSIVE_OP_TYPES
                or len(outputs) != 1 or graph.size[outputs[0]] != graph.size[tensor]
                or graph.tensors[outputs[0]].dtype != graph.tensors[tensor].dtype
                or graph.is_y[outputs[0]] or _reads_more(graph, op, tensor)):
            break
        cost += graph.cost[op]
        tensor = outputs[0]
    return tensor, cost


def _reads_more(graph, op, tensor):
    """Whether `op` reads a large region tensor besides `tensor`."""
    return any(t != tensor and graph.kind[graph.producer[t]] == REGION and t not in graph.small
               for t in graph.inputs[op])


def ranked(graph, saved):
    """The tensor ids of `saved` (tensor id -> recomputation that keeping it saves) by
    saving per byte kept, best first; among equals the latest first: a tensor made late
    in the forward pass is freed early in the backward pass, so it is alive for the
    shortest time."""
    kept = [t for t in saved if graph.size[t] > 0]
    return sorted(kept, key=lambda t: (-saved[t] / graph.size[t], -graph.producer[t]))
