"""The planner: a memory model and a cost model of the training step, and the
searches that choose checkpoints with them.

- graph.py:    the step compiled to integer lists (StepGraph);
- opinfo.py:   per op type, what its gradient reads and what it costs;
- segments.py: which segment recomputes which op (shared by the rewrite);
- memory.py:   the simulated peak of the plain and the rewritten step.
"""

from memsave.planner.graph import StepGraph
from memsave.planner.memory import MemoryModel, Prediction
from memsave.planner.segments import Segmentation


def model_of(region):
    """The MemoryModel of a ForwardRegion, built once per region."""
    model = region.cache.get("memory_model")
    if model is None:
        model = MemoryModel(StepGraph.build(region))
        region.cache["memory_model"] = model
    return model


__all__ = ["StepGraph", "MemoryModel", "Prediction", "Segmentation", "model_of"]
