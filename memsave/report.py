"""What a rewrite kept, what it recomputes, and how big those are.

`memsave.gradients` records a RewriteReport for every call; `last_report()`
returns the latest, and `memsave.plan(...)` builds one without touching the
graph. The same facts go to the 'memsave' logger at INFO (summary) and DEBUG
(every checkpoint and segment).
"""

import contextlib
import dataclasses
import logging
import threading
from typing import List, Optional, Tuple

from memsave.planner import costs
from memsave.planner.loops import tensor_bytes

logger = logging.getLogger(__name__)
_latest = threading.local()


@dataclasses.dataclass
class CheckpointInfo:
    """One kept tensor (`offloaded`: waits in host memory, memsave.offload)."""
    name: str
    shape: str
    dtype: str
    bytes: int
    reason: str
    offloaded: bool = False

    @classmethod
    def of(cls, t, reason, unknown_dim_size=1):
        return cls(t.name, str(t.shape), t.dtype.name, tensor_bytes(t, unknown_dim_size),
                   reason)


@dataclasses.dataclass
class SegmentInfo:
    """One recomputed segment: the tensors it ends at, the ops it copies, and of those
    the ones that run (recomputed_ops; a copy whose outputs no gradient reads, e.g. of
    a ReLU whose gradient reads the kept checkpoint, is never run) and the bytes they
    make."""
    ends_at: List[str]
    copied_ops: int
    recomputed_bytes: int
    recomputed_ops: int = 0


