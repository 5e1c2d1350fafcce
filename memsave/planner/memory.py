"""The memory model: the predicted peak of a training step, plain or rewritten.

MemoryModel is the surface the strategies, searches and report use: `baseline()`
(tf.gradients' step), `predict(checkpoints, ...)` (a plan's), `curve` and
`largest_at_peak` (what is alive over the step and at its peak), and the cache of
predictions, keyed by the plan alone. Where the parts live:

- timeline.py:      steps and buffers (Timeline), gradients as they arrive (Gradients);
- forward_pass.py:  the forward pass, simulated once per set of outputs a plan keeps a
                    kernel from writing into;
- schedule.py:      the order of gradient steps, which run side by side, what a
                    segment's recomputation waits for;
- simulate.py:      one step simulated after its forward pass: its gradient steps and
                    the kernel habits they follow; returns a SimulatedStep;
- simulate_plan.py: what a plan adds: segments, recomputation (ahead), offloaded
                    checkpoints copied back, gradients made last;
- allocator.py:     a timeline replayed through TensorFlow's BFC allocator.

A buffer lives from the step that makes it to the last step that reads it; the peak
is the largest sum of live buffers over all steps, counting an op's inputs and
outputs at once; on request the step is also replayed through the device's allocator
(memsave.planner.allocator), which holds more than the tensors need.
"""

import collections
import dataclasses
from typing import Optional

from memsave.planner import allocator as allocator_lib
from memsave.planner import costs, curves, intervals, simulate_plan
from memsave.planner import loops as loops_lib
from memsave.planner.forward_pass import run_forward, unforwardable_outputs
from memsave.planner.graph import KEPT, REGION
from memsave.planner.segments import Segmentation
from memsave.planner.simulate import StepSetup, simulate
from memsave.planner.timeline import (BESIDE, FOREVER, OpOwner, Owners, TensorOwner,
                                      contribution_counts)

_BASELINE = "baseline"  # the prediction key of plain tf.gradients

# The plan simulated last: its prediction key, Timeline and Segmentation (None for
# tf.gradients' step).
_LastRun = collections.namedtuple("_LastRun", ["key", "timeline", "segmentation"])


@dataclasses.dataclass
class Prediction:
    """What the model predicts for one step.

    Attributes:
      peak_bytes: the largest number of bytes alive at once.
      resident_bytes: bytes alive before the step starts (inputs, variables).
      peak_at: where the peak happens, e.g. "backward of segment 3 of 9, gradient of conv2d_7".
      recompute_flops: estimated cost of the recomputed copies, in FLOPs, with each
        copy's and each segment's overhead counted as FLOPs (memsave.planner.costs);
        the recomputing copies of loops (LoopMemory.recompute_cost) included.
      forward_flops: the same estimate for one forward pass (a loop's with all its
        iterations), for scale. loop_sums_flops: what the step's gradient loops add
        to the sums of their weights' gradients (memsave.planner.costs.step_flops).
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
      reads_last_segment: whether the last segment's gradients read its tensors as
        the forward pass made them (MemoryModel.predict's read_last_segment).
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
    loop_sums_flops: int = 0
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
    reads_last_segment: bool = False

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

    def flags(self, **changes):
        """MemoryModel.predict's flags for this prediction's kind of plan, with `changes`
        (a variant of it: `flags(recompute_ahead=True)`)."""
        return dict(dict(read_checkpoints=self.reads_checkpoints,
                         recompute_ahead=self.recomputes_ahead,
                         read_last_segment=self.reads_last_segment), **changes)

    @property
    def recompute_fraction(self):
        """Recomputation as a fraction of one forward pass of the region."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0



