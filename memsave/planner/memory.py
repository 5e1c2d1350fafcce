"""The memory model: the predicted peak of a training step, plain or rewritten.

The step is simulated as an ordered list of steps, each running one op (a
forward op, a recomputed copy, or the gradient of one op), over buffers that
live from the step that makes them to the last step that reads them:

- resident: inputs, constants and variables, alive for the whole step;
- forward tensors: from their op to their last reader, forward or backward
  (plain tf.gradients keeps what each op's gradient reads until that gradient
  runs; the rewrite keeps only checkpoints and tensors it cannot recompute);
- recomputed tensors: from their copy to their last reader in that segment;
  a copy whose output nobody reads is never run (TensorFlow prunes it); a
  checkpoint made by a Cast to a wider type is held as the Cast's input, and each
  segment that reads it makes its own copy as it starts (ForwardReads.narrowed);
- gradients: from the gradient op that makes them to the one that consumes
  them; a tensor read by k ops gets k contributions, summed when the last one
  arrives; gradients of the xs live to the end of the step (they are returned);
- gradient temporaries: output-sized products that a gradient makes and reduces
  at once (the gradient of x * scale with respect to a broadcast scale).

Outputs that share their input's buffer (Reshape, Identity, variable reads)
extend that buffer instead of allocating. The order is the one the rewrite
enforces: the whole forward pass, then segment by segment (last first) the
segment's recomputation followed by its backward pass (for a plan that
recomputes ahead, each recomputation as soon as the gradient it waits for is
complete, within an earlier segment's backward pass), whose gradient steps run
as an executor runs them: each once its incoming gradients are complete, first
come first served, so the backward passes of parallel branches interleave. An
executor with several inter-op threads (StepGraph.inter_op_threads) runs a step
beside those already waiting when it starts (another branch's: a ResNet block's
shortcut and main branch), so what it reads and its temporaries stay alive through
them. Then the weight gradients the rewrite makes last (StepGraph.deferred: each
larger than what it reads, which stays alive until then; a convolution's filter
gradient of a weight read through a Cast with it, StepGraph.deferred_through), as
many side by side as the executor has threads. The peak is the largest
sum of live buffers over all steps, counting an op's inputs and outputs at once;
on request the step is also replayed through the device's allocator
(memsave.planner.allocator), which holds more than the tensors need.
"""

import collections
import dataclasses
from typing import Optional

from memsave.planner import allocator as allocator_lib
from memsave.planner import costs, curves, intervals, opinfo
from memsave.planner.graph import KEPT, REGION, RESIDENT
from memsave.planner.segments import LAST, Segmentation

_FOREVER = 1 << 62
# The kind of the buffers a training step holds beside the gradients (memsave.beside).
BESIDE = "beside"
_BASELINE = "baseline"  # the prediction key of plain tf.gradients


