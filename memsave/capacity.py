"""What batch fits: the largest batch a training step is predicted to run with in a
memory limit, with memsave's plan and with plain TensorFlow, before anything runs.

The memory model predicts a step's peak from its graph; traced for a given batch (every
input's leading dimension set to it), the step's report gives memsave's peak and plain
tf.gradients' for that batch. A step's peak grows with its batch, piecewise affinely (a
plan changes only at some batches), so the largest batch within the limit is found by
growing the batch to where the line through the last two meets the limit, then secant
guesses (_largest_within): about a dozen traces; each is a row of the answer's table.

    capacity = memsave.max_batch_size(step, [tf.TensorSpec([None, 784]), ...], "8GiB")
    capacity.batch_size, capacity.baseline_batch_size
    print(capacity.summary())

For Keras, memsave.keras.max_batch_size(model, memory_limit, x=, y=) traces the model's
train step (the optimizer's state and update included, memsave.beside).

The limit is the device's: TensorFlow's allocator holds it as one region (a GPU's
default; memsave.measure.reserve_one_region makes a capped CPU run alike), so the
predictions replay that allocator (environment.ONE_REGION).
"""

import dataclasses
import os
from typing import Callable, Optional, Tuple

import tensorflow as tf

from memsave import batch as batch_lib
from memsave import beside as beside_lib
from memsave import environment
from memsave import report as report_lib
from memsave.errors import MemsaveError
from memsave.graph import _tf_private
from memsave.limits import parse_memory_limit  # noqa: F401 (memsave.capacity.parse_memory_limit)
from memsave.planner import costs

# The largest batch a search tries unless told otherwise.
MAX_BATCH = 1 << 20
# The share of the limit an answer leaves free by default. Under a cap held as one region,
# what a step needs is where its chunks land, which moves with the order the executor's
# threads run its ops in: measured 2-13% above the one-region prediction (the smallest caps
# of ResNet50's and the Keras GPT's answers, AMD EPYC without AVX-512, TensorFlow 2.21;
# benchmarks/RESULTS.md, "What each answer needs"). With 5%, ResNet50's answer ran out of
# memory in one process of two.
HEADROOM = 0.10


def device_memory_limit():
    """(bytes, where they came from) of the device TensorFlow runs the step on: a GPU's
    memory as TensorFlow's allocator may take it, else the CPU allocator's cap
    (TF_CPU_BFC_MEM_LIMIT_IN_MB with TF_CPU_ALLOCATOR_USE_BFC=true); None without either."""
    if tf.config.list_physical_devices("GPU"):
        gpu = _tf_private.gpu_memory_bytes()
        if gpu:
            return gpu, "GPU:0's memory"
    capped = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "").strip()
    if environment.cpu_uses_bfc() and capped.isdigit() and int(capped) > 0:
        return int(capped) << 20, "TF_CPU_BFC_MEM_LIMIT_IN_MB"
    return None


