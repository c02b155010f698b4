"""``LSTM``, ``GRU`` and ``RNN`` are differentiated as the ``Loop`` they are equivalent to (ONNX operator
spec "LSTM", "GRU", "RNN", opset 14), as ``Scan`` is (:mod:`.scan`).

:func:`lower_recurrent` rewrites each such node into primitive operators: per direction, the input
projection ``X W^T (+ Wb + Rb)`` of every time step is one ``MatMul`` before the loop (reversed along time
for the reverse direction), and a ``Loop`` over the sequence carries ``H`` (and ``C``) and applies the
spec's equations at step ``i`` to slice ``i`` of that projection. Its scan output, the hidden state of every
step, is stacked flattened to 1-D (the reference evaluator concatenates scan outputs of rank >= 2 instead of
stacking them) and reshaped afterwards. The ``Loop`` VJP (:mod:`.loop`) then applies, with every residual
policy.

Semantics follow onnxruntime's CPU kernels where the spec leaves room: ``clip`` bounds every gate's
pre-activation (peephole terms included), ``input_forget=1`` sets ``f = 1 - i``, ``activation_alpha`` /
``activation_beta`` are consumed in order by the activations that take them (others take onnxruntime's
defaults), and with ``sequence_lens`` the steps past a sequence's length leave its state unchanged and write
zeros to ``Y``, while the reverse direction reverses each sequence within its own length.
"""

from __future__ import annotations

import numpy as np
import onnx

from ...errors import GraphError
from ...ir import Graph, Node, ValueInfo, fresh_name, is_float_dtype
from ..registry import LOWERED
from .rewrite import replace_nodes

RECURRENT_OPS = ("LSTM", "GRU", "RNN")
for _op in RECURRENT_OPS:
    LOWERED[_op] = "rewritten into the equivalent Loop of primitive ops (ONNX spec equations), then the Loop VJP"
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_DEFAULT_ACTIVATIONS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}
#: activation -> (takes alpha, takes beta, default alpha, default beta), as onnxruntime's rnn_helpers.cc
_ACTIVATION_ARGS = {
    "relu": (False, False, 0.0, 0.0), "tanh": (False, False, 0.0, 0.0), "sigmoid": (False, False, 0.0, 0.0),
    "softsign": (False, False, 0.0, 0.0), "softplus": (False, False, 0.0, 0.0),
    "affine": (True, True, 0.0, 0.0), "scaledtanh": (True, True, 0.0, 0.0), "hardsigmoid": (True, True, 0.2, 0.5),
    "leakyrelu": (True, False, 0.01, 0.0), "thresholdedrelu": (True, False, 0.0, 0.0), "elu": (True, False, 1.0, 0.0),
}
INT64_MIN = np.iinfo(np.int64).min
I64, BOOL = np.dtype(np.int64), np.dtype(bool)


def lower_recurrent(graph: Graph, types: dict[str, ValueInfo], used: set[str]) -> bool:
    """Replace every ``LSTM``, ``GRU`` and ``RNN`` node of ``graph`` and of its subgraphs by its ``Loop``
    form, in place. ``types`` gives dtypes and static shapes where known (Shape-based ops otherwise); ``used``
    holds the names in use and receives the new ones, and ``types`` receives the types of the new values of
    ``graph``'s own scope. Raises :class:`GraphError` (naming the node) for an unknown activation or
    direction, or an input X of unknown dtype. Returns True if anything changed."""
    return replace_nodes(graph, RECURRENT_OPS, lambda node, g: _Lowering(node, g, types, used).run())


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class _Nodes:
    """Appends nodes with fresh names to one node list (the enclosing graph's, or a loop body's)."""

    def __init__(self, used: set[str], base: str, dtype: np.dtype):
        self.used, self.base, self.dtype = used, base, dtype
        self.nodes: list[Node] = []

    def __call__(self, op: str, *inputs: str, n_out: int = 1, **attrs):
        outs = [fresh_name(f"{self.base}/{op}", self.used) for _ in range(n_out)]
        self.nodes.append(Node(op, list(inputs), outs, attrs, outs[0]))
        return outs[0] if n_out == 1 else outs

    def ints(self, values) -> str:
        return self("Constant", value=np.asarray(values, np.int64))

    def scalar(self, value: float) -> str:
        return self("Constant", value=np.asarray(value, self.dtype))

    def zeros(self, shape: str) -> str:
        return self("ConstantOfShape", shape, value=np.zeros(1, self.dtype))

    def output(self, op: str, inputs: list[str], name: str) -> None:
        """A node writing the existing name ``name`` (an output of the node being replaced)."""
        self.nodes.append(Node(op, inputs, [name], {}, fresh_name(f"{self.base}/{op}", self.used)))

    def reverse_time(self, x: str) -> str:
        return self("Slice", x, self.ints([-1]), self.ints([INT64_MIN]), self.ints([0]), self.ints([-1]))


