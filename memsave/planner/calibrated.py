"""A step's peak as measured (memsave.calibrate_memory), and the scale between it and
the memory model's prediction: what a budget given a calibration compares with its limit.

Three corrections, each of what one measured run of tf.gradients' step can tell:
- sizes: the dimensions the graph leaves unknown (a [None, ...] placeholder's batch,
  which the model otherwise counts as 1) take the size the measured buffers had;
- buffers no op made: what was alive at the peak without an op's name (an XLA program's
  preallocated temporary, which the model sees only where it knows the program's habit:
  memsave.planner.xla_buffers) is taken to run in every plan's step too, and is added to
  each prediction, as far as the model's prediction of tf.gradients' step falls short;
- scale: where the model predicts the rest of tf.gradients' step *below* the
  measurement, what it misses (kernels' buffers it does not know) is taken to be in
  every plan's step too, and the step's own bytes, above what is in use before it,
  scale by measured / predicted. Where it predicts above, the model's excess is its
  assumptions about how tf.gradients' schedule runs (how far an executor runs ahead),
  which memsave's plans do not share, and predictions are not scaled down.
Each errs on the side of a budget: a plan's predicted peak grows, never shrinks.
A plan is chosen by the model's bytes; the calibration moves the limit, and what the
report says.
"""

import collections
import dataclasses
from typing import Tuple

