"""Build small ONNX Loop graphs with the IR and compare their gradients with the unrolled loop in PyTorch."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

import revgraph as rg
from revgraph.ir import Graph, Node, ValueInfo

F64 = np.dtype(np.float64)
POLICIES = ("store", "recompute", "products", "sqrt", 2)


def n(op, ins, outs, name=None, **attrs):
    outs = outs if isinstance(outs, list) else [outs]
    return Node(op, ins, outs, attrs, name or f"{op}_{outs[0]}")


def const(name, value, dtype=None):
    return n("Constant", [], name, f"const_{name}", value=np.asarray(value, dtype=dtype))


def body(nodes, carried, cond_out="cond_out", scan=(), types=None, iter_name="i", cond_name="cond_in"):
    """A Loop body: ``carried`` is a list of (input name, output name); ``scan`` lists scan output names.
    ``types`` maps names to shapes (float64); when ``cond_out`` is ``"cond_out"`` it is cond_in passed on."""
    types = types or {}
    if cond_out == "cond_out":
        nodes = [*nodes, n("Identity", [cond_name], "cond_out", "pass_cond")]
    return Graph(
        nodes,
        [ValueInfo(iter_name, np.int64, ()), ValueInfo(cond_name, np.bool_, ())]
        + [ValueInfo(i, F64, types.get(i)) for i, _ in carried],
        [ValueInfo(cond_out, np.bool_, ())]
        + [ValueInfo(o, F64, types.get(o)) for _, o in carried]
        + [ValueInfo(s, F64, None) for s in scan],
    )


def loop(b, trip, initial, outputs, name="loop", cond="true"):
    """A Loop node over body ``b``; ``trip`` and ``cond`` name values ("" to omit)."""
    return n("Loop", [trip, cond, *initial], list(outputs), name, body=b)


def graph(nodes, inputs, outputs, inits=None):
    """A float64 graph with scalar outputs; ``inputs`` maps names to shapes."""
    inits = {"true": np.array(True), **(inits or {})}
    return Graph(nodes, [ValueInfo(k, F64, s) for k, s in inputs.items()], [ValueInfo(o, F64, ()) for o in outputs],
                 inits)


def grads(g, feeds, wrt, loss=None, policy="store", backends=("onnxruntime", "reference"), accumulate="sum"):
    """revgraph's gradients of ``loss`` under each backend (which must agree); checks the gradient graph."""
    gg = rg.gradient(g, loss=loss, wrt=wrt, checkpoint=policy, accumulate=accumulate)
    onnx.checker.check_model(rg.to_onnx(gg), full_check=True)
    names = gg.output_names[len(g.outputs):]
    results = []
    for backend in backends:
        out = rg.Session(gg, backend=backend).run(feeds)
        results.append({w: out[k] for w, k in zip(wrt, names, strict=True)})
    for other in results[1:]:
        for w in wrt:
            np.testing.assert_allclose(other[w], results[0][w], rtol=1e-10, atol=1e-12, err_msg=f"backends, {w}")
    return results[0]


def torch_grads(fn, feeds, wrt):
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k in wrt) for k, v in feeds.items()}
    out = fn(**t)
    gs = torch.autograd.grad(out, [t[w] for w in wrt], allow_unused=True)
    return {w: np.zeros_like(feeds[w]) if g is None else g.numpy() for w, g in zip(wrt, gs, strict=True)}


def assert_close(ours, theirs, rtol=1e-9, atol=1e-10):
    for k in theirs:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=rtol, atol=atol, err_msg=k)


def three_nested_loops() -> tuple[Graph, dict[str, np.ndarray], Callable]:
    """innermost: s <- s * w (2 steps); middle: 3 steps of it plus a sin; outer: 2 steps of the middle, then
    loss = sum(s). Returns the graph, feeds and the unrolled PyTorch function (of s0 and w, returning s)."""
    inner = body([n("Mul", ["s3_in", "w"], "s3_out")], [("s3_in", "s3_out")], iter_name="k", cond_name="c3")
    middle = body([loop(inner, "M2", ["s2_in"], ["s2_mid"], "inner"), n("Sin", ["s2_mid"], "s2_out")],
                  [("s2_in", "s2_out")], iter_name="j", cond_name="c2")
    outer = body([loop(middle, "M3", ["s1_in"], ["s1_mid"], "middle"), n("Mul", ["s1_mid", "w"], "s1_out")],
                 [("s1_in", "s1_out")])
    trips = {"M": np.array(2, np.int64), "M2": np.array(2, np.int64), "M3": np.array(3, np.int64)}
    g = graph([loop(outer, "M", ["s0"], ["s"], "outer"), n("ReduceSum", ["s"], "loss", keepdims=0)],
              {"s0": (2,), "w": (2,)}, ["loss"], trips)
    feeds = {"s0": np.array([0.7, -0.4]), "w": np.array([1.1, 0.9])}

    def unrolled(s0, w):
        s = s0
        for _ in range(2):
            for _ in range(3):
                for _ in range(2):
                    s = s * w
                s = torch.sin(s)
            s = s * w
        return s

    return g, feeds, unrolled


