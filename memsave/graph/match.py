"""OpMatcher: a small, readable way for tests to assert graph structure.

    OpMatcher('c0').input_ops('a0', 'b0')(graph.get_operation_by_name('c0'))

Matchers nest: `OpMatcher('h').input_ops('f', OpMatcher('g').input_ops('c', 'a'))`.
"""

import re


class OpMatcher:
    """Matches an op by its name (or identity, or a predicate) and, optionally, its neighbours.

    Args:
      positive_filter: a regex that must match the whole `op.name`; an op or a
        tensor (matches that op, or the tensor's producer, by identity); or a
        predicate taking an op.
    Raises:
      TypeError: for anything else.
    """

    def __init__(self, positive_filter):
        if isinstance(positive_filter, str):
            pattern = re.compile(positive_filter)
            self._filter = lambda op: pattern.fullmatch(op.name) is not None
            self._describe = positive_filter
        elif hasattr(positive_filter, "node_def"):
            self._filter = lambda op, wanted=positive_filter: op is wanted
            self._describe = positive_filter.name
        elif hasattr(positive_filter, "value_index"):
            self._filter = lambda op, wanted=positive_filter.op: op is wanted
            self._describe = positive_filter.op.name
        elif callable(positive_filter):
            self._filter = positive_filter
            self._describe = getattr(positive_filter, "__name__", "predicate")
        else:
            raise TypeError("memsave.graph: OpMatcher takes a name regex, an op, a tensor or "
                            f"a predicate, got {type(positive_filter).__name__}")
        self._input_ops = None
        self._output_ops = None
        self._control_input_ops = None

    def input_ops(self, *matchers):
        """Requires the producers of the data inputs to match, one matcher per input, in order.

        Args:
          *matchers: OpMatchers, or anything `OpMatcher` accepts.
        Returns:
          self, to chain calls.
        """
        self._input_ops = [_as_matcher(m) for m in matchers]
        return self

    def output_ops(self, *matchers):
        """Requires the consumers of the outputs to match, as a set of matchers.

        There must be as many distinct consumers as matchers, and every matcher
        must match one of them.

        Returns:
          self, to chain calls.
        """
        self._output_ops = [_as_matcher(m) for m in matchers]
        return self

    def control_input_ops(self, *matchers):
        """Requires the control inputs to match, one matcher per control input, in order.

        Returns:
          self, to chain calls.
        """
        self._control_input_ops = [_as_matcher(m) for m in matchers]
        return self

    def __call__(self, op):
        """True if `op` (or the producer of a tensor) matches.

        Args:
          op: a `tf.Operation`, or a tensor standing for its producer.
        Returns:
          bool.
        """
        if hasattr(op, "value_index"):
            op = op.op
        if not self._filter(op):
            return False
        if self._input_ops is not None and not _all_match(self._input_ops,
                                                          [t.op for t in op.inputs]):
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

    def __repr__(self):
        return f"OpMatcher({self._describe!r})"


def _as_matcher(value):
    return value if isinstance(value, OpMatcher) else OpMatcher(value)


def _all_match(matchers, ops):
    return len(matchers) == len(ops) and all(m(op) for m, op in zip(matchers, ops))
