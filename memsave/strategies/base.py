"""What a checkpoint strategy is, the factories that build one, and the combinator.

A strategy is a callable `strategy(region) -> list[Choice]`: given the forward
region (a memsave.planner.Problem, which answers as the memsave.region.ForwardRegion
and also holds the environment and the memory model) it names the tensors to keep,
each with the reason it was kept (and, for a planner, whether to offload it). A
planner may return a `Selection` instead: the choices with hints on how the plan
runs them, which it decided with the memory model. Simple
strategies are tensor predicates turned into strategies by `keep_if`; `union`
combines any number of strategies.
"""

import collections
import dataclasses
from typing import Optional, Sequence

from memsave.graph.select import TensorSet

# offload: None where the call's `offload=` decides (every checkpoint large enough),
# True/False where a planner decided (memsave.budget(..., offload=...)).
Choice = collections.namedtuple("Choice", ["tensor", "reason", "offload"], defaults=[None])


@dataclasses.dataclass(frozen=True)
class Selection:
    """A strategy's choices and what it decided about running them (None: the plan
    decides, with the memory model).

    Attributes:
      choices: the Choices.
      read_checkpoints: whether segments read the checkpoint they end at as the
        forward pass made it, rather than recomputing it.
      recompute_ahead: whether each segment recomputes beside the backward pass of
        the segment after it.
      read_last_segment: whether the last segment's gradients read its tensors as the
        forward pass made them, rather than recomputing them.
      order_backward: whether each segment's large gradient ops run one after another.
      plain: why plain tf.gradients is the better plan (with no choices).
      calibrated: the scale between the model's bytes and a measured step the strategy
        planned with (memsave.planner.calibrated.Calibrated), or None.
    """
    choices: Sequence[Choice] = ()
    read_checkpoints: Optional[bool] = None
    recompute_ahead: Optional[bool] = None
    read_last_segment: Optional[bool] = None
    order_backward: bool = False
    plain: Optional[str] = None
    calibrated: Optional[object] = None


def selection_of(result):
    """A strategy's result as a Selection (a list of choices or tensors is one with no
    hints)."""
    return result if isinstance(result, Selection) else Selection(result)


def keep_if(predicate, reason):
    """A strategy keeping every region tensor `t` with `predicate(t, region)`.

    Args:
      predicate: callable (tensor, region) -> bool.
      reason: text recorded in the report for each kept tensor; may use
        `{op_type}`.
    Returns:
      A strategy.
    """
    def strategy(region):
        return [Choice(t, reason.format(op_type=t.op.type))
                for t in region.tensors() if predicate(t, region)]
    strategy.__name__ = f"keep_if({reason.format(op_type='<op type>')})"
    return strategy


def union(*strategies):
    """A strategy keeping what any of `strategies` keeps (first reason wins). Members'
    hints (a planner's Selection) are dropped: the union is a plan none of them made, so
    the plan decides how to run it."""
    def strategy(region):
        seen, choices = TensorSet(), []
        for member in strategies:
            for choice in selection_of(member(region)).choices:
                if choice.tensor not in seen:
                    seen.add(choice.tensor)
                    choices.append(choice)
        return choices
    strategy.__name__ = "union(" + ", ".join(s.__name__ for s in strategies) + ")"
    return strategy


def explicit(tensors):
    """A strategy keeping exactly `tensors` (already resolved graph tensors)."""
    def strategy(region):
        return [Choice(t, "listed by the caller") for t in tensors]
    strategy.__name__ = "explicit"
    return strategy