def branch(nodes, outputs, name):
    """An If branch: a graph of ``nodes`` without inputs whose ``outputs`` are float64."""
    return Graph(nodes, [], [ValueInfo(o, F64, None) for o in outputs], name=name)


def if_node(cond, then, other, outputs, name="if"):
    """An If node on ``cond`` with the branches ``then`` and ``other``."""
    return n("If", [cond], list(outputs), name, then_branch=then, else_branch=other)


def scan_graph(in_dir, out_dir, in_axis, out_axis, shape_x):
    """A Scan RNN with these directions and axes, h_t = tanh(h_{t-1} * w + x_t), y_t = 2 h_t stacked, and the loss
    sum(u * Y) + sum(h); the graph and the cotangent ``u``."""
    sb = Graph(
        [n("Mul", ["h_in", "w"], "hw"), n("Add", ["hw", "xt"], "pre"), n("Tanh", ["pre"], "h_out"), const("two", 2.0),
         n("Mul", ["h_out", "two"], "y_t")],
        [ValueInfo("h_in", F64, (3,)), ValueInfo("xt", F64, (3,))],
        [ValueInfo("h_out", F64, (3,)), ValueInfo("y_t", F64, (3,))],
    )
    scan = Node("Scan", ["h0", "x"], ["h", "Y"], {"body": sb, "num_scan_inputs": 1, "scan_input_directions": [in_dir],
                                                  "scan_output_directions": [out_dir], "scan_input_axes": [in_axis],
                                                  "scan_output_axes": [out_axis]}, "scan")
    nodes = [scan, n("Mul", ["Y", "u"], "uy"), n("ReduceSum", ["uy"], "ys", keepdims=0),
             n("ReduceSum", ["h"], "hs", keepdims=0), n("Add", ["ys", "hs"], "loss")]
    t = shape_x[in_axis]
    u_shape = (t, 3) if out_axis == 0 else (3, t)
    u = np.linspace(-1, 1, 3 * t).reshape(u_shape)
    return graph(nodes, {"h0": (3,), "x": shape_x, "w": (3,)}, ["loss"], {"u": u}), u


def taylor_sin_body():
    """A Loop body summing sin's Taylor series, term_{k+1} = -term_k * x^2 / ((2k+2)(2k+3)), until |term| < 1e-12."""
    return body(
        [
            n("Mul", ["x", "x"], "x2"),
            n("Mul", ["term_in", "x2"], "tx2"),
            n("Neg", ["tx2"], "ntx2"),
            const("two", 2, np.int64),
            const("three", 3, np.int64),
            n("Mul", ["i", "two"], "i2"),
            n("Add", ["i2", "two"], "d1"),
            n("Add", ["i2", "three"], "d2"),
            n("Mul", ["d1", "d2"], "den_i"),
            n("Cast", ["den_i"], "den", to=11),
            n("Div", ["ntx2", "den"], "term_out"),
            n("Add", ["sum_in", "term_out"], "sum_out"),
            n("Abs", ["term_out"], "aterm"),
            const("eps", 1e-12),
            n("GreaterOrEqual", ["aterm", "eps"], "cond_next"),
        ],
        [("term_in", "term_out"), ("sum_in", "sum_out")],
        cond_out="cond_next",
    )


def taylor_cond_nodes(prefix=""):
    """The nodes of the Taylor loop's first condition, |x| >= eps0 (names prefixed with ``prefix``)."""
    return [n("Abs", ["x"], f"{prefix}ax"), n("GreaterOrEqual", [f"{prefix}ax", "eps0"], f"{prefix}go")]


