"""OpMatcher: a small, readable way for tests to assert graph structure.

    OpMatcher('c0').input_ops('a0', 'b0')(graph.get_operation_by_name('c0'))
"""

import re


class OpMatcher:
    """Matches an op by a regex on its name and, optionally, its neighbours.

    Args:
      positive_filter: a regex (full match on `op.name`), or a predicate on ops.
    """

    def __init__(self, positive_filter):
        if isinstance(positive_filter, str):
            pattern = re.compile(positive_filter)
            self._filter = lambda op: pattern.fullmatch(op.name) is not None
        else:
            self._filter = positive_filter
        self._input_ops = None
        self._output_ops = None
        self._control_input_ops = None

    def input_ops(self, *matchers):
        """Requires the data inputs' producers to match, in order."""
        self._input_ops = [_as_matcher(m) for m in matchers]
        return self

    def output_ops(self, *matchers):
        """Requires the consumers of the outputs to match, as a set of matchers."""
        self._output_ops = [_as_matcher(m) for m in matchers]
        return self

    def control_input_ops(self, *matchers):
        """Requires the control inputs to match, in order."""
        self._control_input_ops = [_as_matcher(m) for m in matchers]
        return self

    def __call__(self, op):
        if not self._filter(op):
            return False
        if self._input_ops is not None and not _all_match(self._input_ops, [t.op for t in op.inputs]):
            return False
        if self._control_input_ops is not None and not _all_match(self._control_input_ops,
                                                                  list(op.control_inputs)):
            return False
        if self._output_ops is not None:
            consumers = list(dict.fromkeys(c for t in op.outputs for c in t.consumers()))
            if len(consumers) != len(self._output_ops):
                return False
            return all(any(m(c) for c in consumers) for m in self._output_ops)
        return True


def _as_matcher(value):
    if isinstance(value, OpMatcher):
        return value
    if hasattr(value, "node_def"):  # an op: match it by identity
        return OpMatcher(lambda op, wanted=value: op is wanted)
    return OpMatcher(value)


def _all_match(matchers, ops):
    return len(matchers) == len(ops) and all(m(op) for m, op in zip(matchers, ops))
