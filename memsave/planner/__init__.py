"""The planner: a memory model and a cost model of the training step, and the
searches that choose checkpoints with them.

- graph.py:    the step compiled to integer lists (StepGraph);
- opinfo.py:   per op type, what its gradient reads, and its FLOPs;
- costs.py:    what running an op again costs on this machine (calibrate());
- segments.py: which segment recomputes which op (shared by the rewrite);
- memory.py:   the simulated peak of the plain and the rewritten step;
- intervals.py: the most bytes alive at once among buffers over ranges of steps;
- allocator.py: that step replayed through TensorFlow's BFC allocator (what it holds);
- search.py:   the plans with the lowest predicted peak, or the least recomputation
               under a budget.
"""

from memsave.errors import MemsaveError
from memsave.graph import _tf_private
from memsave.planner import allocator
from memsave.planner.costs import Costs, calibrate
from memsave.planner.graph import StepGraph
from memsave.planner.memory import MemoryModel, Prediction
from memsave.planner.segments import Segmentation


UNKNOWN_DIM_SIZE = "unknown_dim_size"  # region.cache key: size assumed for unknown dims
NO_DEFERRAL = "no_deferred_gradients"  # region.cache key: the rewrite makes none last
READ_CHECKPOINTS = "read_checkpoints"  # region.cache key: whether the strategy's plan reads
                                      # its checkpoints (Segmentation), where it decided
RECOMPUTE_AHEAD = "recompute_ahead"  # region.cache key: whether the strategy's plan
                                    # recomputes ahead (MemoryModel.predict), where it decided
ORDER_BACKWARD = "order_backward"  # region.cache key: whether the rewrite makes each
                                  # segment's large gradient ops run one after another


def check_unknown_dim_size(value):
    """Returns `value` (None or a positive int: the size assumed for unknown dimensions).

    Raises:
      MemsaveError: for anything else.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise MemsaveError(f"unknown_dim_size is {value!r}; pass a positive int, e.g. the batch "
                           "size fed to a [None, ...] placeholder")
    return value


def may_read_checkpoints(region):
    """Whether a plan's segments may read their checkpoints as the forward pass made them
    (Segmentation): not under XLA, where the reads go through conditionals (as the
    copies' inputs do, see memsave.rewrite._xla_gate) and XLA's buffers for the small
    CNN of tests/test_memory.py grew from 0.41x to 0.47x of tf.gradients' with them."""
    return not _tf_private.in_xla_context(region.ys[0].graph)


def may_recompute_ahead(region):
    """Whether a plan's segments may recompute ahead (MemoryModel.predict's
    recompute_ahead): not under XLA, which orders the copies by the data they read
    (memsave.rewrite._xla_gate) and schedules them itself."""
    return not _tf_private.in_xla_context(region.ys[0].graph)


def model_of(region):
    """The MemoryModel of a ForwardRegion, built once per region.

    Unknown dimensions count as region.cache[UNKNOWN_DIM_SIZE] (default 1), which
    memsave.plan(..., unknown_dim_size=) and memsave.budget(..., unknown_dim_size=)
    set before the model is first built; region.cache[NO_DEFERRAL] (set by the
    rewrite for gate_gradients=True) keeps every weight gradient where its op's is.
    """
    model = region.cache.get("memory_model")
    if model is None:
        size = region.cache.get(UNKNOWN_DIM_SIZE) or 1
        graph = StepGraph.build(region, unknown_dim_size=size,
                                defer=not region.cache.get(NO_DEFERRAL))
        model = MemoryModel(graph, allocator=allocator.of_device())
        region.cache["memory_model"] = model
    return model


__all__ = ["StepGraph", "MemoryModel", "Prediction", "Segmentation", "model_of",
           "may_read_checkpoints", "may_recompute_ahead", "ORDER_BACKWARD",
           "check_unknown_dim_size", "Costs", "calibrate"]
