"""The rule algebra (revgraph.autodiff.algebra.Val): one node per operation, scalars in the operand's dtype, result
types that are the operand's only where the shapes say so (a wrong one breaks second-order gradients), and the
strong-zero product as the Ctx's."""

from __future__ import annotations

import numpy as np
import pytest

from revgraph.autodiff.algebra import Val, name_of, where
from revgraph.autodiff.context import Ctx, Options
from revgraph.autodiff.emitter import Emitter
from revgraph.ir import ValueInfo

F64 = np.dtype(np.float64)


def _ctx(types: dict[str, tuple], **options) -> Ctx:
    e = Emitter({k: ValueInfo(k, F64 if len(v) < 2 else v[1], v[0]) for k, v in types.items()}, set(types), 21)
    return Ctx(e, None, (), finite=True, singular=False, risky=frozenset(), producers={}, reach=frozenset(),
               options=Options(**options), backward=None)


def test_operators_emit_one_node_each_with_scalars_in_the_operands_dtype():
    ctx = _ctx({"y": ((2, 3),)})
    y = ctx.val("y")
    r = 1 - y * y
    ops = [(n.op_type, n.inputs) for n in ctx.e.nodes]
    assert [o for o, _ in ops] == ["Mul", "Constant", "Sub"]
    assert ops[0][1] == ["y", "y"] and ops[2][1] == [ctx.e.nodes[1].outputs[0], ctx.e.nodes[0].outputs[0]]
    const = ctx.e.nodes[1].attrs["value"]
    assert const.dtype == F64 and const == 1.0
    assert ctx.e.types[r.name].shape == (2, 3) and ctx.e.types[r.name].dtype == F64
    assert name_of(r) == r.name and name_of("z") == "z" and name_of(None) is None


def test_a_broadcast_result_is_not_typed_as_the_smaller_operand():
    ctx = _ctx({"b": ((3,),), "a": ((2, 3),)})
    a, b = ctx.vals("a", "b")
    assert ctx.e.types[(b * a).name].shape == (2, 3)  # inferred, not b's (3,)
    assert ctx.e.types[(a * b).name].shape == (2, 3)


def test_cast_like_keeps_the_first_operands_shape():
    ctx = _ctx({"p": ((2,), np.dtype(np.int64)), "x": ((),)})
    p = ctx.val("p").cast_like("x")
    assert ctx.e.types[p.name].shape == (2,) and ctx.e.types[p.name].dtype == F64


def test_where_types_scalar_branches_by_the_value_branch_or_like():
    ctx = _ctx({"c": ((4,), np.dtype(bool)), "v": ((4,),)})
    c, v = ctx.vals("c", "v")
    w = where(c, 0.0, v)
    assert ctx.e.values[ctx.e.nodes[-1].inputs[1]].dtype == F64 and ctx.e.types[w.name].shape == (4,)
    both = where(c, 1.0, 0.0, like=v)
    assert ctx.e.types[both.name].dtype == F64
    with pytest.raises(TypeError):
        where(c, 1.0, 0.0)


@pytest.mark.parametrize("strong,where_nodes", [(True, 1), (False, 0)])
def test_times_is_the_strong_zero_product(strong, where_nodes):
    ctx = _ctx({"g": ((3,),), "d": ((3,),)}, strong_zeros=strong)
    g = ctx.val("g")
    g.times("d")  # reads=None: d may be inf at finite values, so g == 0 is tested when strong zeros are on
    assert sum(n.op_type == "Where" for n in ctx.e.nodes) == where_nodes
    assert sum(n.op_type == "Mul" for n in ctx.e.nodes) == 1


def test_comparisons_are_methods_and_give_bool_values():
    ctx = _ctx({"x": ((5,),)})
    x = ctx.val("x")
    m = x.gt(0) & x.lt(1)
    assert ctx.e.types[m.name].dtype == np.dtype(bool) and isinstance(m, Val)
    assert [n.op_type for n in ctx.e.nodes if n.op_type != "Constant"] == ["Greater", "Less", "And"]
