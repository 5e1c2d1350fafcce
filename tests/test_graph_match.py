"""OpMatcher, the structure assertions the other graph tests rely on."""

import pytest
import tensorflow as tf

from memsave.graph import OpMatcher


def test_matcher_on_classic_graph(run_graph, classic_graph):
    def build(graph, _):
        t = classic_graph()
        h, g, c = t["h"].op, t["g"].op, t["c"].op
        assert OpMatcher("foo/bar/h")(h)
        assert OpMatcher(r"foo/bar/[gh]")(h) and OpMatcher(r"foo/bar/[gh]")(g)
        # The regex must match the whole name.
        assert not OpMatcher("h")(h) and not OpMatcher("foo/bar")(h)
        assert OpMatcher("foo/bar/h").input_ops("foo/bar/f", "foo/bar/g")(h)
        # Inputs are matched in order and all of them.
        assert not OpMatcher("foo/bar/h").input_ops("foo/bar/g", "foo/bar/f")(h)
        assert not OpMatcher("foo/bar/h").input_ops("foo/bar/f")(h)
        # Nested matchers, tensors and ops as matchers, predicates.
        assert OpMatcher("foo/bar/h").input_ops(
            "foo/bar/f", OpMatcher("foo/bar/g").input_ops(t["c"], "a"))(h)
        assert not OpMatcher("foo/bar/h").input_ops(
            "foo/bar/f", OpMatcher("foo/bar/g").input_ops("a", t["c"]))(h)
        assert OpMatcher(g).input_ops(c, t["a"].op)(g)
        assert OpMatcher(lambda op: op.type == "AddV2").input_ops(".*", ".*")(g)
        assert not OpMatcher(lambda op: op.type == "Const")(g)
        # A tensor stands for its producer when matched.
        assert OpMatcher("foo/c")(t["c"])
        # Control inputs.
        assert OpMatcher("foo/bar/h").control_input_ops("foo/c")(h)
        assert not OpMatcher("foo/bar/h").control_input_ops()(h)
        assert OpMatcher("foo/bar/g").control_input_ops()(g)
        # Consumers, as a set.
        assert OpMatcher("foo/c").output_ops("foo/bar/g", "foo/bar/e", "foo/bar/f")(c)
        assert not OpMatcher("foo/c").output_ops("foo/bar/e", "foo/bar/f")(c)
        assert not OpMatcher("foo/c").output_ops("foo/bar/e", "foo/bar/f", "foo/bar/h")(c)
        assert OpMatcher("a").output_ops("foo/c", "foo/bar/g")(t["a"].op)
        return None

    run_graph(build)


def test_matcher_rejects_bad_filters_and_reprs():
    with pytest.raises(TypeError, match="OpMatcher"):
        OpMatcher(3)
    assert repr(OpMatcher("c0")) == "OpMatcher('c0')"
    with tf.Graph().as_default():
        a = tf.constant(1.0, name="a")
        assert repr(OpMatcher(a)) == "OpMatcher('a')"
