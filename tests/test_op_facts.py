"""The table of op facts (memsave.planner.op_facts) and what opinfo derives from it."""

import pytest

from memsave.planner import op_facts, opinfo
from memsave.region import SHAPE_READER_OP_TYPES


def test_an_unknown_type_reads_everything_and_shares_nothing():
    facts = op_facts.facts_of("NoSuchOp")
    assert facts is op_facts.UNKNOWN and op_facts.facts_of(None) is op_facts.UNKNOWN
    assert opinfo.gradient_reads("NoSuchOp", 2, 3) == ((0, 1), (0, 1, 2))
    assert not (facts.aliases_input or facts.forwarded_output or facts.expensive)


def test_a_row_holds_every_fact_of_its_type():
    mul = op_facts.OP_FACTS["Mul"]
    assert mul.gradient_reads == ((0, 1), ())
    assert mul.reads_per_input == {0: ((1,), ()), 1: ((0,), ())}
    assert mul.broadcast_temporaries == 1 and mul.elementwise_gradient
    assert mul.constant_scaling_inputs == (0, 1) and not mul.heavy


def test_the_shape_readers_of_the_region_pass_no_gradient():
    assert all(not op_facts.facts_of(t).differentiable for t in SHAPE_READER_OP_TYPES)


def test_the_derived_sets():
    assert opinfo.HEAVY_OP_TYPES == opinfo.MATMUL_LIKE | opinfo.CONV_LIKE | {"Einsum"}
    assert opinfo.HEAVY_OP_TYPES < opinfo.EXPENSIVE_OP_TYPES
    assert opinfo.FORWARDED_OUTPUTS == {"SparseSoftmaxCrossEntropyWithLogits": (0, 1),
                                        "BiasAdd": (0, 0)}
    assert "Reshape" in op_facts.types_where(lambda f: f.aliases_input)
    assert opinfo.passes_gradient_through("AddN", 5)
    assert not opinfo.passes_gradient_through("Sub", 1)


def test_a_fact_given_twice_must_agree(monkeypatch):
    monkeypatch.setattr(op_facts, "_ROWS", {}, raising=False)
    op_facts._given(["Foo"], aliases_input=True)
    op_facts._given(["Foo"], aliases_input=True)
    with pytest.raises(ValueError, match="aliases_input"):
        op_facts._given(["Foo"], aliases_input=False)