def onnx_loop_model() -> onnx.ModelProto:
    """h <- tanh(h @ W) for a trip count of 3, then a sequence of h and a dropout (an identity at inference)."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h", "W"], ["m"]), helper.make_node("Tanh", ["m"], ["h2"]),
         helper.make_node("Identity", ["c"], ["c2"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("c2", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h2", TensorProto.FLOAT, [2, 2])])
    nodes = [helper.make_node("Loop", ["n", "", "x"], ["h"], body=body, name="loop"),
             helper.make_node("Dropout", ["h"], ["d"], name="drop"),
             helper.make_node("ReduceSum", ["d"], ["loss"], keepdims=0, name="sum")]
    graph = helper.make_graph(
        nodes, "looped", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.array([[0.5, -0.2], [0.3, 0.8]], np.float32), "W"),
         numpy_helper.from_array(np.array(3, np.int64), "n")], doc_string="a loop")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    helper.set_model_props(model, {"author": "test", "revgraph.note": "kept"})
    return model


def body_initializer_models() -> dict:
    """Valid ONNX that tf2onnx and jax2onnx write: subgraphs holding their own initializers ``k`` = [0.5, 1.5].
    loop: h <- tanh(h * k + w), 3 times; if: then-branch x * k + w (an If on a true input); scan: the same step
    over a scan input of 3 rows added to it. loss = sum of the result."""
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper as nh

    F = TP.DOUBLE
    k = nh.from_array(np.array([0.5, 1.5]), "k")
    vi = lambda name, t=F, s=(2,): h.make_tensor_value_info(name, t, list(s))
    step = [h.make_node("Mul", ["h_in", "k"], ["m"]), h.make_node("Add", ["m", "w"], ["a"]),
            h.make_node("Tanh", ["a"], ["h_out"])]
    loop_body = h.make_graph([*step, h.make_node("Identity", ["c_in"], ["c_out"])], "loop_body",
                             [vi("i", TP.INT64, ()), vi("c_in", TP.BOOL, ()), vi("h_in")],
                             [vi("c_out", TP.BOOL, ()), vi("h_out")], initializer=[k])
    then = h.make_graph([h.make_node("Mul", ["x", "k"], ["tm"]), h.make_node("Add", ["tm", "w"], ["t_out"])], "then",
                        [], [vi("t_out")], initializer=[k])
    other = h.make_graph([h.make_node("Identity", ["x"], ["e_out"])], "else", [], [vi("e_out")])
    scan_body = h.make_graph([h.make_node("Add", ["h_in", "row"], ["hr"]), h.make_node("Mul", ["hr", "k"], ["m"]),
                              h.make_node("Add", ["m", "w"], ["a"]), h.make_node("Tanh", ["a"], ["h_out"]),
                              h.make_node("Identity", ["h_out"], ["y_row"])], "scan_body",
                             [vi("h_in"), vi("row")], [vi("h_out"), vi("y_row")], initializer=[k])
    tail = [h.make_node("ReduceSum", ["r"], ["loss"], keepdims=0)]
    inputs = [vi("x"), vi("w")]
    graphs = {
        "loop": h.make_graph([h.make_node("Loop", ["T", "", "x"], ["r"], body=loop_body), *tail], "g", inputs,
                             [vi("loss", F, ())], [h.make_tensor("T", TP.INT64, [], [3])]),
        "if": h.make_graph([h.make_node("If", ["c"], ["r"], then_branch=then, else_branch=other), *tail], "g",
                           inputs, [vi("loss", F, ())], [h.make_tensor("c", TP.BOOL, [], [True])]),
        "scan": h.make_graph([h.make_node("Scan", ["x", "rows"], ["hT", "r"], body=scan_body, num_scan_inputs=1),
                              *tail], "g", inputs, [vi("loss", F, ())],
                             [nh.from_array(np.arange(6.0).reshape(3, 2) / 10, "rows")]),
    }
    return {name: onnx.helper.make_model(gr, opset_imports=[onnx.helper.make_opsetid("", 21)])
            for name, gr in graphs.items()}


def body_initializer_reference(name: str, x, w):
    k = torch.tensor([0.5, 1.5], dtype=torch.float64)
    if name == "loop":
        h = x
        for _ in range(3):
            h = torch.tanh(h * k + w)
        return h.sum()
    if name == "if":
        return (x * k + w).sum()
    h, ys = x, []
    for row in torch.arange(6.0, dtype=torch.float64).reshape(3, 2) / 10:
        h = torch.tanh((h + row) * k + w)
        ys.append(h)
    return torch.stack(ys).sum()