from memsave.errors import MemsaveError


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One buffer alive at the measured peak: the op that made it, the allocator's
    region kind ('output', 'temp', 'persist/dynamic', ...), its bytes, dtype and shape."""
    op: str
    region: str
    bytes: int
    dtype: str = ""
    shape: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryCalibration:
    """What one step measured with plain tf.gradients (memsave.calibrate_memory).

    Give it to a budget (`memsave.budget(0.5, calibration=c)`): the limit is then that
    fraction of `peak_bytes`, and each plan's predicted peak is scaled to it
    (`calibrated`). `at_peak` lists the buffers alive at the peak, largest first
    (empty where this TensorFlow could not read its profiler's memory records).

    Attributes:
      peak_bytes: the allocator's peak during the step, what was in use before it included.
      before_bytes: what was in use before the step (weights, inputs, optimizer slots).
      device: the device whose allocator was read ("CPU:0", "GPU:0").
      at_peak: Allocations alive at the peak.
      ops: names of the ops that allocated during the step (to tell whether a graph is
        the one measured), as far as the profiler's records go (it keeps 1000).
      shapes: (op name, the shape of the first buffer it allocated, as the profiler
        writes it: "[1024,512]") pairs, one per op of `ops`.
      profiled: whether the profiler's records were read (else only the peaks are known).
    """
    peak_bytes: int
    before_bytes: int
    device: str
    at_peak: Tuple[Allocation, ...] = ()
    ops: frozenset = frozenset()
    shapes: Tuple[Tuple[str, str], ...] = ()
    profiled: bool = True

    def __str__(self):
        unnamed = (f", {self.unattributed_bytes / 2**20:.1f} MiB at the peak made by no op"
                   if self.unattributed_bytes else "")
        return (f"tf.gradients' step measured at {self.peak_bytes / 2**20:.1f} MiB on "
                f"{self.device} ({self.before_bytes / 2**20:.1f} MiB in use before it"
                f"{unnamed})")

    @property
    def unattributed_bytes(self):
        """Bytes alive at the peak that no op of the graph made (XLA programs' temporaries)."""
        return sum(a.bytes for a in self.at_peak if not a.op)

    def calibrated(self, model_baseline_bytes, model_resident_bytes, dims_measured=False):
        """The Calibrated scale between the memory model of a step (its predicted peak of
        tf.gradients and the bytes it holds resident) and this measurement;
        `dims_measured`: whether the model took its unknown dimensions' size from it."""
        return Calibrated(self, model_baseline_bytes, model_resident_bytes, dims_measured)

    def check_measures(self, graph):
        """Raises MemsaveError unless this calibration measured a step of `graph` (a
        tf.Graph or FuncGraph): most of the forward ops that allocated during it must be
        ops of `graph`, or run inside one (the profiler names an op of a loop's body
        'loop/body/_1/add'). Skipped where the profile named no ops."""
        forward = sorted(name for name in self.ops if name and not _made_by_gradients(name))
        if not forward:
            return
        missing = [name for name in forward if not _names_an_op_of(graph, name)]
        if len(missing) * 2 > len(forward):
            raise MemsaveError(
                f"the memory calibration is of another step: {len(missing)} of the "
                f"{len(forward)} ops that allocated in it (e.g. {missing[0]!r}) are not ops of "
                "the graph being differentiated; call memsave.calibrate_memory with the step "
                "whose gradients this budget plans")


    def unknown_dim_size(self, graph):
        """The size the measured shapes give the dimensions `graph` leaves unknown (a
        [None, ...] placeholder's batch): the most common among the ops of `graph` that
        allocated a buffer of a shape their output's static shape matches; None where no
        such op has an unknown dimension."""
        counts = collections.Counter()
        for name, shape in self.shapes:
            dims = _parse_shape(shape)
            op = _op_or_none(graph, name)
            if dims is None or op is None:
                continue
            for t in op.outputs:
                static = t.shape.as_list() if t.shape.rank is not None else None
                if static is not None and len(static) == len(dims) and all(
                        s is None or s == d for s, d in zip(static, dims)):
                    counts.update(d for s, d in zip(static, dims) if s is None)
                    break
        return counts.most_common(1)[0][0] if counts else None


def _parse_shape(text):
    """[1024,512] -> [1024, 512]; None for anything else ("unknown")."""
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        return [int(d) for d in text[1:-1].split(",") if d.strip()]
    except ValueError:
        return None


class Calibrated:
    """The map from a memory model's bytes to a MemoryCalibration's (see the module's
    docstring).

    Attributes:
      dims_measured: whether the model's unknown dimensions took their measured size.
      extra: what was in use before the measured step beyond what the model holds
        resident (optimizer slots, another model's weights), added to every prediction.
      unattributed: the bytes alive at the measured peak that no op made, added too, as
        far as the model's prediction of tf.gradients' step falls short of the peak.
      scale: what the step's own bytes (above the model's resident ones) scale by:
        measured / predicted for plain tf.gradients, less the two above, where above 1.
    """

    def __init__(self, calibration, model_baseline_bytes, model_resident_bytes,
                 dims_measured=False):
        self.calibration = calibration
        self.dims_measured = dims_measured
        self.resident = model_resident_bytes
        self.extra = max(0, calibration.before_bytes - model_resident_bytes)
        # (Only as much as the model's prediction of tf.gradients' step falls short: it
        # may count some of those buffers already, memsave.planner.xla_buffers.)
        shortfall = calibration.peak_bytes - self.extra - model_baseline_bytes
        self.unattributed = min(calibration.unattributed_bytes, max(0, shortfall))
        measured_step = (calibration.peak_bytes - self.extra - self.unattributed
                         - model_resident_bytes)
        predicted_step = model_baseline_bytes - model_resident_bytes
        self.scale = max(1.0, measured_step / predicted_step) if predicted_step > 0 else 1.0

    def measured(self, model_bytes):
        """A predicted peak (the model's bytes) as the calibration measures."""
        return int(self._added() + self.resident + (model_bytes - self.resident) * self.scale)

    def model(self, measured_bytes):
        """A measured limit in the model's bytes (the inverse of `measured`)."""
        return int(self.resident + (measured_bytes - self._added() - self.resident) / self.scale)

    def _added(self):
        return self.extra + self.unattributed

    def describe(self):
        added = [f"{self.extra / 2**20:.1f} MiB in use before it not in the graph"] if (
            self.extra) else []
        if self.unattributed:
            added.append(f"{self.unattributed / 2**20:.1f} MiB no op made")
        scaled = (f"the model's predictions of the step scaled by {self.scale:.2f}"
                  if self.scale > 1 else "the model's predictions of the step as they are "
                  "(it predicts tf.gradients' step at or above the measurement)")
        added = f"; added to each prediction: {' and '.join(added)}" if added else ""
        return f"{self.calibration}{added}; {scaled}"


def _made_by_gradients(name):
    """Whether op `name` is one tf.gradients made (under a gradients name scope)."""
    return any(part == "gradients" or part.startswith("gradients_")
               for part in name.split("/")[:-1])


def _names_an_op_of(graph, name):
    """Whether profiler op name `name` is an op of `graph` or names one as its prefix."""
    parts = name.split("/")
    return any(_op_or_none(graph, "/".join(parts[:end])) is not None
               for end in range(len(parts), 0, -1))


def _op_or_none(graph, name):
    try:
        return graph.get_operation_by_name(name)
    except (KeyError, ValueError):
        return None