class MemoryModel:
    """Predicts the peak of the plain and the rewritten step of one StepGraph."""

    def __init__(self, graph, allocator=None, beside=None, run_ahead_end=None):
        """Args:
          graph: the StepGraph.
          allocator: a memsave.planner.allocator.Allocator to replay predictions
            through on request (None: live tensors only).
          beside: a memsave.beside.Beside, what the training step holds beside the
            gradients (an optimizer's slots, its update), or None.
          run_ahead_end: how far ahead TensorFlow runs the gradient loops it
            differentiates (memsave.planner.loops.LoopMemory.run_ahead; None: as counted).
        """
        self.graph = graph
        self.allocator = allocator
        self.beside = beside
        self.path_ops = [i for i, k in enumerate(graph.kind) if k in (REGION, KEPT)]
        self.forward_flops = int(sum(graph.cost[op] + graph.costs.op_overhead
                                     for op in self.path_ops))
        self.loop_sums_flops = sum(loop.iterations * loop.sums_cost
                                   for loop in graph.loops.values())
        self._predictions = {}  # key (checkpoints, offloaded, ...) or _BASELINE -> Prediction
        # The timeline simulated last, kept to replay that plan through the allocator
        # without simulating it again (a search checks a plan's tensors, then its
        # chunks): a cache of one, used only for the key it was simulated for.
        self._last = _LastRun(None, None, None)
        expected = contribution_counts(graph)
        self._resident = graph.resident_bytes() + (beside.resident_bytes if beside else 0)
        # The forward pass is the same for every plan but where a plan keeps the buffer
        # a kernel would write into (unforwardable_outputs): simulated once per such set.
        self._forward_passes = {}  # frozenset of unforwardable outputs -> ForwardPass
        self._setup = StepSetup(graph, expected, beside, frozenset(graph.recomputed_loops()),
                                self.path_ops, Owners(graph), run_ahead_end)
        # What every rewritten step adds besides its segments: the recomputing copies.
        self._loops_recompute_flops = sum(graph.loops[op].recompute_cost
                                          for op in self._setup.recomputed_loops)
        self._at_ends = None  # (the models of peak_range, made when first asked)

    # -- public -------------------------------------------------------------------
    def baseline(self, allocator=False):
        """The step as tf.gradients builds it (`allocator`: as for predict)."""
        return self._cached(_BASELINE, allocator,
                            lambda replay: self._simulate(_BASELINE, None, replay=replay))

    def predict(self, checkpoints, offloaded=(), prefetch=1, flops_per_byte=None,
                allocator=False, read_checkpoints=False, recompute_ahead=False,
                read_last_segment=False):
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
          read_last_segment: the last segment's gradients read its tensors as the
            forward pass made them, which it has just made: nothing of it is
            recomputed (Segmentation).
        Returns:
          A Prediction.
        """
        if flops_per_byte is None:
            flops_per_byte = costs.DEFAULT_FLOPS_PER_BYTE
        key = _plan_key(checkpoints, offloaded, prefetch, flops_per_byte, read_checkpoints,
                        recompute_ahead, read_last_segment)
        return self._cached(key, allocator, lambda replay: self._simulate(
            key, self._segmentation(key), frozenset(key[1]), prefetch, flops_per_byte,
            replay=replay, ahead=bool(recompute_ahead)))

    def peak_range(self, checkpoints=None, offloaded=(), prefetch=1, flops_per_byte=None,
                   **flags):
        """(least, most): the device peaks of tf.gradients' step (`checkpoints` None) or
        of a plan (arguments as predict's) with the gradient loops TensorFlow
        differentiates running none of their parallel iterations ahead, and all of them
        (LoopMemory.run_ahead). How far the executor runs ahead varies from process to
        process: plain Keras' LSTM stack peaked at 87-90 MiB in three processes of six
        and at 131-136 in the others (Intel Xeon). None where no such loop's run-ahead
        moves (the step has none, the plan recomputes them all, or the peak is elsewhere)."""
        recomputed = () if checkpoints is None else self._setup.recomputed_loops
        if not any(memory.run_ahead_varies for op, memory in self.graph.loops.items()
                   if op not in recomputed):
            return None
        if self._at_ends is None:  # (this model, where it counts an end already)
            self._at_ends = [self if self._counts(end) else
                             MemoryModel(self.graph, self.allocator, self.beside, end)
                             for end in loops_lib.RUN_AHEAD_ENDS]
        if checkpoints is None:
            ends = tuple(m.baseline(allocator=True).device_peak_bytes for m in self._at_ends)
        else:
            ends = tuple(m.predict(checkpoints, offloaded, prefetch, flops_per_byte,
                                   allocator=True, **flags).device_peak_bytes
                         for m in self._at_ends)
        return ends if ends[0] != ends[1] else None

    def _counts(self, end):
        """Whether this model's loops run ahead as far as `end` says (under a limit the
        counted run-ahead is the most: Environment.holds_a_limit)."""
        return all(memory.run_ahead(self._setup.run_ahead_end) == memory.run_ahead(end)
                   for memory in self.graph.loops.values())

    def cost_of(self, checkpoints, offloaded=(), flops_per_byte=None, read_checkpoints=False,
                read_last_segment=False):
        """The cost_flops of predict's Prediction for this plan (arguments as predict's),
        found from its segments alone: no simulation, so a search can rank every plan by
        cost and simulate only the cheapest."""
        if flops_per_byte is None:
            flops_per_byte = costs.DEFAULT_FLOPS_PER_BYTE
        key = _plan_key(checkpoints, offloaded, 1, flops_per_byte, read_checkpoints, False,
                        read_last_segment)
        prediction = self._predictions.get(key)
        if prediction is not None:
            return prediction.cost_flops
        recompute, copied_back = simulate_plan.plan_costs(
            self.graph, self._segmentation(key), frozenset(key[1]))
        return (int(recompute) + self._loops_recompute_flops
                + self._transfer_flops(key[1], copied_back, flops_per_byte))

    def _transfer_flops(self, offloaded, copied_back, flops_per_byte):
        """What copying `offloaded` out and `copied_back` in costs (0 without offload)."""
        if not offloaded:
            return 0
        graph = self.graph
        return costs.transfer_flops(
            sum(graph.size[t] for t in offloaded), sum(graph.size[t] for t in copied_back),
            len(offloaded) + len(copied_back), self.forward_flops, flops_per_byte,
            graph.costs.op_overhead)

    def largest_at_peak(self, checkpoints=None, read_checkpoints=False, top=10,
                        read_last_segment=False):
        """What the model holds at the live tensors' peak of a plan (of tf.gradients'
        step where `checkpoints` is None), to set beside a measured step's records
        (benchmarks/peak_breakdown.py).

        Returns:
          (peak_at, [(bytes, kind, what)]): where the peak is, and its `top` largest
          buffers, largest first; `what` names a tensor, a tensor's gradient ("gradient
          of ..."), or an op gradient's temporaries ("temporaries of the gradient of ...").
        """
        timeline, segmentation = self.simulated(checkpoints, read_checkpoints=read_checkpoints,
                                                 read_last_segment=read_last_segment)
        _, at = timeline.peak()
        return (self.describe(timeline.labels[at], segmentation),
                self._largest_at(timeline, at, top))

    def curve(self, checkpoints=None, offloaded=(), prefetch=1, read_checkpoints=False,
              recompute_ahead=False, top=5, read_last_segment=False):
        """The live bytes over the step of a plan (tf.gradients' where `checkpoints` is
        None), for pictures: a memsave.planner.curves.Curve (arguments as predict's)."""
        timeline, segmentation = self.simulated(checkpoints, offloaded, prefetch,
                                                 read_checkpoints, recompute_ahead,
                                                 read_last_segment)
        _, at = timeline.peak()
        live = intervals.live_per_step(timeline.starts, timeline.ends, timeline.bytes,
                                       len(timeline.labels))
        return curves.of_timeline(
            live, timeline.labels, self.describe(timeline.labels[at], segmentation),
            [(nbytes, what) for nbytes, _, what in self._largest_at(timeline, at, top)])

    def describe(self, label, segmentation):
        """Where step `label` (phase, op, segment index) is, in words."""
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
        if phase == "kept" and op in self._setup.recomputed_loops:
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

    # -- the cache ----------------------------------------------------------------
    def _cached(self, key, allocator, simulate_replaying):
        """The prediction of `key`, made once by simulate_replaying(replay), and
        replayed through the allocator where asked and not yet done: from the timeline
        simulated last where that was this key's, else from a new simulation. (Either
        way the same answer: a simulation depends on its plan alone; reusing the last
        timeline only spares simulating it again.)"""
        prediction = self._predictions.get(key)
        if prediction is None:
            prediction = simulate_replaying(allocator)
        elif (allocator and self.allocator is not None
              and prediction.allocator_peak_bytes is None):
            last = self._last
            prediction = (dataclasses.replace(
                prediction, **self._replayed(last.timeline, last.segmentation))
                if key == last.key else simulate_replaying(True))
        self._predictions[key] = prediction
        return prediction

    def _segmentation(self, key):
        return Segmentation(self.graph, key[0], key[1], key[3], key[5])

    def simulated(self, checkpoints=None, offloaded=(), prefetch=1, read_checkpoints=False,
                  recompute_ahead=False, read_last_segment=False):
        """(timeline, segmentation) of a plan simulated now (tf.gradients' where
        `checkpoints` is None, with segmentation None; arguments as predict's): the
        step as the model runs it, for a curve, the largest tensors at its peak, or a
        test."""
        if checkpoints is None:
            return self._step(None).timeline, None
        key = _plan_key(checkpoints, offloaded, prefetch, costs.DEFAULT_FLOPS_PER_BYTE,
                        read_checkpoints, recompute_ahead, read_last_segment)
        segmentation = self._segmentation(key)
        step = self._step(segmentation, frozenset(key[1]), prefetch, bool(recompute_ahead))
        return step.timeline, segmentation

    # -- one simulation -----------------------------------------------------------
    def _simulate(self, key, segmentation, offloaded=frozenset(), prefetch=1, flops_per_byte=0,
                  replay=False, ahead=False):
        """Simulates the plan of `key` (tf.gradients' step where `segmentation` is None),
        remembers its timeline as the last (self._last), and returns its Prediction
        (replayed through the allocator where `replay`)."""
        step = self._step(segmentation, offloaded, prefetch, ahead)
        self._last = _LastRun(key, step.timeline, segmentation)
        return self._prediction_of(step, offloaded, flops_per_byte, ahead, replay)

    def _step(self, segmentation, offloaded=frozenset(), prefetch=1, ahead=False):
        """The SimulatedStep of a plan (tf.gradients' where `segmentation` is None)."""
        forward_pass = self._forward_pass(unforwardable_outputs(self.graph, segmentation))
        return simulate(self._setup, forward_pass, segmentation, offloaded, prefetch, ahead)

    def _forward_pass(self, unforwardable):
        """The forward pass where the kernels of `unforwardable` (forwarded outputs)
        allocate their outputs: simulated once per set, copied per plan."""
        forward_pass = self._forward_passes.get(unforwardable)
        if forward_pass is None:
            forward_pass = self._forward_passes[unforwardable] = run_forward(
                self.graph, unforwardable, self._setup.owners)
        return forward_pass

    def _prediction_of(self, step, offloaded, flops_per_byte, ahead, replay):
        """The Prediction of a SimulatedStep."""
        graph, timeline, segmentation = self.graph, step.timeline, step.segmentation
        out_bytes = sum(graph.size[t] for t in offloaded)
        back_bytes = sum(graph.size[t] for t in step.copied_back)
        peak, at = timeline.peak()
        return Prediction(
            peak_bytes=peak, resident_bytes=self._resident,
            peak_at=self.describe(timeline.labels[at], segmentation),
            recompute_flops=int(step.recompute_flops) + (
                0 if segmentation is None else self._loops_recompute_flops),
            forward_flops=self.forward_flops, loop_sums_flops=self.loop_sums_flops,
            checkpoint_bytes=0 if segmentation is None else sum(
                graph.size[t] for t in segmentation.reads_forward.held),
            segments=0 if segmentation is None else len(segmentation.order),
            recomputed_ops=0 if segmentation is None else sum(
                len(segmentation.executed(head)) for head in segmentation.order),
            breakdown=timeline.live_at(at),
            host_bytes=out_bytes, moved_bytes=out_bytes + back_bytes,
            transfer_flops=self._transfer_flops(offloaded, step.copied_back, flops_per_byte),
            deferred_gradients=step.deferred_gradients,
            reads_checkpoints=(segmentation is not None
                               and segmentation.reads_forward.read_checkpoints),
            recomputes_ahead=segmentation is not None and ahead,
            reads_last_segment=segmentation is not None and segmentation.reads_last_segment,
            **(self._replayed(timeline, segmentation) if replay else {}))

    def _replayed(self, timeline, segmentation):
        """The Prediction fields of the step replayed through the allocator (none without one)."""
        if self.allocator is None:
            return {}
        resident = [kind == "resident" for kind in timeline.kinds]
        # What is held beside the step through it (an optimizer's slots) is added, not
        # replayed: replayed first, it took the regions the step's tensors later fit in,
        # and the GPT of benchmarks/keras_fit_memory.py under Adam was predicted 314.5
        # MiB where 231-252 were measured (259.4 so; AMD EPYC without AVX-512).
        beside = [kind == BESIDE and end >= FOREVER
                  for kind, end in zip(timeline.kinds, timeline.ends)]
        held, at = allocator_lib.replayed_peak(
            self.allocator, timeline.starts, timeline.ends,
            [0 if out else nbytes for out, nbytes in zip(beside, timeline.bytes)],
            resident, len(timeline.labels), timeline.pieces)
        held += sum(nbytes for out, nbytes in zip(beside, timeline.bytes) if out)
        return {"allocator_peak_bytes": held,
                "allocator_peak_at": self.describe(timeline.labels[at], segmentation)}

    # -- naming buffers -----------------------------------------------------------
    def _largest_at(self, timeline, step, top):
        """(bytes, kind, what) of the `top` largest buffers alive at `step`."""
        return [(nbytes, kind, self._owner_name(owner, kind))
                for nbytes, kind, owner in timeline.alive_at(step)[:top]]

    def _owner_name(self, owner, kind):
        """What a buffer of `kind` owned by `owner` (memsave.planner.timeline) holds,
        in words."""
        if isinstance(owner, OpOwner):
            return self._op_buffer_name(self.graph.ops[owner.op].name, kind)
        if not isinstance(owner, TensorOwner):  # (the step's own: THE_STEP)
            return f"held beside the gradients: {self.beside.source}"
        name = self.graph.tensors[owner.tensor].name
        if kind == BESIDE:
            return f"the update of {name} ({self.beside.source})"
        return f"gradient of {name}" if kind.startswith("gradients") else name

    @staticmethod
    def _op_buffer_name(name, kind):
        """What a buffer of `kind` that op `name`'s gradient makes or keeps holds."""
        if kind == "loop":
            return f"what the gradient of loop {name} keeps per iteration"
        if kind in ("forward", "recomputed"):
            return f"what the gradient of {name} keeps of its run"
        return f"temporaries of the gradient of {name}"


def _plan_key(checkpoints, offloaded=(), prefetch=1, flops_per_byte=0, read_checkpoints=False,
              recompute_ahead=False, read_last_segment=False):
    """The key MemoryModel keeps a plan's prediction under."""
    return (tuple(sorted(set(checkpoints))), tuple(sorted(set(offloaded))),
            (prefetch, flops_per_byte) if offloaded else None, bool(read_checkpoints),
            bool(recompute_ahead), bool(read_last_segment))