@dataclasses.dataclass
class Prediction:
    """What the model predicts for one step.

    Attributes:
      peak_bytes: the largest number of bytes alive at once.
      resident_bytes: bytes alive before the step starts (inputs, variables).
      peak_at: where the peak happens, e.g. "backward of segment 3 of 9, gradient of conv2d_7".
      recompute_flops: estimated cost of the recomputed copies, in FLOPs, with each
        copy's and each segment's overhead counted as FLOPs (memsave.planner.costs).
      forward_flops: the same estimate for one forward pass of the region, for scale.
      checkpoint_bytes: bytes of the checkpoints kept.
      segments: number of recomputed segments.
      recomputed_ops: copies that run (Segmentation.executed), over all segments.
      breakdown: bytes alive at the peak by kind ('resident', 'forward',
        'recomputed', 'offloaded back', 'gradients', 'gradients of xs', 'beside':
        what the training step holds beside them, memsave.beside).
      host_bytes: bytes of offloaded checkpoints, held in host memory (not counted in
        peak_bytes, which is the device's).
      moved_bytes: bytes copied to the host and back per step.
      transfer_flops: what those copies cost the step, in FLOPs
        (memsave.planner.costs.transfer_flops).
      deferred_gradients: gradients made after the last segment (StepGraph.deferred).
      reads_checkpoints: whether the plan's segments read their checkpoints as the
        forward pass made them (MemoryModel.predict's read_checkpoints).
      recomputes_ahead: whether each segment's recomputation may run beside the
        backward pass of the segment after it (MemoryModel.predict's recompute_ahead).
      allocator_peak_bytes: what the device's allocator holds at its peak, chunks
        rounded up as it hands them out (memsave.planner.allocator), where the model
        simulates one and was asked to (MemoryModel.predict(..., allocator=True));
        allocator_peak_at: where that peak happens.
    """
    peak_bytes: int
    resident_bytes: int
    peak_at: str
    recompute_flops: int = 0
    forward_flops: int = 0
    checkpoint_bytes: int = 0
    segments: int = 0
    recomputed_ops: int = 0
    breakdown: Optional[dict] = None
    host_bytes: int = 0
    moved_bytes: int = 0
    transfer_flops: int = 0
    deferred_gradients: int = 0
    allocator_peak_bytes: Optional[int] = None
    allocator_peak_at: Optional[str] = None
    reads_checkpoints: bool = False
    recomputes_ahead: bool = False

    @property
    def device_peak_bytes(self):
        """The allocator's peak where it was simulated, else the live tensors' peak."""
        return self.peak_bytes if self.allocator_peak_bytes is None else self.allocator_peak_bytes

    @property
    def device_peak_at(self):
        """Where `device_peak_bytes` happens."""
        return self.peak_at if self.allocator_peak_at is None else self.allocator_peak_at

    @property
    def cost_flops(self):
        """What the plan adds to the step: recomputation and transfers."""
        return self.recompute_flops + self.transfer_flops

    @property
    def recompute_fraction(self):
        """Recomputation as a fraction of one forward pass of the region."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0


@dataclasses.dataclass
class _ForwardPass:
    """One simulated forward pass: its timeline, each tensor's buffer in it, each loop's
    buffer of what TensorFlow's gradient keeps of it, and each op's of what its
    gradient keeps that no tensor shows (StepGraph.held: a call's intermediates), and
    each op's folded product (StepGraph.folded)."""
    timeline: "_Timeline"
    buffers: list
    loop_buffers: dict
    held_buffers: dict
    folded_buffers: dict


def _released_buffer(graph, op, origin, buffers, incoming, held):
    """The buffer of what call op `op`'s backward function reads, named as in
    BackwardRun.released (None where the step has none)."""
    kind, index = origin
    if kind == "incoming":
        return incoming[index] if index < len(incoming) else None
    if kind == "output":
        return buffers[graph.outputs[op][index]]
    return held


class _Timeline:
    """Steps and buffers; the peak is found with one difference-array pass."""

    def __init__(self):
        self.labels = []
        self.starts, self.ends, self.bytes, self.kinds = [], [], [], []
        # Per buffer, whose it is: a tensor id (a tensor, or with a gradient kind its
        # gradient), or -(op id + 1) for the temporaries of an op's gradient.
        self.owners = []
        # Per buffer, how many allocations of equal size it is made of (a TensorList's
        # elements, a loop's iterations): the allocator replay places each apart.
        self.pieces = []

    def step(self, label):
        self.labels.append(label)
        return len(self.labels) - 1

    def buffer(self, start, nbytes, kind, owner, end=None, pieces=1):
        self.starts.append(start)
        self.ends.append(start if end is None else end)
        self.bytes.append(nbytes)
        self.kinds.append(kind)
        self.owners.append(owner)
        self.pieces.append(pieces)
        return len(self.bytes) - 1

    def copy(self):
        other = _Timeline()
        other.labels = list(self.labels)
        other.starts, other.ends = list(self.starts), list(self.ends)
        other.bytes, other.kinds = list(self.bytes), list(self.kinds)
        other.owners, other.pieces = list(self.owners), list(self.pieces)
        return other

    def alive_at(self, step):
        """(bytes, kind, owner) of each buffer alive at `step`, largest first."""
        alive = [(nbytes, kind, owner) for start, end, nbytes, kind, owner
                 in zip(self.starts, self.ends, self.bytes, self.kinds, self.owners)
                 if start <= step <= end and nbytes]
        return sorted(alive, key=lambda b: (-b[0], b[2]))

    def live_at(self, step):
        """Bytes alive at `step`, by kind of buffer."""
        result = {}
        for start, end, nbytes, kind in zip(self.starts, self.ends, self.bytes, self.kinds):
            if start <= step <= end and nbytes:
                result[kind] = result.get(kind, 0) + nbytes
        return result

    def use(self, buffer, step):
        if buffer is not None and self.ends[buffer] < step:
            self.ends[buffer] = step

    def last_read_at(self, buffer, step):
        """Whether `buffer` is made before `step` and read for the last time there."""
        return (buffer is not None and self.ends[buffer] == step
                and self.starts[buffer] < step)

    def peak(self):
        """(peak bytes, step of the peak)."""
        return intervals.peak(self.starts, self.ends, self.bytes, len(self.labels))


class _Gradients:
    """Gradient buffers: contributions, their sum, and when they are consumed."""

    def __init__(self, graph, timeline, expected, beside=None):
        self.graph = graph
        self.timeline = timeline
        self.expected = expected
        self.parts = {}
        self.total = {}
        # An update consuming each x's gradient as it is made (memsave.beside.Beside).
        self.updates_each = beside is not None and beside.updates_each_gradient
        self.update_temporaries = beside.update_temporaries if beside is not None else 0

    def seed(self, tid, step):
        self._contribute(tid, self.graph.size[tid], step, None)

    def contribute(self, tid, nbytes, step, shares=None):
        """Adds a contribution to the gradient of `tid`; returns the contribution's own
        buffer (None where it shares one), not the sum's that may be made with it."""
        return self._contribute(tid, nbytes, step, shares)

    def _contribute(self, tid, nbytes, step, shares):
        timeline = self.timeline
        kind = "gradients of xs" if self.graph.is_x[tid] else "gradients"
        buffer = shares if shares is not None else timeline.buffer(step, nbytes, kind, tid)
        parts = self.parts.setdefault(tid, [])
        parts.append(buffer)
        if len(parts) >= self.expected.get(tid, 1):
            if len(parts) == 1:
                self.total[tid] = buffer
            else:
                self.total[tid] = timeline.buffer(step, nbytes, kind, tid)
            if self.graph.is_x[tid]:
                self._completed_x(tid, nbytes, step)
        return None if shares is not None else buffer

    def _completed_x(self, tid, nbytes, step):
        """An x's gradient is a result: alive to the end of the step, or, where a
        training step updates each weight as its gradient is made, read there by the
        update, whose temporaries are alive with it."""
        if not self.updates_each:
            self.timeline.use(self.total[tid], _FOREVER)
            return
        temporaries = int(self.update_temporaries * nbytes)
        if temporaries:
            self.timeline.buffer(step, temporaries, BESIDE, tid,
                                 pieces=max(1, round(self.update_temporaries)))

    def complete(self, tids):
        """Whether the gradients of `tids` (a non-empty list) have all arrived."""
        return bool(tids) and all(tid in self.total for tid in tids)

    def consume(self, tid, step):
        """Reads the gradient of `tid` at `step`; returns its buffer (or None)."""
        buffer = self.total.get(tid)
        if buffer is None:
            for part in self.parts.get(tid, ()):  # not all arrived: read what did
                self.timeline.use(part, step)
            return None
        self.timeline.use(buffer, step)
        return buffer


def _contribution_counts(graph):
    counts = {}
    for op, pairs in enumerate(graph.grad_inputs):
        for tid, _ in pairs:
            counts[tid] = counts.get(tid, 0) + 1
    for tid, is_y in enumerate(graph.is_y):
        if is_y:
            counts[tid] = counts.get(tid, 0) + 1
    return counts


class MemoryModel:
    """Predicts the peak of the plain and the rewritten step of one StepGraph."""

    def __init__(self, graph, allocator=None, beside=None):
        """Args:
          graph: the StepGraph.
          allocator: a memsave.planner.allocator.Allocator to replay predictions
            through on request (None: live tensors only).
          beside: a memsave.beside.Beside, what the training step holds beside the
            gradients (an optimizer's slots, its update), or None.
        """
        self.graph = graph
        self.allocator = allocator
        self.beside = beside
        self.path_ops = [i for i, k in enumerate(graph.kind) if k in (REGION, KEPT)]
        self.forward_flops = int(sum(graph.cost[op] + graph.costs.op_overhead
                                     for op in graph.region_op_ids()))
        self._predictions = {}  # key (checkpoints, offloaded, ...) or _BASELINE -> Prediction
        self._last = (None, None, None)  # (key, timeline, segmentation) simulated last
        self._expected = _contribution_counts(graph)
        self._resident = graph.resident_bytes() + (beside.resident_bytes if beside else 0)
        # The forward pass is the same for every plan but where a plan keeps the buffer
        # a kernel would write into (_unforwardable): simulated once per such set.
        self._forward_passes = {}  # frozenset of unforwardable outputs -> _ForwardPass
        self._loop_buffers = {}  # loop op id -> what TensorFlow's gradient keeps of it
        self._held_buffers = {}  # op id -> what its gradient keeps that no tensor shows
        self._folded_buffers = {}  # op id -> its folded product (StepGraph.folded)
        self._rewriting = False
        self._segment_of = {}
        self._running = []
        self._written_into = []
        self._recomputed_loops = frozenset(graph.recomputed_loops())

    # -- public -------------------------------------------------------------------
    def baseline(self, allocator=False):
        """The step as tf.gradients builds it (`allocator`: as for predict)."""
        return self._cached(_BASELINE, allocator,
                            lambda replay: self._simulate(_BASELINE, None, replay=replay))

    def _cached(self, key, allocator, simulate):
        """The prediction of `key`, made once by simulate(replay), and replayed through
        the allocator where asked and not yet done: from the timeline simulated last
        where that was this key's (a search checks a plan's tensors, then its chunks),
        else from a new simulation."""
        prediction = self._predictions.get(key)
        if prediction is None:
            prediction = simulate(allocator)
        elif (allocator and self.allocator is not None
              and prediction.allocator_peak_bytes is None):
            last_key, timeline, segmentation = self._last
            prediction = (dataclasses.replace(prediction, **self._replayed(timeline, segmentation))
                          if key == last_key else simulate(True))
        self._predictions[key] = prediction
        return prediction

    def predict(self, checkpoints, offloaded=(), prefetch=1, flops_per_byte=None,
                allocator=False, read_checkpoints=False, recompute_ahead=False):
        """The step as the rewrite builds it with these checkpoint tensor ids.

        Args:
          checkpoints: tensor ids of the checkpoints.
          offloaded: those of them kept in host memory between the forward and the
            backward pass (memsave.offload): on the device only until their last
            forward reader, and again from the start of the segment `prefetch`
            segments before each segment that reads them to that segment's last read.
          prefetch, flops_per_byte: as memsave.Offload's (default flops_per_byte:
            memsave.planner.costs.DEFAULT_FLOPS_PER_BYTE).
          allocator: also replay the step through the model's allocator
            (`allocator_peak_bytes`); searches rank plans without it, which is
            cheaper, and ask for it where a plan is checked against a limit or reported.
          read_checkpoints: segments' gradients read the checkpoints as the forward
            pass made them instead of recomputing them (Segmentation).
          recompute_ahead: each segment's recomputation waits for the gradient the
            segment after it (in the forward pass) waits for, not for its own, so it
            runs beside that segment's backward pass: on an executor with more than
            one thread, recomputation leaves the critical path; its tensors are alive
            for that backward pass too (simulated: it runs as soon as that gradient
            is complete, which may be before the backward pass that makes it ends).
        """
        if flops_per_byte is None:
            flops_per_byte = costs.DEFAULT_FLOPS_PER_BYTE
        key = _plan_key(checkpoints, offloaded, prefetch, flops_per_byte, read_checkpoints,
                        recompute_ahead)
        return self._cached(key, allocator, lambda replay: self._simulate(
            key, self._segmentation(key), frozenset(key[1]), prefetch, flops_per_byte,
            replay=replay, ahead=bool(recompute_ahead)))

    def _segmentation(self, key):
        return Segmentation(self.graph, key[0], key[1], key[3])

    def largest_at_peak(self, checkpoints=None, read_checkpoints=False, top=10):
        """What the model holds at the live tensors' peak of a plan (of tf.gradients'
        step where `checkpoints` is None), to set beside a measured step's records
        (benchmarks/peak_breakdown.py).

        Returns:
          (peak_at, [(bytes, kind, what)]): where the peak is, and its `top` largest
          buffers, largest first; `what` names a tensor, a tensor's gradient ("gradient
          of ..."), or an op gradient's temporaries ("temporaries of the gradient of ...").
        """
        timeline, segmentation = self._simulated(checkpoints, read_checkpoints=read_checkpoints)
        _, at = timeline.peak()
        return (self.describe(timeline.labels[at], segmentation),
                self._largest_at(timeline, at, top))

    def curve(self, checkpoints=None, offloaded=(), prefetch=1, read_checkpoints=False,
              recompute_ahead=False, top=5):
        """The live bytes over the step of a plan (tf.gradients' where `checkpoints` is
        None), for pictures: a memsave.planner.curves.Curve (arguments as predict's)."""
        timeline, segmentation = self._simulated(checkpoints, offloaded, prefetch,
                                                 read_checkpoints, recompute_ahead)
        _, at = timeline.peak()
        live = intervals.live_per_step(timeline.starts, timeline.ends, timeline.bytes,
                                       len(timeline.labels))
        return curves.of_timeline(
            live, timeline.labels, self.describe(timeline.labels[at], segmentation),
            [(nbytes, what) for nbytes, _, what in self._largest_at(timeline, at, top)])

    def _simulated(self, checkpoints=None, offloaded=(), prefetch=1, read_checkpoints=False,
                   recompute_ahead=False):
        """(timeline, segmentation) of a plan simulated now (tf.gradients' where
        `checkpoints` is None; arguments as predict's)."""
        if checkpoints is None:
            self._simulate(_BASELINE, None)
        else:
            key = _plan_key(checkpoints, offloaded, prefetch, costs.DEFAULT_FLOPS_PER_BYTE,
                            read_checkpoints, recompute_ahead)
            self._simulate(key, self._segmentation(key), frozenset(key[1]), prefetch,
                           ahead=bool(recompute_ahead))
        _, timeline, segmentation = self._last
        return timeline, segmentation

    def _largest_at(self, timeline, step, top):
        """(bytes, kind, what) of the `top` largest buffers alive at `step`."""
        return [(nbytes, kind, self._owner_name(owner, kind))
                for nbytes, kind, owner in timeline.alive_at(step)[:top]]

    def _owner_name(self, owner, kind):
        graph = self.graph
        if kind == BESIDE and owner >= 0:
            return f"the update of {graph.tensors[owner].name} ({self.beside.source})"
        if kind == BESIDE:
            return f"held beside the gradients: {self.beside.source}"
        if owner < 0 and kind == "loop":
            return f"what the gradient of loop {graph.ops[-owner - 1].name} keeps per iteration"
        if owner < 0 and kind in ("forward", "recomputed"):
            return f"what the gradient of {graph.ops[-owner - 1].name} keeps of its run"
        if owner < 0:
            return f"temporaries of the gradient of {graph.ops[-owner - 1].name}"
        name = graph.tensors[owner].name
        return f"gradient of {name}" if kind.startswith("gradients") else name

    # -- simulation ---------------------------------------------------------------
    def _simulate(self, key, segmentation, offloaded=frozenset(), prefetch=1, flops_per_byte=0,
                  replay=False, ahead=False):
        graph = self.graph
        forward_pass = self._forward_pass(self._unforwardable(segmentation))
        timeline, forward = forward_pass.timeline.copy(), forward_pass.buffers
        self._loop_buffers = forward_pass.loop_buffers
        self._held_buffers = forward_pass.held_buffers
        self._folded_buffers = forward_pass.folded_buffers
        self._last = (key, timeline, segmentation)
        self._rewriting = segmentation is not None
        self._segment_of = {} if segmentation is None else segmentation.segment_of
        self._running = []  # [steps left, buffers] of gradient steps still running
        self._written_into = []
        # (step, buffers a call's backward function frees early, (a buffer it writes a
        # temporary into, the buffer that temporary needs where that one lives on))
        self._call_runs = []
        if self._rewriting:
            # The rewrite differentiates these loops' recomputing copies: the loops
            # themselves keep nothing for the backward pass.
            for op in self._recomputed_loops:
                timeline.bytes[self._loop_buffers[op]] = 0
            # Nor do the ops whose gradients are taken of their recomputed copies.
            for ops in segmentation.ops.values():
                for op in ops:
                    if op in self._held_buffers:
                        timeline.bytes[self._held_buffers[op]] = 0
            # A folded product is made of what the gradient reads: of the copy's
            # output where the copy runs, else of the forward pass's.
            for head in segmentation.order:
                for op in segmentation.executed(head):
                    if op in self._folded_buffers:
                        timeline.bytes[self._folded_buffers[op]] = 0
        gradients = _Gradients(graph, timeline, self._expected, self.beside)
        start = timeline.step(("seed", None, None))
        for tid, is_y in enumerate(graph.is_y):
            if is_y:
                gradients.seed(tid, start)
        recompute, back, deferred = 0, [], 0
        if segmentation is None:
            for op, beside in self._backward_order(self.path_ops):
                self._gradient_step(op, forward, gradients, timeline, ("backward", op, None),
                                    beside=beside)
        else:
            recompute, back, deferred = self._segments(
                segmentation, forward, gradients, timeline, offloaded, prefetch, ahead)
        self._settle_call_runs(timeline)
        self._forward_gradients_into_dying(timeline)
        self._hold_beside(timeline)
        out_bytes = sum(graph.size[t] for t in offloaded)
        back_bytes = sum(graph.size[t] for t in back)
        peak, at = timeline.peak()
        return Prediction(
            peak_bytes=peak, resident_bytes=self._resident,
            peak_at=self.describe(timeline.labels[at], segmentation),
            recompute_flops=int(recompute), forward_flops=self.forward_flops,
            checkpoint_bytes=0 if segmentation is None else sum(
                graph.size[t] for t in segmentation.reads_forward.held),
            segments=0 if segmentation is None else len(segmentation.order),
            recomputed_ops=0 if segmentation is None else sum(
                len(segmentation.executed(head)) for head in segmentation.order),
            breakdown=timeline.live_at(at),
            host_bytes=out_bytes, moved_bytes=out_bytes + back_bytes,
            transfer_flops=costs.transfer_flops(
                out_bytes, back_bytes, len(offloaded) + len(back), self.forward_flops,
                flops_per_byte, graph.costs.op_overhead) if offloaded else 0,
            deferred_gradients=deferred,
            reads_checkpoints=(segmentation is not None
                               and segmentation.reads_forward.read_checkpoints),
            recomputes_ahead=segmentation is not None and ahead,
            **(self._replayed(timeline, segmentation) if replay else {}))

    def _hold_beside(self, timeline):
        """What the training step holds beside the gradients: resident from the start,
        and, where the update waits for every gradient, its temporaries (of the largest
        weight) in a step of its own after the last gradient, while every gradient of
        an x is alive (they live _FOREVER). (An update of each gradient as it is made is
        simulated as it arrives: _Gradients._completed_x.)"""
        if self.beside is None:
            return
        beside, graph = self.beside, self.graph
        owner = -(len(graph.ops) + 1)  # (no op's: _owner_name names it)
        for nbytes in beside.resident_sizes:
            timeline.buffer(0, nbytes, BESIDE, owner, _FOREVER)
        largest = max((graph.size[t] for t, is_x in enumerate(graph.is_x) if is_x), default=0)
        if beside.update_temporaries and not beside.updates_each_gradient and largest:
            update = timeline.step(("update", None, None))
            timeline.buffer(update, int(beside.update_temporaries * largest), BESIDE, owner,
                            pieces=max(1, round(beside.update_temporaries)))

    def _replayed(self, timeline, segmentation):
        """The Prediction fields of the step replayed through the allocator (none without one)."""
        if self.allocator is None:
            return {}
        resident = [kind == "resident" for kind in timeline.kinds]
        # What is held beside the step through it (an optimizer's slots) is added, not
        # replayed: replayed first, it took the regions the step's tensors later fit in,
        # and the GPT of benchmarks/keras_fit_memory.py under Adam was predicted 314.5
        # MiB where 231-252 were measured (259.4 so; AMD EPYC without AVX-512).
        beside = [kind == BESIDE and end >= _FOREVER
                  for kind, end in zip(timeline.kinds, timeline.ends)]
        held, at = allocator_lib.replayed_peak(
            self.allocator, timeline.starts, timeline.ends,
            [0 if out else nbytes for out, nbytes in zip(beside, timeline.bytes)],
            resident, len(timeline.labels), timeline.pieces)
        held += sum(nbytes for out, nbytes in zip(beside, timeline.bytes) if out)
        return {"allocator_peak_bytes": held,
                "allocator_peak_at": self.describe(timeline.labels[at], segmentation)}

    def _forward_pass(self, unforwardable):
        """The forward pass where the kernels of `unforwardable` (forwarded outputs)
        allocate their outputs: simulated once per set, copied per plan."""
        forward_pass = self._forward_passes.get(unforwardable)
        if forward_pass is None:
            forward_pass = self._forward_passes[unforwardable] = self._forward(unforwardable)
        return forward_pass

    def _unforwardable(self, segmentation):
        """The forwarded outputs (StepGraph.forwarded) whose input's buffer the plan
        keeps for later (a checkpoint shares it): TensorFlow forwards a buffer only
        where nothing else will read it, so their kernels allocate."""
        graph = self.graph
        if segmentation is None or not graph.forwarded:
            return frozenset()
        unforwardable, held = set(), segmentation.reads_forward.held
        for out in sorted(graph.forwarded):  # (producers first: a chain stops at one)
            tid = graph.alias_of[out]
            while tid >= 0:
                if tid in held:
                    unforwardable.add(out)
                    break
                if tid in unforwardable:
                    break
                tid = graph.alias_of[tid]
        return frozenset(unforwardable)

    def _forward(self, unforwardable):
        """Runs every forward op: a _ForwardPass."""
        graph = self.graph
        timeline = _Timeline()
        run = _ForwardPass(timeline, [None] * len(graph.tensors), {}, {}, {})
        buffers = run.buffers
        for op, kind in enumerate(graph.kind):
            step = 0 if kind == RESIDENT else timeline.step(("forward", op, None))
            for tid in graph.inputs[op]:
                timeline.use(buffers[tid], step)
            for tid in graph.outputs[op]:
                source = graph.alias_of[tid]
                if source >= 0 and buffers[source] is not None and tid not in unforwardable:
                    buffers[tid] = buffers[source]
                else:
                    buffers[tid] = timeline.buffer(
                        step, graph.size[tid], "resident" if kind == RESIDENT else "forward",
                        tid, _FOREVER if kind == RESIDENT else None, graph.pieces.get(tid, 1))
            loop = graph.loops.get(op)
            if loop is not None:
                run.loop_buffers[op] = timeline.buffer(
                    step, loop.kept_by_tensorflow, "loop", -(op + 1), pieces=loop.iterations)
            if op in graph.held:
                run.held_buffers[op] = timeline.buffer(step, graph.held[op], "forward", -(op + 1))
            if op in graph.folded:
                run.folded_buffers[op] = timeline.buffer(step, graph.folded[op], "forward",
                                                         -(op + 1))
        return run

    def _gradient_step(self, op, buffers, gradients, timeline, label, deferred=None,
                       beside=0):
        """One op's gradient. In a segment of the rewrite (`deferred` a list), the
        contributions the rewrite makes last (StepGraph.deferred) are left out and
        appended to `deferred` with the buffers they keep alive until then. `beside`:
        how many of the next gradient steps start while this one runs (_backward_order):
        what it reads and its temporaries are alive through them."""
        graph = self.graph
        step = timeline.step(label)
        held_beside = self._run_beside(step, timeline)
        incoming = [gradients.consume(tid, step) for tid in graph.outputs[op]]
        reads = [buffers[tid] for tid in graph.grad_reads[op]]
        held = (buffers.held(op) if isinstance(buffers, _Overlay)
                else self._held_buffers.get(op))
        if held is not None:
            reads.append(held)
        folded = buffers.folded(op) if isinstance(buffers, _Overlay) else None
        if folded is None:
            folded = self._folded_buffers.get(op)
        if folded is not None:
            reads.append(folded)
        for buffer in reads:
            timeline.use(buffer, step)
        run = graph.call_runs.get(op)
        if run is not None:
            def buffer_of(origin):
                return _released_buffer(graph, op, origin, buffers, incoming, held)
            self._call_runs.append((step, [buffer_of(origin) for origin in run.released], [
                (buffer_of(origin), timeline.buffer(step, nbytes, "gradients", -(op + 1)))
                for origin, nbytes in run.temporaries_in_reads]))
        temporaries = graph.grad_temporaries[op]
        if op in self._loop_buffers:
            timeline.use(self._loop_buffers[op], step)
            loop = graph.loops[op]
            if self._rewriting and op in self._recomputed_loops:
                # The copy runs the loop again here, reading what the loop read (an
                # RNN's input sequence), and keeps each iteration's carry apart.
                for tid in graph.inputs[op]:
                    timeline.use(buffers[tid], step)
                carries = loop.carries * loop.carried
                timeline.buffer(step, carries, "gradients", -(op + 1), pieces=loop.carries)
                temporaries += loop.kept_by_copy + loop.copy_run_ahead - carries
            else:
                temporaries += loop.gradient_run_ahead
        later = ()
        if deferred is not None:  # a segment of the rewrite
            temporaries = graph.rewrite_grad_temporaries.get(op, temporaries)
            through = self._made_last_through(op)
            later = tuple(graph.deferred.get(op, ())) + through
            if later:
                temporaries, temporaries_later = self._split_temporaries(op, later, temporaries)
                # (what a converted weight's gradient is made from: not the weight)
                converted = {buffers[tid] for tid, _ in through}
                deferred.append((op, later, [b for b in reads if b not in converted] + incoming,
                                 temporaries_later))
        made = ([timeline.buffer(step, temporaries, "gradients", -(op + 1),
                                 pieces=graph.temporary_pieces(op, temporaries))]
                if temporaries else [])
        if beside:
            self._running.append([beside, reads + incoming + made])
        into = graph.gradient_into_output(op)
        for tid, nbytes in graph.grad_inputs[op]:
            if later and (tid, nbytes) in later:
                continue
            shares = incoming[0] if incoming and graph.gradient_passes_through(op, tid) else None
            if into is not None and into[0] == tid:
                shares = buffers[into[1]]
            made_here = gradients.contribute(tid, nbytes, step, shares)
            if made_here is not None and (self._elementwise_gradient(op, nbytes)
                                          or self._written_by_call(op, tid)):
                self._written_into.append((step, made_here, [
                    b for b in reads + incoming if b is not None and b not in held_beside]))

    def _elementwise_gradient(self, op, nbytes):
        """Whether op `op`'s gradient makes a contribution of `nbytes` with an elementwise
        kernel (not a custom gradient; of the op's output's size: a broadcast input's is
        reduced by a Sum, which allocates)."""
        graph = self.graph
        return (op not in graph.custom_gradient_ops
                and graph.ops[op].type in opinfo.ELEMENTWISE_GRADIENTS
                and bool(graph.outputs[op]) and nbytes == graph.size[graph.outputs[op][0]])

    def _settle_call_runs(self, timeline):
        """What a tf.function call's backward function reads for the last time before
        its peak (memsave.planner.call_gradients.BackwardRun) is freed by then where
        nothing reads it later: it ends the step before; a temporary it writes into such
        a buffer needs none of its own there. Done once every step is simulated, when
        each buffer's last reader is known; before contributions are written into dying
        buffers (a buffer freed here is none of those)."""
        for step, released, written in self._call_runs:
            for buffer in released:
                if timeline.last_read_at(buffer, step):
                    timeline.ends[buffer] = step - 1
            for buffer, own in written:
                if timeline.last_read_at(buffer, step):
                    timeline.bytes[own] = 0

    def _written_by_call(self, op, tid):
        """Whether call op `op`'s backward function writes the gradient of its input
        `tid` into a buffer it reads for the last time (BackwardRun.written_into)."""
        run = self.graph.call_runs.get(op)
        inputs = self.graph.inputs[op]
        return run is not None and any(inputs[i] == tid for i in run.written_into
                                       if i < len(inputs))

    def _forward_gradients_into_dying(self, timeline):
        """An elementwise op's gradient writes each contribution it makes into the buffer
        of a tensor of its size that it reads for the last time (the forward tensor, as
        TanhGrad writes into the tanh's output, else the incoming gradient): TensorFlow's
        elementwise kernels forward an input nothing reads after them, and the
        allocation records show no buffer of their own (a chain of tanh; exact GELU's
        gradient, whose products take the recomputed product's and Erfc's buffers in a
        ViT's step). Done once every step is simulated, when each buffer's last reader
        is known: the buffer taken ends the step before, each taken once."""
        taken = set()
        for step, made, candidates in self._written_into:
            for buffer in candidates:
                if (buffer not in taken and timeline.last_read_at(buffer, step)
                        and timeline.bytes[buffer] == timeline.bytes[made]):
                    timeline.ends[buffer] = step - 1
                    taken.add(buffer)
                    break

    def _run_beside(self, step, timeline):
        """Gradient step `step` starts while the earlier ones that run beside it still
        run: what they read and their temporaries are alive through it too. Returns
        those buffers (still read by a step that runs on: none is this step's to write
        into)."""
        if not self._running:  # (a chain, and every step on one thread)
            return frozenset()
        held = set()
        for entry in self._running:
            entry[0] -= 1
            for buffer in entry[1]:
                timeline.use(buffer, step)
                held.add(buffer)
        self._running = [entry for entry in self._running if entry[0] > 0]
        return held

    def _made_last_through(self, op):
        """The contributions of op `op`'s gradient made last with a converted weight's
        (StepGraph.deferred_through): only where the op converting it (the Cast) is in
        the same segment, whose tf.gradients call makes them both; a Cast that heads a
        segment of its own (its output a checkpoint) gets its gradient from `op`'s."""
        graph, segment_of = self.graph, self._segment_of
        return tuple((tid, nbytes) for tid, nbytes in graph.deferred_through.get(op, ())
                     if segment_of.get(graph.producer[tid]) == segment_of.get(op))

    def _split_temporaries(self, op, later, temporaries):
        """(the temporaries of op `op`'s gradient in its segment, those of its part made
        last): a convolution whose filter gradient is made last makes its filter
        gradient's im2col buffer then, and only its input gradient's in the segment."""
        graph = self.graph
        workspaces = graph.conv_workspaces.get(op)
        if workspaces is None or len(graph.inputs[op]) < 2 or not any(
                tid == graph.inputs[op][1] for tid, _ in later):
            return temporaries, temporaries
        for_filter, for_input = workspaces
        # (`temporaries` holds the larger of the two buffers: the rewrite makes the two
        # gradients one after the other, StepGraph.rewrite_grad_temporaries)
        others = temporaries - max(for_filter, for_input)
        return others + for_input, for_filter

    def _deferred_steps(self, deferred, gradients, timeline):
        """The gradients the rewrite makes after every segment, in the order it made
        their segments' backward passes; each keeps what it reads alive until then.
        They wait for the same tensors, so the executor runs as many side by side as it
        has threads (StepGraph.inter_op_threads): what each one reads and its
        temporaries (a filter gradient's im2col buffer) are alive through the next
        ones' steps. (Counted in steps that make temporaries, a filter gradient's: the
        Cast of its result to the weight's float32 takes no thread for long.)"""
        steps = [timeline.step(("deferred", op, None)) for op, _, _, _ in deferred]
        working = [step for step, entry in zip(steps, deferred) if entry[3]]
        position = {step: index for index, step in enumerate(working)}
        side_by_side = max(self.graph.inter_op_threads, 1)
        for step, (op, pairs, held, temporaries) in zip(steps, deferred):
            until = step
            if temporaries:
                until = working[min(position[step] + side_by_side, len(working)) - 1]
                timeline.buffer(step, temporaries, "gradients", -(op + 1), end=until)
            for buffer in held:
                timeline.use(buffer, until)
            for tid in self.graph.outputs[op]:  # (made here where deferred through op)
                gradients.consume(tid, until)
            for tid, nbytes in pairs:
                gradients.contribute(tid, nbytes, step)

    def _segments(self, segmentation, forward, gradients, timeline, offloaded=frozenset(),
                  prefetch=1, ahead=False):
        """Each segment: its recomputation, then its backward; then the deferred weight
        gradients. Returns the recompute FLOPs, the offloaded checkpoints copied back
        (once per segment reading one), and the deferred gradient steps.

        `ahead`: each segment's recomputation runs as soon as the gradient it waits for
        (the one the segment after it in the forward pass waits for) is complete, which
        may be in the middle of an earlier segment's backward pass: an executor may
        start it there, beside the rest of that backward pass and the next one.
        An offloaded checkpoint a segment reads comes back into a buffer of its own from
        the start of the segment `prefetch` segments earlier (memsave.offload)."""
        order = segmentation.order
        starts, back, deferred, recomputed = [], [], [], []
        recompute = 0

        def recompute_through(last):
            nonlocal recompute
            while len(recomputed) <= min(last, len(order) - 1):
                local, cost = self._recompute(segmentation, len(recomputed), forward, timeline,
                                              offloaded, starts, prefetch, back)
                recomputed.append(local)
                recompute += cost

        waits_for = [self._trigger(segmentation, head) for head in order] if ahead else None
        for index in range(len(order)):
            if offloaded:  # (a step of its own only then: plain predictions stay as they were)
                starts.append(timeline.step(("segment", None, index)))
            for op, beside in self._backward_order(segmentation.kept_before.get(index, [])):
                self._gradient_step(op, forward, gradients, timeline, ("kept", op, index),
                                    beside=beside)
            recompute_through(index + 1 if ahead else index)
            view = _Overlay(recomputed[index], forward, segmentation.reads_forward)
            recomputed[index] = None
            for op, beside in self._backward_order(segmentation.ops[order[index]]):
                self._gradient_step(op, view, gradients, timeline, ("backward", op, index),
                                    deferred, beside)
                while ahead and len(recomputed) < len(order) and gradients.complete(
                        waits_for[len(recomputed) - 1]):
                    recompute_through(len(recomputed))
        self._deferred_steps(deferred, gradients, timeline)
        for op in reversed(segmentation.final_ops):
            self._gradient_step(op, forward, gradients, timeline, ("final", op, None))
        # (weight gradients: not the filter gradients made last with them, deferred_through)
        return recompute, back, sum(1 for op, *_ in deferred if op in self.graph.deferred)

    def _trigger(self, segmentation, head):
        """The tensor ids whose gradients segment `head`'s copies wait for (the rewrite's
        trigger: the gradients of the checkpoints its head op makes); empty where none
        gets a gradient, or for the last segment (it waits for the forward pass)."""
        if head == LAST:
            return []
        return [t for t in self.graph.outputs[head]
                if t in segmentation.checkpoints and self._expected.get(t, 0) > 0]

    def _recompute(self, segmentation, index, forward, timeline, offloaded, starts, prefetch,
                   back):
        """Segment `index`'s recomputation: (its buffers by tensor id, its cost). Its
        offloaded reads (appended to `back`) come back from the start of the segment
        `prefetch` earlier, or of the latest started (recomputing ahead)."""
        graph = self.graph
        ops = segmentation.ops[segmentation.order[index]]
        executed = segmentation.executed(segmentation.order[index])
        local = {}
        for tid in self._outside_reads(ops, executed, offloaded):
            back.append(tid)
            start = starts[min(max(index - prefetch, 0), len(starts) - 1)]
            local[tid] = timeline.buffer(start, graph.size[tid], "offloaded back", tid)
        cost = graph.costs.segment_overhead
        narrowed = segmentation.reads_forward.narrowed
        for tid in self._outside_reads(ops, executed, narrowed):
            cast = graph.producer[tid]
            cost += graph.cost[cast] + graph.costs.op_overhead
            step = timeline.step(("recompute", cast, index))
            timeline.use(forward[narrowed[tid]], step)
            local[tid] = timeline.buffer(step, graph.size[tid], "recomputed", tid)
        for op in ops:
            if op not in executed:
                continue
            cost += graph.cost[op] + graph.costs.op_overhead
            step = timeline.step(("recompute", op, index))
            for tid in graph.inputs[op]:
                timeline.use(local.get(tid, forward[tid]), step)
            for tid in graph.outputs[op]:
                source = graph.alias_of[tid]
                if source >= 0 and (source in local or tid not in graph.forwarded):
                    local[tid] = local.get(source, forward[source])
                else:
                    local[tid] = timeline.buffer(step, graph.size[tid], "recomputed", tid,
                                                 pieces=graph.pieces.get(tid, 1))
            if op in graph.folded:
                local[_folded_key(op)] = timeline.buffer(step, graph.folded[op], "recomputed",
                                                         -(op + 1))
            if op in graph.held:
                local[_held_key(op)] = timeline.buffer(step, graph.held[op], "recomputed",
                                                       -(op + 1))
        return local, cost

    def _outside_reads(self, ops, executed, among):
        """The tensors of `among` (offloaded or narrowed checkpoints) made outside a
        segment that its recomputation or backward reads."""
        if not among:
            return []
        graph, members = self.graph, set(ops)
        reads = set()
        for op in ops:
            candidates = list(graph.grad_reads[op])
            if op in executed:
                candidates += graph.inputs[op]
            reads.update(t for t in candidates
                         if t in among and graph.producer[t] not in members)
        return sorted(reads)

    def _backward_order(self, ops):
        """The gradient steps of `ops` (producers first) in the order an executor
        runs them: each as soon as the gradients of all its outputs are complete,
        first come first served, so parallel branches interleave.

        Returns [(op, beside)]: `beside` is how many of the steps after it start while
        it runs: those already waiting when it starts (independent of it: another
        branch's), as many as the executor has further threads
        (StepGraph.inter_op_threads), 0 in a chain."""
        graph = self.graph
        members = set(ops)
        waiting = {}
        for op in ops:
            for tid, _ in graph.grad_inputs[op]:
                producer = graph.producer[tid]
                if producer in members:
                    waiting[producer] = waiting.get(producer, 0) + 1
        ready = collections.deque(op for op in reversed(ops) if op not in waiting)
        further_threads = max(graph.inter_op_threads, 1) - 1
        order = []
        while ready:
            op = ready.popleft()
            order.append((op, min(len(ready), further_threads)))
            for tid, _ in graph.grad_inputs[op]:
                producer = graph.producer[tid]
                if producer in members:
                    waiting[producer] -= 1
                    if waiting[producer] == 0:
                        ready.append(producer)
        if len(order) < len(ops):  # a cycle: keep what was ordered, then the rest
            done = {op for op, _ in order}
            order += [(op, 0) for op in reversed(ops) if op not in done]
        return order

    def describe(self, label, segmentation):
        phase, op, index = label
        if phase == "update":
            return f"the update after the last gradient ({self.beside.source})"
        if phase == "segment":
            return f"start of segment {index + 1} of {len(segmentation.order)}"
        if op is None:
            return "start of the backward pass"
        name = self.graph.ops[op].name
        if phase == "forward":
            return f"forward pass, at {name}"
        if phase == "final":
            return f"gradients through ops that are not recomputed, at {name}"
        if phase == "kept" and op in self._recomputed_loops:
            return f"gradient of {name}'s recomputing copy"
        if phase == "kept":
            return f"gradient of {name}, which is not recomputed"
        if phase == "deferred":
            return f"weight gradients made after the last segment, at {name}"
        if segmentation is None or index is None:
            return f"backward pass, gradient of {name}"
        where = f"segment {index + 1} of {len(segmentation.order)}"
        if phase == "recompute":
            return f"recomputation of {where}, at {name}"
        return f"backward of {where}, gradient of {name}"


def _plan_key(checkpoints, offloaded=(), prefetch=1, flops_per_byte=0, read_checkpoints=False,
              recompute_ahead=False):
    """The key MemoryModel keeps a plan's prediction under."""
    return (tuple(sorted(set(checkpoints))), tuple(sorted(set(offloaded))),
            (prefetch, flops_per_byte) if offloaded else None, bool(read_checkpoints),
            bool(recompute_ahead))


def _folded_key(op):
    """A segment's key of op `op`'s recomputed copy's folded product (StepGraph.folded)."""
    return ("folded", op)


def _held_key(op):
    """A segment's key (beside its tensor ids) of what op `op`'s gradient keeps of its
    recomputed copy's run (StepGraph.held)."""
    return -(op + 1)


class _Overlay:
    """Recomputed buffers of a segment over the forward ones; tensors that
    `reads_forward(tid)` says the gradients read from the forward pass come from there."""

    def __init__(self, local, forward, reads_forward):
        self.local = local
        self.forward = forward
        self.reads_forward = reads_forward

    def __getitem__(self, tid):
        if self.reads_forward(tid):
            return self.forward[tid]
        buffer = self.local.get(tid)
        return self.forward[tid] if buffer is None else buffer

    def folded(self, op):
        """The buffer of op `op`'s copy's folded product (StepGraph.folded), or None."""
        return self.local.get(_folded_key(op))

    def held(self, op):
        """The buffer of what op `op`'s gradient keeps of its copy's run (StepGraph.held),
        or None."""
        return self.local.get(_held_key(op))
