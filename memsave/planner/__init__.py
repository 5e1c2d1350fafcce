"""The planner: a memory model and a cost model of the training step, and the
searches that choose checkpoints with them.

- graph.py:    the step compiled to integer lists (StepGraph; op_kinds.py, buffer_links.py
               and deferral.py record how ops take part, shared buffers, gradients
               made last);
- opinfo.py:   per op type, what its gradient reads, and its FLOPs (the facts are in
               op_facts.py);
- kernels/:    per platform (Eigen or oneDNN on a CPU, cuDNN on a GPU), the workspaces
               its kernels allocate that the graph does not show;
- costs.py:    what running an op again costs (memsave.calibrate() measures it);
- problem.py:  what one call plans for (Problem: region, environment, memory model);
- segments.py: which segment recomputes which op (shared by the rewrite);
- memory.py:   the simulated peak of the plain and the rewritten step (MemoryModel),
               simulated by timeline.py, forward_pass.py, schedule.py, simulate.py
               and simulate_plan.py;
- intervals.py: the most bytes alive at once among buffers over ranges of steps;
- allocator.py: that step replayed through TensorFlow's BFC allocator (what it holds);
- candidates.py: the cuts of the topological order plans are made of;
- search.py:   the plans with the lowest predicted peak, or the least recomputation
               under a budget;
- calibrated.py: a step's measured peak (memsave.calibrate_memory) and the scale
               from the model's predictions to it.
"""

from memsave.errors import MemsaveError
from memsave.environment import Environment
from memsave.planner.calibrated import MemoryCalibration
from memsave.planner.costs import Costs
from memsave.planner.graph import StepGraph
from memsave.planner.memory import MemoryModel, Prediction
from memsave.planner.problem import Problem, memory_model
from memsave.planner.segments import Segmentation



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


def model_of(region, environment=None, unknown_dim_size=1, defer=True):
    """A MemoryModel of a ForwardRegion's step (built anew: a Problem keeps the one of a
    call). `environment`: a memsave.environment.Environment, None for this process's."""
    if environment is None:
        environment = Environment.read(region.ys[0].graph)
    return memory_model(region, environment, unknown_dim_size, defer)


__all__ = ["StepGraph", "MemoryModel", "Prediction", "Segmentation", "Problem", "model_of",
           "check_unknown_dim_size", "Costs", "MemoryCalibration"]