@dataclasses.dataclass
class RewriteReport:
    """What memsave chose for one gradients call.

    Sizes are static estimates (unknown dimensions count as 1). Peaks are the
    memory model's (memsave.planner.memory): `predicted_peak_bytes` for this
    plan (tf.gradients' own where plain tf.gradients answers: `fallback` says why,
    `declined_peak_bytes` is the declined plan's), `baseline_peak_bytes` for plain
    tf.gradients on the same step, both including `resident_bytes` (inputs,
    constants, variables); where TensorFlow's
    allocator is BFC (GPUs; the CPU with TF_CPU_ALLOCATOR_USE_BFC=true) both are what
    it holds, chunks rounded up as it hands them out (memsave.planner.allocator),
    and `predicted_live_bytes` is the plan's peak of live tensors alone. `peak_at` says
    where in the step the predicted peak falls. `recompute_flops` is the estimated cost of
    the recomputed copies (loops' included), `forward_flops` that of one forward pass of
    the region, `loop_sums_flops` what its gradient loops' weight sums add to the step.
    `unknown_dims` tensors had unknown dimensions, counted as `unknown_dim_size`
    (see memsave.plan's and memsave.budget's `unknown_dim_size`, and memsave.batch_size),
    which came from `unknown_dim_source` ("given", "measured", the batch's source such
    as "fit's batch_size=8", or None: 1, assumed). `offloaded` names
    each checkpoint copy read back from host memory (one per reading segment), and
    `offload_moved_bytes` the bytes moved per step, out and back (memsave.offload);
    `predicted_host_bytes` what the offloaded checkpoints hold in host memory (the
    predicted peak is the device's, without them between their forward readers and
    their copies back), and `transfer_flops` what the model says the transfers cost
    (memsave.planner.costs.transfer_flops). `memsave.plan` predicts the moved bytes
    and leaves `offloaded` empty; each checkpoint's `offloaded` says what it plans.
    `deferred_gradients` counts the weight gradients made after the last segment's
    backward pass, not where their op's gradient runs (memsave.planner.graph's
    StepGraph.deferred: each is larger than what computing it reads).
    `predicted_segments` and `predicted_recomputed_ops` are the model's count of the
    plan's segments and of the copies they run (what `memsave.plan` reports; after a
    rewrite, `segments` lists what was built). `reads_checkpoints` says whether each
    segment's gradients read the checkpoint it
    ends at as the forward pass made it rather than recomputing it (chosen where that
    costs no memory worth counting, or stays within a budget: memsave.planning).
    `recomputes_ahead` says whether each segment's recomputation waits for the gradient
    the segment after it waits for rather than its own, so it runs beside that
    segment's backward pass, off the critical path of an executor that runs ops side
    by side (chosen on the same terms). `reads_last_segment` says whether the last
    segment's gradients read its tensors as the forward pass made them, which it has
    just made, so that it recomputes nothing (chosen on the same terms: a language
    model's head and loss are not run twice). `orders_backward` says whether each segment's
    large gradient ops (outputs, or a tensor read, of at least `ordered_bytes`: 1/16 of
    the largest tensor, and 3% of the predicted peak) run one after another,
    in the order tf.gradients made them but an op's weight gradient before its input
    gradient, so that an executor running ops side by side holds what the memory model
    holds (the 'memory' strategy; not under XLA, nor where TensorFlow's own CPU
    convolution gradients are already serialized). `loops` says, for each while_v2 loop
    on the path, what its gradient keeps: recomputed (a copy runs in the backward pass
    and keeps only each iteration's carry and inputs, memsave.graph.loops) or kept as
    TensorFlow builds it, and why. `memory_calibration` says which peaks a budget
    compared with its limit: None for the memory model's, else the measurement
    (memsave.calibrate_memory) and the scale applied to the model's predictions;
    `measured_baseline_peak_bytes` is then tf.gradients' measured peak,
    `calibrated_peak_bytes` this plan's predicted peak so scaled (the measured one where
    plain tf.gradients answers), and `unknown_dim_size_measured` whether
    `unknown_dim_size` came from the measurement. `beside_bytes` are what the training
    step holds beside the gradients through the whole step (and with its update's
    temporaries in both peaks), `beside_source` what they are (under Keras `fit`, the
    optimizer's state: memsave.beside). `memory_curve` and `baseline_curve` are the plan's
    and tf.gradients' live bytes over the step (memsave.planner.curves.Curve), drawn by
    `picture()` (text) and `save_picture(path)` (PNG). Where TensorFlow differentiates
    a while loop itself (an RNN's), how far its executor runs the gradient loop ahead
    varies from process to process, and with it the peak: `predicted_peak_range` and
    `baseline_peak_range` are (least, most), the peaks with none and with all of the
    loop's parallel iterations ahead (the predicted peaks count half; max_batch_size,
    which must fit a limit, counts all), None where no such loop moves the peak.
    """
    strategy: str
    region_ops: int
    checkpoints: List[CheckpointInfo] = dataclasses.field(default_factory=list)
    dropped: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    not_recomputable: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    segments: List[SegmentInfo] = dataclasses.field(default_factory=list)
    fallback: Optional[str] = None
    declined_peak_bytes: Optional[int] = None
    predicted_peak_bytes: Optional[int] = None
    predicted_live_bytes: Optional[int] = None
    peak_at: Optional[str] = None
    baseline_peak_bytes: Optional[int] = None
    baseline_peak_at: Optional[str] = None
    resident_bytes: Optional[int] = None
    recompute_flops: int = 0
    forward_flops: int = 0
    loop_sums_flops: int = 0
    unknown_dims: int = 0
    unknown_dim_size: int = 1
    unknown_dim_source: Optional[str] = None
    offloaded: List[str] = dataclasses.field(default_factory=list)
    offload_moved_bytes: int = 0
    predicted_host_bytes: int = 0
    transfer_flops: int = 0
    deferred_gradients: int = 0
    reads_checkpoints: bool = False
    recomputes_ahead: bool = False
    reads_last_segment: bool = False
    orders_backward: bool = False
    ordered_bytes: int = 0
    predicted_segments: int = 0
    predicted_recomputed_ops: int = 0
    loops: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    memory_calibration: Optional[str] = None
    measured_baseline_peak_bytes: Optional[int] = None
    calibrated_peak_bytes: Optional[int] = None
    unknown_dim_size_measured: bool = False
    beside_bytes: int = 0
    beside_source: Optional[str] = None
    predicted_peak_range: Optional[Tuple[int, int]] = None
    baseline_peak_range: Optional[Tuple[int, int]] = None
    memory_curve: Optional[object] = dataclasses.field(default=None, repr=False)
    baseline_curve: Optional[object] = dataclasses.field(default=None, repr=False)

    def picture(self, width=72, height=12, limit=None):
        """The step's live memory over time as text, the plan's and tf.gradients'
        (memsave.picture.text)."""
        from memsave import picture
        return picture.text(self, width, height, limit)

    def save_picture(self, path, limit=None):
        """The same as a PNG at `path` (matplotlib; memsave.picture.save_png)."""
        from memsave import picture
        return picture.save_png(self, path, limit)

    @property
    def kept_bytes(self):
        return sum(c.bytes for c in self.checkpoints)

    @property
    def copied_ops(self):
        return sum(s.copied_ops for s in self.segments)

    @property
    def recomputed_ops(self):
        return sum(s.recomputed_ops for s in self.segments)

    @property
    def recomputed_bytes(self):
        return sum(s.recomputed_bytes for s in self.segments)

    @property
    def recompute_fraction(self):
        """Recomputation as a fraction of one forward pass (0 when nothing is recomputed)."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    @property
    def step_time_ratio(self):
        """The step time over plain tf.gradients', as the cost model predicts it
        (memsave.planner.costs.step_time_ratio; 1 where plain tf.gradients answered)."""
        if self.fallback:
            return 1.0
        return costs.step_time_ratio(self.recompute_flops + self.transfer_flops,
                                     self.forward_flops, self.loop_sums_flops)

    def summary(self):
        if self.fallback:
            return f"memsave: plain tf.gradients used ({self.fallback}){self._peaks()}"
        largest = sorted(self.checkpoints, key=lambda c: -c.bytes)[:3]
        return (f"memsave: strategy {self.strategy}: {_count(len(self.checkpoints), 'checkpoint')} "
                f"({_mb(self.kept_bytes)} kept; largest "
                f"{', '.join(f'{c.name} {_mb(c.bytes)}' for c in largest)}) over a region of "
                f"{self.region_ops} ops; {self._recomputation()}, about "
                f"{self.recompute_fraction:.0%} of a forward pass (a step of about "
                f"{self.step_time_ratio:.2f}x tf.gradients' time); "
                f"{_count(len(self.not_recomputable), 'op')} kept as not recomputable"
                f"{self._loops()}{self._deferred()}{self._offload()}{self._peaks()}")

    def _recomputation(self):
        ahead = ", each a segment ahead" if self.recomputes_ahead else ""
        ahead += (f", gradient ops holding {_mb(self.ordered_bytes)} or more one after another"
                  if self.orders_backward else "")
        if not self.segments:  # (memsave.plan builds none: what the model predicts)
            return (f"{_count(self.predicted_segments, 'segment')} would recompute "
                    f"{_count(self.predicted_recomputed_ops, 'op')}{ahead}")
        verb = "recomputes" if len(self.segments) == 1 else "recompute"
        return (f"{_count(len(self.segments), 'segment')} {verb} "
                f"{_count(self.recomputed_ops, 'op')} "
                f"({_mb(self.recomputed_bytes)}){ahead}")

    def _loops(self):
        recomputed = sum(why.startswith(RECOMPUTED_LOOP) for _, why in self.loops)
        if not recomputed:
            return ""
        return f"; {_count(recomputed, 'loop')} recomputed in the backward pass"

    def _deferred(self):
        if not self.deferred_gradients:
            return ""
        return (f"; {_count(self.deferred_gradients, 'weight gradient')} made after the last "
                "segment (smaller to keep what they read)")

    def _offload(self):
        count = sum(c.offloaded for c in self.checkpoints)
        if not count:
            return ""
        return (f"; {_count(count, 'checkpoint')} offloaded to host memory "
                f"({_mb(self.offload_moved_bytes)} moved per step)")

    def _peaks(self):
        if self.predicted_peak_bytes is None:
            return ""
        text = (f"; predicted peak {_mb(self.predicted_peak_bytes)} vs tf.gradients' "
                f"{_mb(self.baseline_peak_bytes)}")
        if self.baseline_peak_bytes:
            text += f" ({self.predicted_peak_bytes / self.baseline_peak_bytes:.2f}x)"
        text += f", at {self.peak_at}{self._ranges()}"
        if self.memory_calibration is not None:
            text += (f"; calibrated: {_mb(self.calibrated_peak_bytes)} vs tf.gradients' measured "
                     f"{_mb(self.measured_baseline_peak_bytes)} ({self.memory_calibration})")
        if self.unknown_dims:
            text += f" ({self.unknown_dims} tensors have unknown dimensions, {self._dims_text()})"
        if self.beside_source:
            text += (f"; with {_mb(self.beside_bytes)} held beside the gradients "
                     f"({self.beside_source})")
        return text

    def _ranges(self):
        ranges = [f"{who} {_span(peaks)}" for who, peaks in (
            ("this plan", self.predicted_peak_range), ("tf.gradients'", self.baseline_peak_range))
                  if peaks is not None]
        if not ranges:
            return ""
        return ("; as far ahead as TensorFlow runs its gradient loops, which varies from "
                f"process to process: {', '.join(ranges)}")

    def _dims_text(self):
        source = self.unknown_dim_source
        if self.unknown_dim_size_measured or source == "measured":
            return f"counted as {self.unknown_dim_size}, as measured"
        if source == "given":
            return f"counted as {self.unknown_dim_size}, as given"
        if source:
            return f"planned for a batch of {self.unknown_dim_size}, from {source}"
        return (f"counted as {self.unknown_dim_size}: pass unknown_dim_size= to memsave.plan or "
                "memsave.budget, or trace the step inside memsave.batch_size(n)")

    def format(self):
        """A readable table of checkpoints and segments."""
        lines = [self.summary(), "", "kept (checkpoints):"]
        lines += [f"  {c.name:<48} {c.shape:<20} {c.dtype:<8} {_mb(c.bytes):>10}  {c.reason}"
                  + ("; offloaded to host memory" if c.offloaded else "")
                  for c in self.checkpoints]
        if self.dropped:
            lines += ["dropped from the checkpoint list:"]
            lines += [f"  {name}: {why}" for name, why in self.dropped]
        if self.not_recomputable:
            lines += ["not recomputable (outputs kept, never re-run):"]
            lines += [f"  {name}: {why}" for name, why in self.not_recomputable]
        if self.loops:
            lines += ["loops (what their gradients keep):"]
            lines += [f"  {name}: {why}" for name, why in self.loops]
        if self.segments:
            lines += ["recomputed segments (in backward order; each "
                      + ("reads" if self.reads_checkpoints else "recomputes")
                      + " the checkpoint it ends at"
                      + ("; the last one reads what the forward pass made" if
                         self.reads_last_segment else "") + "):"]
            lines += [f"  ends at {', '.join(s.ends_at)[:60]:<60} {s.recomputed_ops:>5} ops "
                      f"{_mb(s.recomputed_bytes):>10}" for s in self.segments]
        return "\n".join(lines)

    __str__ = format

    def log(self):
        logger.info("%s", self.summary())
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s", self.format())


RECOMPUTED_LOOP = "recomputed"


def loop_line(memory, why):
    """The report's words for a loop's memsave.planner.loops.LoopMemory; `why` the rewrite
    differentiates it as TensorFlow does, None where it differentiates its recomputing
    copy."""
    count = f"{memory.iterations} iterations" if memory.known else "iterations unknown (1 assumed)"
    if why is not None:
        return (f"kept as TensorFlow differentiates it ({count}, {_mb(memory.kept_by_tensorflow)}"
                f" for its gradient): {why}")
    if memory.chunk > 1:
        count += f", in chunks of {memory.chunk}"
    return (f"{RECOMPUTED_LOOP} in the backward pass ({count}): its copy holds "
            f"{_mb(memory.kept_by_copy)} where TensorFlow's gradient keeps "
            f"{_mb(memory.kept_by_tensorflow)} from the forward pass")


def _span(peak_range):
    """'least-most MiB' of a peak range."""
    return f"{peak_range[0] / 2**20:.1f}-{peak_range[1] / 2**20:.1f} MiB"


def _mb(n):
    return f"{n / 2**20:.2f} MiB"


def _count(n, noun):
    """'1 checkpoint', '3 checkpoints'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


_latest_of_any_thread = [None]


def record(report):
    """Makes `report` the one `last_report()` returns (per thread) and logs it."""
    _latest.report = report
    _latest_of_any_thread[0] = report
    for collected in getattr(_latest, "collecting", ()):
        collected.append(report)
    report.log()
    return report


@contextlib.contextmanager
def collecting():
    """Yields a list that receives every report this thread records inside the block."""
    collected = []
    if not hasattr(_latest, "collecting"):
        _latest.collecting = []
    _latest.collecting.append(collected)
    try:
        yield collected
    finally:
        # (by identity: an inner block's list may equal this one)
        del _latest.collecting[max(i for i, c in enumerate(_latest.collecting)
                                   if c is collected)]


def last_report():
    """The RewriteReport of the latest memsave.gradients call in this thread; where this
    thread made none, that of the latest call in any thread (tf.distribute runs each
    replica's step in a thread of its own); None before any."""
    report = getattr(_latest, "report", None)
    return report if report is not None else _latest_of_any_thread[0]
