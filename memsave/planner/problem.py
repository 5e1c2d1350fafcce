"""What one call plans for: its forward region, the environment, and the settings the
memory model is built with. Strategies are called with a Problem."""

from memsave.environment import gpu_placed
from memsave.planner import allocator
from memsave.planner.graph import StepGraph
from memsave.planner.memory import MemoryModel


def memory_model(region, environment, unknown_dim_size=1, defer=True, beside=None):
    """The MemoryModel of `region`'s step in `environment`, with `beside` (a
    memsave.beside.Beside or None) held beside its gradients."""
    graph = StepGraph.build(region, environment, unknown_dim_size, defer)
    return MemoryModel(graph, allocator=allocator.named(environment.allocator), beside=beside)


class Problem:
    """The forward region of one gradients call and what a plan for it depends on.

    A strategy is called with it. It answers the region's own attributes
    (`problem.ops`, `problem.tensors()`, `problem.is_x(t)`, `len(problem)`, ...), so
    a strategy written for a memsave.region.ForwardRegion works unchanged.

    Attributes:
      region: the memsave.region.ForwardRegion.
      environment: the memsave.environment.Environment.
      unknown_dim_size: the size the memory model assumes for unknown dimensions.
      unknown_dim_source: where that size came from, for the report: "given" (an
        unknown_dim_size= argument), "measured" (a memory calibration), the source of
        an active memsave.batch_size (e.g. "fit's batch_size=8"), or None (1, assumed).
      offload: the call's memsave.Offload where it can offload (memsave.offload.usable:
        not under XLA), else None.
      beside: what the training step holds beside the gradients (memsave.beside.Beside:
        an optimizer's state under Keras `fit`), or None.
      model: the MemoryModel of the step, built on first use.
    """

    def __init__(self, region, environment, unknown_dim_size=1, offload=None,
                 unknown_dim_source=None, beside=None):
        self.region = region
        self.beside = beside
        self.environment = environment
        self.unknown_dim_size = unknown_dim_size
        self.unknown_dim_source = unknown_dim_source
        self.offload = offload
        self._model = None
        self._offload_accelerator = None

    @property
    def model(self):
        if self._model is None:
            self._model = memory_model(self.region, self.environment, self.unknown_dim_size,
                                       defer=not self.environment.gate_gradients,
                                       beside=self.beside)
        return self._model

    @property
    def offload_accelerator(self):
        """Whether checkpoints TensorFlow places itself sit on a GPU (environment.gpu_placed),
        asked once per call and only where it may offload."""
        if self._offload_accelerator is None:
            self._offload_accelerator = gpu_placed()
        return self._offload_accelerator

    def __getattr__(self, name):
        if name.startswith("__") or name == "region":
            raise AttributeError(name)
        return getattr(self.region, name)

    def __len__(self):
        return len(self.region)

    def __contains__(self, op):
        return op in self.region
