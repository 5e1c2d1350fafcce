"""The cost model: what running an op again costs on a machine.

Every cost of the planner is in one unit, FLOPs of the machine's matmuls and
convolutions: a matmul or a convolution costs its FLOPs (opinfo.flops); any
other op costs its output elements (a reduction: the elements it reads; a Reshape or
an identity, whose output is its input's buffer: none) times a per-element price,
because on real hardware elementwise ops, reductions and normalisations are bound
by memory traffic, not arithmetic (on the CPU measured, a ReLU or an add over an element
of a large tensor takes as long as ~35 FLOPs of a convolution, a training-mode
batch norm ~80); each op run and each recomputed segment costs a fixed overhead
on top.

`memsave.calibrate()` (memsave/calibration.py) measures those prices on the machine
it runs on (a few seconds); `use(costs)` makes a Costs the one the planner uses, for
the block it wraps. DEFAULT_COSTS were measured on this project's CI-class machine
(AMD EPYC, 2 cores, TensorFlow 2.21, oneDNN on) with it.
"""

import contextlib
import dataclasses
import threading


from memsave.errors import MemsaveError, MemsaveTypeError
from memsave.planner import opinfo


# A backward pass runs about twice the FLOPs of its forward pass (the gradients
# with respect to an op's inputs and to its weights).
BACKWARD_TO_FORWARD = 2
# So a training step is about this many forward passes.
STEP_IN_FORWARD_PASSES = 1 + BACKWARD_TO_FORWARD


def step_flops(forward_flops, loop_sums_flops=0):
    """What plain tf.gradients' step costs: STEP_IN_FORWARD_PASSES forward passes, and
    the running sums its gradient loops keep of the gradients of what their bodies read
    from outside (`loop_sums_flops`: a weight-sized add per weight per iteration,
    memsave.planner.loops.LoopMemory.sums_cost; on the LSTM benchmark, AMD EPYC with
    AVX-512, the step measured 3.38 forward passes)."""
    return STEP_IN_FORWARD_PASSES * forward_flops + loop_sums_flops


def step_time_ratio(added_flops, forward_flops, loop_sums_flops=0):
    """A plan's step time over plain tf.gradients', as the cost model predicts it: the
    step (`step_flops`) plus what the plan adds (its recomputation and transfers,
    `added_flops`), over the step. What the rewrite costs beyond its recomputation
    (benchmarks/time_breakdown.py) is not in it."""
    if not forward_flops:
        return 1.0
    return 1.0 + added_flops / step_flops(forward_flops, loop_sums_flops)


@dataclasses.dataclass(frozen=True)
class Costs:
    """What running ops costs on one machine, in FLOPs of its matmuls/convolutions.

    Attributes:
      per_element: per output element of an op that is neither a matmul, a
        convolution nor a normalisation (elementwise ops, casts, ...), per element
        read of a reduction; an op that moves no data (a Reshape) costs none.
      per_normalised_element: per output element of a normalisation
        (opinfo.NORMALISATION_OP_TYPES).
      op_overhead: per op run (the executor's dispatch, an allocation, a launch).
      segment_overhead: per recomputed segment (its boundaries, ordering, and the
        gradient bookkeeping of one more backward call).
      source: where the figures come from (a machine, or 'uncalibrated': one
        FLOP per element, ~10 us per op at the ~10 GFLOP/s of a CPU core on small
        kernels, a segment as five ops).
    """
    per_element: float = 1.0
    per_normalised_element: float = 1.0
    op_overhead: float = 100_000
    segment_overhead: float = 500_000
    source: str = "uncalibrated"

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type is float and not (isinstance(value, (int, float))
                                            and 0 <= value < float("inf")):
                raise MemsaveError(f"Costs.{field.name} is {value!r}; pass a number >= 0 "
                                   "(FLOPs of the machine's matmuls and convolutions)")

    def of(self, op, unknown_dim_size=1):
        """What running `op` once costs (without the per-op overhead), its unknown
        dimensions as `unknown_dim_size` (the batch the step is planned for)."""
        if op.type in opinfo.HEAVY_OP_TYPES:
            return opinfo.flops(op, unknown_dim_size)
        elements = opinfo.priced_elements(op, unknown_dim_size)
        if op.type in opinfo.NORMALISATION_OP_TYPES:
            return int(elements * self.per_normalised_element)
        return int(elements * self.per_element)


def transfer_flops(out_bytes, back_bytes, copies, forward_flops, flops_per_byte, op_overhead):
    """What host offload costs a step, in FLOPs of the device.

    Transfers run beside the computation (a GPU's copy engines, one per direction),
    so only the part of a transfer that outlasts the computation it overlaps slows
    the step: the copies out overlap the forward pass, the copies back the backward
    pass. Each copy also costs an op's overhead.

    Args:
      out_bytes, back_bytes: bytes moved to the host and back per step.
      copies: how many copy ops move them.
      forward_flops: the forward pass's cost (its backward's is BACKWARD_TO_FORWARD x).
      flops_per_byte: the device's FLOP rate over the host link's bandwidth.
      op_overhead: what one copy op costs besides its transfer.
    """
    out = max(out_bytes * flops_per_byte - forward_flops, 0)
    back = max(back_bytes * flops_per_byte - BACKWARD_TO_FORWARD * forward_flops, 0)
    return int(out + back + copies * op_overhead)


# Offload (memsave.offload) defaults, which the planner weighs: checkpoints smaller than
# DEFAULT_MIN_BYTES stay on the device; a copy back starts DEFAULT_PREFETCH segments
# ahead of its reader. A device's FLOP rate over its host link's bandwidth: what moving
# one byte costs in FLOPs the device could have run instead. An H100 (~60 TFLOP/s
# float32) over PCIe 5 (~50 GB/s) is about 1200; an A100 (19.5 TFLOP/s) over PCIe 4
# (~25 GB/s) about 800.
DEFAULT_MIN_BYTES = 1 << 20
DEFAULT_PREFETCH = 1
DEFAULT_FLOPS_PER_BYTE = 1000.0


# Measured with calibrate() on an AMD EPYC (2 cores, TensorFlow 2.21, oneDNN on):
# three runs gave per_element 27.5-40.9, per_normalised_element 76.8-86.7,
# op_overhead 11k-17k, segment_overhead 436k-836k; these are their middles.
DEFAULT_COSTS = Costs(per_element=35.0, per_normalised_element=80.0, op_overhead=15_000,
                      segment_overhead=600_000,
                      source="calibrate() on an AMD EPYC, 2 cores, TensorFlow 2.21")

_state = threading.local()


def active():
    """The Costs the planner uses now (DEFAULT_COSTS unless `use` says otherwise)."""
    return getattr(_state, "costs", DEFAULT_COSTS)


@contextlib.contextmanager
def use(costs):
    """Makes `costs` the planner's cost model inside the block (restored on exit).

        with memsave.planner.costs.use(memsave.calibrate()):
            grads = memsave.gradients(loss, params, checkpoints=memsave.budget(0.5))

    Raises:
      MemsaveTypeError: when `costs` is not a Costs.
    """
    if not isinstance(costs, Costs):
        raise MemsaveTypeError(f"use() takes a memsave.planner.Costs, got "
                               f"{type(costs).__name__}; build one with Costs(...) or calibrate()")
    previous = active()
    _state.costs = costs
    try:
        yield costs
    finally:
        _state.costs = previous
