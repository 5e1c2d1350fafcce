"""A step's live memory over time, as the memory model simulates it: for pictures.

The model's timeline has a step per op (thousands); a Curve keeps at most MAX_POINTS
of them, each point the most bytes alive over the steps it stands for (so the peak
survives), and where each phase of the step starts: the forward pass, the backward
pass, each recomputed segment, the update after the last gradient.
"""

import dataclasses
from typing import Tuple

MAX_POINTS = 400


@dataclasses.dataclass(frozen=True)
class Curve:
    """Live bytes over one step.

    Attributes:
      live_bytes: per point, the most bytes alive over the steps it stands for.
      phases: (point, name) where each phase starts, in order.
      peak_bytes: the most bytes alive at once.
      peak_at: where that is, in words.
      largest_at_peak: (bytes, what) of the largest buffers alive at the peak.
    """
    live_bytes: Tuple[int, ...]
    phases: Tuple[Tuple[int, str], ...]
    peak_bytes: int
    peak_at: str
    largest_at_peak: Tuple[Tuple[int, str], ...] = ()


_LATE_PHASES = {"final": "ops kept whole", "deferred": "weight gradients made last",
                "update": "update"}


def phase_name(label):
    """The phase of a timeline label (phase, op, segment index): "forward", "backward"
    (tf.gradients', and the step that seeds the gradients), "segment k" (the plan's k-th
    segment in backward order), or a late phase."""
    phase, _, index = label
    if phase == "forward":
        return "forward"
    if phase in _LATE_PHASES:
        return _LATE_PHASES[phase]
    if index is not None:
        return f"segment {index + 1}"
    return "backward"


def of_timeline(live, labels, peak_at, largest, points=MAX_POINTS):
    """A Curve of per-step `live` bytes and their timeline `labels`."""
    steps = len(live)
    width = max(1, -(-steps // points))
    sampled = tuple(max(live[i:i + width]) for i in range(0, steps, width))
    phases, current = [], None
    for step, label in enumerate(labels):
        name = phase_name(label)
        if name is not None and name != current:
            phases.append((step // width, name))
            current = name
    return Curve(sampled, tuple(phases), max(live, default=0), peak_at, tuple(largest))