@dataclasses.dataclass(frozen=True)
class BatchPeak:
    """What one batch is predicted to hold.

    Attributes:
      batch_size: the batch.
      peak_bytes: memsave's plan's peak (plain tf.gradients' where memsave keeps it).
      baseline_peak_bytes: plain tf.gradients' peak.
      recompute_fraction: what the plan recomputes, in forward passes.
      report: the step's memsave.RewriteReport for this batch.
    """
    batch_size: int
    peak_bytes: int
    baseline_peak_bytes: int
    recompute_fraction: float
    report: object = dataclasses.field(repr=False, compare=False, default=None)

    @property
    def step_time(self):
        """The plan's step time over plain TensorFlow's, as the cost model predicts it
        (the report's step_time_ratio; from `recompute_fraction` alone without one)."""
        if self.report is not None:
            return self.report.step_time_ratio
        return costs.step_time_ratio(self.recompute_fraction, 1.0)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The largest batches predicted to fit in a memory limit.

    Attributes:
      memory_limit: the limit, bytes.
      limit_source: where it came from ("given", "GPU:0's memory", ...).
      batch_size: the largest batch memsave's plan fits in it (0: not even 1).
      baseline_batch_size: the largest batch plain TensorFlow fits in it.
      peaks: a BatchPeak per batch traced, smallest batch first.
      strategy: memsave's strategy, as its reports name it.
      headroom: the share of the limit the answers leave free.
    """
    memory_limit: int
    limit_source: str
    batch_size: int
    baseline_batch_size: int
    peaks: Tuple[BatchPeak, ...]
    strategy: str = ""
    headroom: float = 0.0

    @property
    def usable_bytes(self):
        """The bytes the answers are predicted within: the limit less the headroom."""
        return int(self.memory_limit * (1 - self.headroom))

    def at(self, batch_size):
        """The BatchPeak of a traced batch (KeyError for another)."""
        for peak in self.peaks:
            if peak.batch_size == batch_size:
                return peak
        raise KeyError(f"batch {batch_size} was not traced; traced: "
                       f"{[p.batch_size for p in self.peaks]}")

    def summary(self):
        """A table of every traced batch and the answers."""
        limit = _mib(self.memory_limit)
        lines = [f"memsave: what batch fits in {limit} ({self.limit_source}; the answers "
                 f"leave {self.headroom:.0%} free: within {_mib(self.usable_bytes)}), "
                 f"strategy {self.strategy or '?'}",
                 f"{'batch':>8}  {'memsave peak':>14}  {'plain TF peak':>14}  "
                 f"{'recomputed':>10}  {'step time':>9}"]
        for p in self.peaks:
            lines.append(
                f"{p.batch_size:>8}  {_mib(p.peak_bytes):>14}{_fits(p.peak_bytes, self)}"
                f" {_mib(p.baseline_peak_bytes):>14}{_fits(p.baseline_peak_bytes, self)}"
                f" {p.recompute_fraction:>9.0%}  {p.step_time:>8.2f}x")
        lines.append(f"largest batch within {_mib(self.usable_bytes)}: "
                     f"memsave {self._answer(self.batch_size, 'peak_bytes')}"
                     f"; plain TensorFlow "
                     f"{self._answer(self.baseline_batch_size, 'baseline_peak_bytes')}")
        lines.append("(predicted by memsave's memory model; * marks a peak over "
                     f"{_mib(self.usable_bytes)}; "
                     "step time: the cost model's, recomputation over a step of "
                     f"{costs.STEP_IN_FORWARD_PASSES:g} forward passes and its loops' weight sums)")
        return "\n".join(lines)

    def _answer(self, batch, field):
        if not batch:
            return "none (batch 1 does not fit)"
        peak = self.at(batch)
        text = f"{batch} (predicted {_mib(getattr(peak, field))}"
        if field == "peak_bytes":
            text += f", about {peak.step_time:.2f}x plain TensorFlow's step time"
        return text + ")"


def _mib(nbytes):
    return f"{nbytes / 2**20:.1f} MiB"


def _fits(nbytes, capacity):
    return "*" if nbytes > capacity.usable_bytes else " "


def max_batch_size(step: Callable, input_signature, memory_limit=None, optimizer_state=None,
                   max_batch=MAX_BATCH, headroom=HEADROOM, jit_compile=None, strategy_name=None):
    """The largest batch `step` is predicted to run with in `memory_limit`.

    Args:
      step: a Python function or tf.function of the training step that calls
        memsave.gradients (or memsave.GradientTape, or runs under memsave.patch); it
        is traced (not run) once per batch tried, as a tf.function of its own.
      input_signature: a list of tf.TensorSpec (nests allowed), one per argument of
        `step`, with the batch as the leading dimension, None.
      memory_limit: bytes, or text such as "8GiB"; None: the device's
        (device_memory_limit).
      optimizer_state: a callable returning the memsave.beside.Beside the step holds
        beside its gradients (an optimizer's state), or None.
      max_batch: the largest batch to try.
      headroom: the share of the limit the answers leave free (HEADROOM: 10%); the
        answers are the largest batches predicted within (1 - headroom) x the limit.
        The model's misses are in benchmarks/RESULTS.md ("What batch fits"): a larger
        headroom where a run must not fail.
      jit_compile: trace the step compiled by XLA (None: as the tf.function `step` is).
      strategy_name: how the summary names memsave's strategy (default: the reports').
    Returns:
      A Capacity.
    Raises:
      MemsaveError: for a bad limit or signature, no limit known, or a step that makes
        no memsave call.
    """
    limit, source = _limit(memory_limit)
    if not 0 <= headroom < 1:
        raise MemsaveError(f"headroom is {headroom!r}; pass the share of the limit to leave "
                           "free, from 0 to below 1 (default 0.05)")
    within = int(limit * (1 - headroom))
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise MemsaveError(f"max_batch is {max_batch!r}; pass a positive int, the largest "
                           "batch to try")
    signature = _check_signature(input_signature)
    python_step = getattr(step, "python_function", step)
    if jit_compile is None:  # (a tf.function keeps its jit_compile as _jit_compile)
        jit_compile = getattr(step, "_jit_compile", None)
    traced = {}

    def peak_of(batch):
        if batch not in traced:
            traced[batch] = _traced_peak(python_step, signature, batch, optimizer_state,
                                         jit_compile)
        return traced[batch]

    batch_size = _largest_within(lambda b: peak_of(b).peak_bytes, within, max_batch)
    baseline = _largest_within(lambda b: peak_of(b).baseline_peak_bytes, within, max_batch)
    peaks = tuple(traced[b] for b in sorted(traced))
    name = strategy_name or (peaks[-1].report.strategy if peaks else "")
    return Capacity(limit, source, batch_size, baseline, peaks, name, headroom)


def _limit(memory_limit):
    if memory_limit is not None:
        return parse_memory_limit(memory_limit), "given"
    found = device_memory_limit()
    if found is None:
        raise MemsaveError(
            "memory_limit is None and this machine has no GPU and no capped CPU allocator; "
            "pass memory_limit= (bytes or text such as '8GiB'), the memory of the device "
            "the step will train on")
    return found


def _check_signature(input_signature):
    if isinstance(input_signature, tf.TensorSpec):
        input_signature = [input_signature]  # (one argument)
    specs = tf.nest.flatten(input_signature)
    if not specs or not all(isinstance(s, tf.TensorSpec) for s in specs):
        raise MemsaveError(
            f"input_signature is {input_signature!r}; pass a list of tf.TensorSpec, one per "
            "argument of the step, with the batch as the leading dimension (None)")
    if not any(s.shape.rank and s.shape[0] is None for s in specs):
        raise MemsaveError(
            "input_signature has no input whose leading dimension is None: nothing to size "
            "by the batch; give the batch dimension as None, e.g. tf.TensorSpec([None, 784])")
    return input_signature


def _with_batch(signature, batch):
    def sized(spec):
        if spec.shape.rank and spec.shape[0] is None:
            return tf.TensorSpec([batch] + spec.shape.as_list()[1:], spec.dtype, spec.name)
        return spec
    return tf.nest.map_structure(sized, signature)


def _traced_peak(python_step, signature, batch, optimizer_state, jit_compile=None):
    """The BatchPeak of `python_step` traced with inputs of batch `batch` (the last of its
    memsave calls: a step with several, a GAN's, is sized by its last)."""
    function = tf.function(python_step, jit_compile=jit_compile)
    with batch_lib.batch_size(batch, source=f"max_batch_size({batch})"), \
            environment.assuming_allocator(environment.ONE_REGION), \
            beside_lib.holding(optimizer_state or (lambda: None)), \
            report_lib.collecting() as reports:
        function.get_concrete_function(*_with_batch(signature, batch))
    report = reports[-1] if reports else None
    if report is None:
        raise MemsaveError(
            "the step made no memsave call when traced; call memsave.gradients or "
            "memsave.GradientTape in it (or trace it under memsave.patch)")
    planned = report.predicted_peak_bytes
    baseline = report.baseline_peak_bytes
    if planned is None or baseline is None:
        raise MemsaveError(f"memsave could not predict the step's peak: {report.fallback}")
    fraction = 0.0 if report.fallback else report.recompute_fraction
    return BatchPeak(batch, planned, baseline, fraction, report)


def _largest_within(peak, limit, max_batch):
    """The largest batch b <= max_batch with peak(b) <= limit (0: none), where peak grows
    with the batch. A step's peak is piecewise affine in its batch (a plan changes only at
    some batches), so the line through the last two batches says where to look: growing
    to about where it meets the limit (at least twice, at most GROWTH times the last
    batch), then, once bracketed, the secant's guess and its neighbour, bisecting where a
    guess does not narrow the bracket."""
    if peak(1) > limit:
        return 0
    previous, low, high = None, 1, None
    while high is None:
        candidate = min(_grown(peak, limit, previous, low), max_batch)
        if candidate <= low:
            return low
        if peak(candidate) <= limit:
            previous, low = low, candidate
        else:
            high = candidate
    while high - low > 1:
        guess = _secant_guess(peak, limit, low, high)
        if peak(guess) <= limit:
            low = guess
            if guess + 1 < high and peak(guess + 1) > limit:
                high = guess + 1
        else:
            high = guess
            if guess - 1 > low and peak(guess - 1) <= limit:
                low = guess - 1
    return low


# How much larger each batch tried may be than the last while the limit is not reached.
GROWTH = 16


def _grown(peak, limit, previous, low):
    """The next batch to try above `low`: a tenth past where the line through the last
    two batches meets the limit, within [2, GROWTH] times `low`."""
    if previous is None:
        return 2 * low
    slope = (peak(low) - peak(previous)) / (low - previous)
    if slope <= 0:
        return GROWTH * low
    meets = low + (limit - peak(low)) / slope
    return int(min(max(1.1 * meets, 2 * low), GROWTH * low))


def _secant_guess(peak, limit, low, high):
    """Where the line through (low, peak(low)) and (high, peak(high)) meets the limit,
    strictly between them (the middle where the line says nothing)."""
    below, above = peak(low), peak(high)
    if above <= below:
        return (low + high) // 2
    guess = low + int((limit - below) * (high - low) // (above - below))
    return min(max(guess, low + 1), high - 1)