class _Lowering:
    """One recurrent node and the nodes that replace it."""

    def __init__(self, node: Node, graph: Graph, types: dict[str, ValueInfo], used: set[str]):
        self.node, self.graph, self.types, self.used = node, graph, types, used
        self.op = node.op_type
        self.base = node.name or self.op
        vi = self._type(node.inputs[0])
        if vi is None or vi.dtype is None or not is_float_dtype(vi.dtype):
            raise GraphError(f"{node.label()}: the dtype of its input {node.inputs[0]!r} is unknown; declare it to "
                             "differentiate the node")
        self.dtype = vi.dtype
        self.pre = _Nodes(used, self.base, self.dtype)
        attrs = node.attrs
        self.direction = _text(attrs.get("direction", "forward"))
        if self.direction not in ("forward", "reverse", "bidirectional"):
            raise GraphError(
                f"{node.label()}: unknown direction {self.direction!r}; use forward, reverse or bidirectional")
        self.n_dir = 2 if self.direction == "bidirectional" else 1
        self.layout = int(attrs.get("layout", 0))
        self.clip = float(attrs["clip"]) if "clip" in attrs else None
        self.hidden = int(attrs["hidden_size"]) if "hidden_size" in attrs else None
        self.activations = self._activations()

    def _type(self, name: str) -> ValueInfo | None:
        return self.types.get(name) or self.graph.type_of(name)

    def _input(self, k: int) -> str | None:
        ins = self.node.inputs
        return ins[k] if len(ins) > k and ins[k] else None

    def _activations(self) -> list[tuple[str, float, float]]:
        """Per direction, the (name, alpha, beta) of each activation (f, g, h for LSTM)."""
        node, per_dir = self.node, len(_DEFAULT_ACTIVATIONS[self.op])
        names = [_text(a) for a in node.attrs.get("activations", _DEFAULT_ACTIVATIONS[self.op] * self.n_dir)]
        if len(names) == per_dir and self.n_dir == 2:  # onnxruntime repeats one direction's list
            names = names * 2
        if len(names) != per_dir * self.n_dir:
            raise GraphError(f"{node.label()}: {len(names)} activations given, {per_dir * self.n_dir} expected")
        alphas = [float(a) for a in node.attrs.get("activation_alpha", [])]
        betas = [float(b) for b in node.attrs.get("activation_beta", [])]
        out = []
        for name in names:
            spec = _ACTIVATION_ARGS.get(name.lower())
            if spec is None:
                raise GraphError(f"{node.label()}: unknown activation {name!r}; use one of the ONNX spec's "
                                 "Relu, Tanh, Sigmoid, Affine, LeakyRelu, ThresholdedRelu, ScaledTanh, HardSigmoid, "
                                 "Elu, Softsign, Softplus")
            takes_a, takes_b, alpha, beta = spec
            if takes_a and alphas:
                alpha = alphas.pop(0)
            if takes_b and betas:
                beta = betas.pop(0)
            out.append((name.lower(), alpha, beta))
        return out

    # ------------------------------------------------------------------------------------------ building

    def run(self) -> list[Node]:
        node, b = self.node, self.pre
        x = node.inputs[0]
        initial = [self._input(5), self._input(6) if self.op == "LSTM" else None]
        if self.layout:
            x = b("Transpose", x, perm=[1, 0, 2])
            initial = [None if v is None else b("Transpose", v, perm=[1, 0, 2]) for v in initial]
        self.x = x
        self.steps = b("Gather", b("Shape", x), b("Constant", value=np.array(0, np.int64)), axis=0)
        self.batch = b("Shape", x, start=1, end=2)
        self.hsize = b.ints([self.hidden]) if self.hidden is not None else b("Shape", node.inputs[2], start=2, end=3)
        self.lens = self._lengths()
        self.reorder = None
        if self.lens is not None and self.direction != "forward":
            self.reorder = self._sequence_reversal()
        results = [self._direction(d, initial) for d in range(self.n_dir)]
        outs = list(node.outputs) + [""] * (3 - len(node.outputs))
        y, y_h, y_c = outs[:3]
        if y:
            parts = [b("Unsqueeze", r[0], b.ints([1])) for r in results]
            full = parts[0] if len(parts) == 1 else b("Concat", *parts, axis=1)
            if self.layout:
                full = b("Transpose", full, perm=[2, 0, 1, 3])
            b.output("Identity", [full], y)
        for k, name in ((1, y_h), (2, y_c)):
            if not name:
                continue
            parts = [b("Unsqueeze", r[k], b.ints([0])) for r in results]
            full = parts[0] if len(parts) == 1 else b("Concat", *parts, axis=0)
            if self.layout:
                full = b("Transpose", full, perm=[1, 0, 2])
            b.output("Identity", [full], name)
        return b.nodes

    def _lengths(self) -> str | None:
        """``sequence_lens`` as int64, or ``None`` when it is absent or a constant equal to the static length."""
        lens = self._input(4)
        if lens is None:
            return None
        value = self.graph.initializers.get(lens)
        vi = self._type(self.node.inputs[0])
        t_axis = 1 if self.layout else 0
        static_t = vi.shape[t_axis] if vi is not None and vi.shape is not None and len(vi.shape) == 3 else None
        if value is not None and isinstance(static_t, int) and np.all(np.asarray(value) == static_t):
            return None
        return self.pre("Cast", lens, to=onnx.TensorProto.INT64)

    def _sequence_reversal(self) -> str:
        """``[T, B, 1]`` time indices that reverse each sequence within its length (ONNX "ReverseSequence")."""
        b = self.pre
        s = b("Unsqueeze", b("Range", b("Constant", value=np.array(0, np.int64)), self.steps,
                             b("Constant", value=np.array(1, np.int64))), b.ints([1]))
        lens = b("Unsqueeze", self.lens, b.ints([0]))
        flipped = b("Sub", b("Sub", lens, b("Constant", value=np.array(1, np.int64))), s)
        return b("Unsqueeze", b("Where", b("Less", s, lens), flipped, s), b.ints([2]))

    def _reverse(self, v: str) -> str:
        b = self.pre
        if self.reorder is None:
            return b.reverse_time(v)
        return b("GatherElements", v, b("Expand", self.reorder, b("Shape", v)), axis=0)

    def _pick(self, v: str, d: int) -> str:
        """Direction ``d`` of a per-direction input (``Slice``, whose gradient is dense, not ``Gather``)."""
        b = self.pre
        if self.n_dir > 1:
            v = b("Slice", v, b.ints([d]), b.ints([d + 1]), b.ints([0]))
        return b("Squeeze", v, b.ints([0]))

    def _direction(self, d: int, initial: list[str | None]) -> tuple[str | None, str, str | None]:
        """Lower direction ``d``; returns (``Y`` of this direction as [T, B, H] or None, final H, final C)."""
        b, node, op = self.pre, self.node, self.op
        reverse = self.direction == "reverse" or d == 1
        w, r = self._pick(node.inputs[1], d), self._pick(node.inputs[2], d)
        proj = b("MatMul", self.x, b("Transpose", w, perm=[1, 0]))
        weights = {"proj": proj}
        bias = self._input(3)
        if bias is not None:
            wb, rb = b("Split", self._pick(bias, d), axis=0, n_out=2, num_outputs=2)
            if op == "GRU" and node.attrs.get("linear_before_reset", 0):
                wz, wr, wh = b("Split", wb, axis=0, n_out=3, num_outputs=3)
                rz, rr, weights["rbh"] = b("Split", rb, axis=0, n_out=3, num_outputs=3)
                total = b("Concat", b("Add", wz, rz), b("Add", wr, rr), wh, axis=0)
            else:
                total = b("Add", wb, rb)
            weights["proj"] = b("Add", proj, total)
        if reverse:
            weights["proj"] = self._reverse(weights["proj"])
        if op == "GRU":
            rz, rr, rh = b("Split", r, axis=0, n_out=3, num_outputs=3)
            weights["rzr_t"] = b("Transpose", b("Concat", rz, rr, axis=0), perm=[1, 0])
            weights["rh_t"] = b("Transpose", rh, perm=[1, 0])
        else:
            weights["r_t"] = b("Transpose", r, perm=[1, 0])
        peep = self._input(7) if op == "LSTM" else None
        if peep is not None:
            pi_po_pf = b("Split", self._pick(peep, d), axis=0, n_out=3, num_outputs=3)  # P is ordered iof
            weights["pi"], weights["po"], weights["pf"] = pi_po_pf
        zeros_shape = None
        states = []
        for init in initial[: 2 if op == "LSTM" else 1]:
            if init is not None:
                states.append(self._pick(init, d))
            else:
                zeros_shape = zeros_shape or b("Concat", self.batch, self.hsize, axis=0)
                states.append(b.zeros(zeros_shape))
        want_y = bool(node.outputs and node.outputs[0])
        body = self._body(d, weights, len(states), want_y)
        outs = [fresh_name(f"{self.base}/d{d}/final", self.used) for _ in states]
        stacked = fresh_name(f"{self.base}/d{d}/stacked", self.used) if want_y else None
        true = b("Constant", value=np.array(True))
        b.nodes.append(Node("Loop", [self.steps, true, *states], outs + ([stacked] if want_y else []), {"body": body},
                            fresh_name(f"{self.base}/d{d}/loop", self.used)))
        if self.lens is not None:  # onnxruntime's final state of an empty sequence is zeros, not the initial one
            empty = b("Unsqueeze", b("Equal", self.lens, b("Constant", value=np.array(0, np.int64))), b.ints([1]))
            finals, outs = outs, []
            for name in finals:
                outs.append(b("Where", empty, b.scalar(0.0), name))
        y = None
        if want_y:
            shape = b("Concat", b.ints([-1]), self.batch, self.hsize, axis=0)
            y = b("Reshape", stacked, shape)
            if reverse:
                y = self._reverse(y)
        return y, outs[0], outs[1] if len(outs) > 1 else None

    def _body(self, d: int, weights: dict[str, str], n_states: int, want_y: bool) -> Graph:
        """The loop body of direction ``d``: one time step of the spec's equations."""
        op, used = self.op, self.used
        b = _Nodes(used, f"{self.base}/d{d}/step", self.dtype)
        i, cond = fresh_name(f"{self.base}/d{d}/i", used), fresh_name(f"{self.base}/d{d}/cond", used)
        h = fresh_name(f"{self.base}/d{d}/h", used)
        c = fresh_name(f"{self.base}/d{d}/c", used) if n_states == 2 else None
        per_dir = len(_DEFAULT_ACTIVATIONS[op])
        acts = self.activations[d * per_dir : (d + 1) * per_dir]
        xt = b("Gather", weights["proj"], i, axis=0)
        if op == "LSTM":
            gates = b("Add", xt, b("MatMul", h, weights["r_t"]))
            gi, go, gf, gc = b("Split", gates, axis=1, n_out=4, num_outputs=4)
            if "pi" in weights:
                gi = b("Add", gi, b("Mul", weights["pi"], c))
                gf = b("Add", gf, b("Mul", weights["pf"], c))
            it = self._act(b, acts[0], self._clip(b, gi))
            if self.node.attrs.get("input_forget", 0):
                ft = b("Sub", b.scalar(1.0), it)
            else:
                ft = self._act(b, acts[0], self._clip(b, gf))
            new_c = b("Add", b("Mul", ft, c), b("Mul", it, self._act(b, acts[1], self._clip(b, gc))))
            if "po" in weights:
                go = b("Add", go, b("Mul", weights["po"], new_c))
            ot = self._act(b, acts[0], self._clip(b, go))
            new_h = b("Mul", ot, self._act(b, acts[2], new_c))
            new_states = [new_h, new_c]
        elif op == "GRU":
            xz, xr, xh = b("Split", xt, axis=1, n_out=3, num_outputs=3)
            hz, hr = b("Split", b("MatMul", h, weights["rzr_t"]), axis=1, n_out=2, num_outputs=2)
            zt = self._act(b, acts[0], self._clip(b, b("Add", xz, hz)))
            rt = self._act(b, acts[0], self._clip(b, b("Add", xr, hr)))
            if self.node.attrs.get("linear_before_reset", 0):
                lin = b("MatMul", h, weights["rh_t"])
                if "rbh" in weights:
                    lin = b("Add", lin, weights["rbh"])
                hh = b("Mul", rt, lin)
            else:
                hh = b("MatMul", b("Mul", rt, h), weights["rh_t"])
            ht = self._act(b, acts[1], self._clip(b, b("Add", xh, hh)))
            new_h = b("Add", b("Mul", b("Sub", b.scalar(1.0), zt), ht), b("Mul", zt, h))
            new_states = [new_h]
        else:
            new_h = self._act(b, acts[0], self._clip(b, b("Add", xt, b("MatMul", h, weights["r_t"]))))
            new_states = [new_h]
        y = new_h
        if self.lens is not None:  # past its length a sequence keeps its state and writes zeros
            valid = b("Unsqueeze", b("Less", i, self.lens), b.ints([1]))
            old = [h, c][:n_states]
            new_states = [b("Where", valid, new, prev) for new, prev in zip(new_states, old, strict=True)]
            y = b("Where", valid, new_h, b.scalar(0.0))
        cond_out = b("Identity", cond)
        states_out = [b("Identity", s) for s in new_states]
        vi = self._type(self.node.inputs[0])
        batch = vi.shape[1 - self.layout] if vi is not None and vi.shape is not None and len(vi.shape) == 3 else None
        batch = batch if isinstance(batch, int) else None
        state_shape = (batch, self.hidden)
        outputs = [ValueInfo(cond_out, BOOL, ()), *(ValueInfo(s, self.dtype, state_shape) for s in states_out)]
        if want_y:
            flat = b("Reshape", y, b.ints([-1]))
            size = batch * self.hidden if batch is not None and self.hidden is not None else None
            outputs.append(ValueInfo(flat, self.dtype, (size,)))
        inputs = [ValueInfo(i, I64, ()), ValueInfo(cond, BOOL, ()),
                  *(ValueInfo(s, self.dtype, state_shape) for s in [h, c][:n_states])]
        return Graph(b.nodes, inputs, outputs, name=fresh_name(f"{self.base}_d{d}_step", used))

    def _clip(self, b: _Nodes, x: str) -> str:
        if self.clip is None:
            return x
        return b("Clip", x, b.scalar(-self.clip), b.scalar(self.clip))

    def _act(self, b: _Nodes, act: tuple[str, float, float], x: str) -> str:
        """An activation of the spec's list, from operators that have VJP rules."""
        name, alpha, beta = act
        if name in ("relu", "tanh", "sigmoid", "softplus"):
            return b({"relu": "Relu", "tanh": "Tanh", "sigmoid": "Sigmoid", "softplus": "Softplus"}[name], x)
        if name == "leakyrelu":
            return b("LeakyRelu", x, alpha=alpha)
        if name == "elu":
            return b("Elu", x, alpha=alpha)
        if name == "affine":
            return b("Add", b("Mul", x, b.scalar(alpha)), b.scalar(beta))
        if name == "scaledtanh":
            return b("Mul", b("Tanh", b("Mul", x, b.scalar(beta))), b.scalar(alpha))
        if name == "hardsigmoid":
            return b("Clip", b("Add", b("Mul", x, b.scalar(alpha)), b.scalar(beta)), b.scalar(0.0), b.scalar(1.0))
        if name == "thresholdedrelu":
            return b("Where", b("Greater", x, b.scalar(alpha)), x, b.scalar(0.0))
        return b("Div", x, b("Add", b("Abs", x), b.scalar(1.0)))  # softsign
