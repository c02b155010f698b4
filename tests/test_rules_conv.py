"""VJP rules of Conv, ConvTranspose, Col2Im and DeformConv, checked three ways by tests/kit/harness.py (central
differences, PyTorch autograd with the same parameters, second order) over drawn geometries, plus explicit
cases: depthwise and grouped convolutions, odd sizes with stride 2, dilation, asymmetric pads, auto_pad,
output_padding and output_shape, unknown dimensions, and the float32 graphs under onnxruntime. Col2Im is
checked against PyTorch's ``fold``; DeformConv against a PyTorch reference written here (torchvision is not
importable), onnxruntime's kernel and the reference evaluator's.

float64 Conv/ConvTranspose run on the onnx reference evaluator (onnxruntime has no float64 kernels). Its
grouped ConvTranspose is wrong, so grouped ConvTranspose is checked in float32 under onnxruntime instead."""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.harness import check_rule, one_node_graph, with_loss

import revgraph as rg
from revgraph.errors import GraphError
from revgraph.ir import ValueInfo

FAST = settings(max_examples=8, deadline=None)
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def torch_pad(pads: list[int]) -> list[int]:
    """ONNX pads ``[b1.., e1..]`` as F.pad's ``[b_last, e_last, ..., b1, e1]``."""
    k = len(pads) // 2
    return [p for i in reversed(range(k)) for p in (pads[i], pads[i + k])]


def torch_conv(nd, strides, dilations, pads, group):
    """Conv in PyTorch: explicit zero padding (ONNX pads may be asymmetric), then F.convNd."""
    def fn(x, w, b=None, **_):
        return CONV[nd](F.pad(x, torch_pad(pads)), w, b, strides, 0, dilations, group)
    return fn


def torch_conv_transpose(nd, strides, dilations, pads, outpad, group):
    """ConvTranspose in PyTorch: the full transposed convolution, ``output_padding`` zeros at the end, the
    pads cut off, the bias added everywhere (ONNX "ConvTranspose")."""
    k = nd

    def fn(x, w, b=None, **_):
        full = CONV_T[nd](x, w, None, strides, 0, 0, group, dilations)
        full = F.pad(full, [v for i in reversed(range(k)) for v in (0, outpad[i])])
        cut = tuple([slice(None)] * 2 + [slice(pads[i], full.shape[2 + i] - pads[k + i]) for i in range(k)])
        y = full[cut]
        return y if b is None else y + b.reshape(1, -1, *[1] * k)
    return fn


def same_pads(dims, kernel, strides, dilations, upper):
    """The explicit pads of auto_pad SAME_UPPER / SAME_LOWER, from the ONNX "Conv" spec text."""
    begin, end = [], []
    for d, k, s, dl in zip(dims, kernel, strides, dilations, strict=True):
        total = max(0, (-(-d // s) - 1) * s + (k - 1) * dl + 1 - d)
        lo, hi = total // 2, total - total // 2
        begin.append(lo if upper else hi)
        end.append(hi if upper else lo)
    return begin + end


def arrays(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


# ------------------------------------------------------------------------------------------ Conv


@st.composite
def conv_case(draw):
    nd = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 1, 2, 3]))
    cg, mg = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    kernel = draw(st.lists(st.integers(1, 3), min_size=nd, max_size=nd))
    strides = draw(st.lists(st.integers(1, 3), min_size=nd, max_size=nd))
    dilations = draw(st.lists(st.integers(1, 2), min_size=nd, max_size=nd))
    pads = draw(st.lists(st.integers(0, 2), min_size=2 * nd, max_size=2 * nd))
    top = 6 if nd < 3 else 4
    dims = [draw(st.integers(max(1, (k - 1) * d + 1 - pads[i] - pads[i + nd]), top + (k - 1) * d))
            for i, (k, d) in enumerate(zip(kernel, dilations, strict=True))]
    auto = draw(st.sampled_from(["NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
    if auto == "VALID":
        dims = [max(d, (k - 1) * dl + 1) for d, k, dl in zip(dims, kernel, dilations, strict=True)]
    return {"nd": nd, "group": group, "cg": cg, "mg": mg, "kernel": kernel, "strides": strides,
            "dilations": dilations, "pads": pads, "dims": dims, "auto": auto, "n": draw(st.integers(1, 2)),
            "bias": draw(st.booleans()), "seed": draw(st.integers(0, 2**31 - 1))}


def run_conv(case, x_shape_override=None, second_order=True, no_jvp=None):
    nd, group = case["nd"], case["group"]
    c, m = case["cg"] * group, case["mg"] * group
    x, w, b = arrays(case["seed"], (case["n"], c, *case["dims"]), (m, case["cg"], *case["kernel"]), (m,))
    ins = {"x": x, "w": w, **({"b": b} if case["bias"] else {})}
    attrs = {"strides": case["strides"], "dilations": case["dilations"], "group": group}
    pads = case["pads"]
    if case["auto"] == "NOTSET":
        attrs["pads"] = pads
    else:
        attrs["auto_pad"] = case["auto"]
        pads = [0] * (2 * nd) if case["auto"] == "VALID" else same_pads(
            case["dims"], case["kernel"], case["strides"], case["dilations"], case["auto"] == "SAME_UPPER")
    g = one_node_graph("Conv", ins, attrs)
    if x_shape_override is not None:
        g.inputs[0] = ValueInfo("x", x.dtype, x_shape_override)
    fn = torch_conv(nd, case["strides"], case["dilations"], pads, group)
    return check_rule(g, ins, fn, seed=case["seed"], second_order=second_order, no_jvp=no_jvp)


@FAST
@given(case=conv_case())
def test_conv(case):
    run_conv(case)


EMPTY_WINDOW_CASES = [  # found by hypothesis: the input gradient reads an empty (0-length) slice
    {"nd": 1, "group": 2, "cg": 1, "mg": 1, "kernel": [1], "strides": [2], "dilations": [1], "pads": [1, 0],
     "dims": [1], "auto": "NOTSET", "n": 1, "bias": False, "seed": 0},
    {"nd": 2, "group": 2, "cg": 1, "mg": 1, "kernel": [1, 1], "strides": [1, 2], "dilations": [1, 1],
     "pads": [0, 1, 0, 0], "dims": [1, 1], "auto": "NOTSET", "n": 1, "bias": False, "seed": 0},
]


@pytest.mark.parametrize("case", EMPTY_WINDOW_CASES)
def test_grouped_conv_second_order_through_empty_windows(case):
    run_conv(case)


def _case(**kw):
    base = {"nd": 2, "group": 1, "cg": 2, "mg": 2, "kernel": [3, 3], "strides": [1, 1], "dilations": [1, 1],
            "pads": [0, 0, 0, 0], "dims": [5, 5], "auto": "NOTSET", "n": 2, "bias": True, "seed": 0}
    base.update(kw)
    return base


EXPLICIT_CONV = {
    "depthwise": _case(group=3, cg=1, mg=1, pads=[1, 1, 1, 1]),
    "depthwise_multiplier_stride2": _case(group=3, cg=1, mg=2, strides=[2, 2], pads=[1, 1, 1, 1]),
    "grouped_stride2_odd": _case(group=2, cg=2, mg=3, strides=[2, 2], dims=[7, 5]),
    "stride2_odd_sizes": _case(strides=[2, 2], dims=[7, 5], pads=[1, 1, 1, 1]),
    "dilation2": _case(dilations=[2, 2], dims=[7, 6], pads=[2, 2, 2, 2]),
    "asymmetric_pads": _case(pads=[0, 2, 1, 0], kernel=[3, 2]),
    "pads_wider_than_kernel": _case(group=2, cg=1, mg=1, kernel=[1, 2], pads=[2, 0, 1, 3], strides=[2, 1]),
    "same_upper": _case(auto="SAME_UPPER", strides=[2, 2], dims=[6, 5], kernel=[2, 3]),
    "same_lower": _case(auto="SAME_LOWER", strides=[2, 1], dims=[6, 5], kernel=[2, 3]),
    "valid": _case(auto="VALID", strides=[2, 2]),
    "conv1d_no_bias": _case(nd=1, kernel=[3], strides=[2], dilations=[2], pads=[1, 2], dims=[9], bias=False),
    "conv3d_grouped": _case(nd=3, group=2, cg=1, mg=1, kernel=[2, 2, 2], strides=[2, 1, 1], dilations=[1, 1, 2],
                            pads=[1, 0, 1, 0, 1, 0], dims=[3, 4, 4], n=1),
}


@pytest.mark.parametrize("name", sorted(EXPLICIT_CONV))
def test_conv_explicit(name):
    run_conv(EXPLICIT_CONV[name])


def test_conv_only_weight_and_kernel_shape_attribute():
    x, w = arrays(3, (2, 3, 5, 6), (4, 3, 2, 3))
    g = one_node_graph("Conv", {"x": x, "w": w}, {"kernel_shape": [2, 3], "strides": [2, 1]})
    grads = check_rule(g, {"x": x, "w": w}, torch_conv(2, [2, 1], [1, 1], [0] * 4, 1), wrt=["w"])
    assert set(grads) == {"w"}


def test_conv_default_attributes():
    x, w, b = arrays(4, (1, 2, 4, 4), (3, 2, 3, 3), (3,))
    g = one_node_graph("Conv", {"x": x, "w": w, "b": b})
    check_rule(g, {"x": x, "w": w, "b": b}, lambda x, w, b: F.conv2d(x, w, b))


@pytest.mark.parametrize("group", [1, 2])
def test_conv_unknown_batch_and_spatial_dims(group):
    """Symbolic N, H, W: the first-order VJP falls back to Shape-based fitting (its own gradient would need the
    kernel size of a backward Conv whose kernel is the gradient itself, which is not static then)."""
    case = _case(group=group, cg=2, mg=1, strides=[2, 3], dims=[7, 8], pads=[1, 0, 2, 1], dilations=[1, 2])
    run_conv(case, x_shape_override=("N", 2 * group, "H", "W"), second_order=False,
             no_jvp="forward mode transposes the VJP, which differentiates that backward Conv as well")


def test_conv_same_with_unknown_dims_is_a_graph_error():
    x, w = arrays(5, (1, 2, 5, 5), (2, 2, 3, 3))
    g = one_node_graph("Conv", {"x": x, "w": w}, {"auto_pad": "SAME_UPPER", "strides": [2, 2]})
    g.inputs[0] = ValueInfo("x", x.dtype, (1, 2, "H", "W"))
    lg, _ = with_loss(g, {"y0": np.zeros((1, 2, 3, 3))})
    with pytest.raises(GraphError, match=r"node 'op' \(Conv\).*auto_pad=SAME_UPPER") as err:
        rg.gradient(lg, loss="loss", wrt=["x"])
    assert "\n" not in str(err.value)


def test_grouped_conv_backward_has_no_grouped_conv_transpose():
    """The reference evaluator's grouped ConvTranspose is wrong; the backward must not rely on it."""
    x, w = arrays(6, (1, 4, 5, 5), (4, 2, 3, 3))
    g = one_node_graph("Conv", {"x": x, "w": w}, {"group": 2, "strides": [2, 2]})
    lg, _ = with_loss(g, {"y0": np.zeros((1, 4, 2, 2))})
    gg = rg.gradient(lg, loss="loss", wrt=["x", "w"])
    assert all(n.attrs.get("group", 1) == 1 for n in gg.nodes if n.op_type == "ConvTranspose")


# ------------------------------------------------------------------------------------------ ConvTranspose


@st.composite
def conv_transpose_case(draw):
    nd = draw(st.integers(1, 3))
    kernel = draw(st.lists(st.integers(1, 3), min_size=nd, max_size=nd))
    strides = draw(st.lists(st.integers(1, 3), min_size=nd, max_size=nd))
    dilations = draw(st.lists(st.integers(1, 2), min_size=nd, max_size=nd))
    outpad = [draw(st.integers(0, s - 1)) for s in strides]
    top = 4 if nd < 3 else 3
    dims = draw(st.lists(st.integers(1, top), min_size=nd, max_size=nd))
    pads = []
    for i in range(nd):  # keep at least one output position
        full = strides[i] * (dims[i] - 1) + outpad[i] + (kernel[i] - 1) * dilations[i] + 1
        pads.append(draw(st.integers(0, min(2, (full - 1) // 2))))
    for i in range(nd):
        full = strides[i] * (dims[i] - 1) + outpad[i] + (kernel[i] - 1) * dilations[i] + 1
        pads.append(draw(st.integers(0, min(2, full - 1 - pads[i]))))
    return {"nd": nd, "kernel": kernel, "strides": strides, "dilations": dilations, "outpad": outpad, "pads": pads,
            "dims": dims, "c": draw(st.integers(1, 3)), "m": draw(st.integers(1, 3)), "n": draw(st.integers(1, 2)),
            "bias": draw(st.booleans()), "seed": draw(st.integers(0, 2**31 - 1))}


def run_conv_transpose(case, attrs_override=None):
    nd = case["nd"]
    x, w, b = arrays(case["seed"], (case["n"], case["c"], *case["dims"]), (case["c"], case["m"], *case["kernel"]),
                     (case["m"],))
    ins = {"x": x, "w": w, **({"b": b} if case["bias"] else {})}
    attrs = {"strides": case["strides"], "dilations": case["dilations"], "pads": case["pads"],
             "output_padding": case["outpad"]}
    attrs.update(attrs_override or {})
    fn = torch_conv_transpose(nd, case["strides"], case["dilations"], case["pads"], case["outpad"], 1)
    return check_rule(one_node_graph("ConvTranspose", ins, {k: v for k, v in attrs.items() if v is not None}), ins,
                      fn, seed=case["seed"])


@FAST
@given(case=conv_transpose_case())
def test_conv_transpose(case):
    run_conv_transpose(case)


def _tcase(**kw):
    base = {"nd": 2, "kernel": [3, 3], "strides": [2, 2], "dilations": [1, 1], "outpad": [0, 0], "pads": [0, 0, 0, 0],
                "dims": [3, 4], "c": 2, "m": 3, "n": 2, "bias": True, "seed": 1}
    base.update(kw)
    return base


EXPLICIT_CONV_T = {
    "output_padding_past_pads": _tcase(outpad=[1, 1], pads=[1, 0, 1, 0]),
    "output_padding_within_pads": _tcase(outpad=[1, 1], pads=[1, 2, 0, 2]),
    "dilation2_stride3": _tcase(strides=[3, 1], dilations=[2, 2], outpad=[2, 0], pads=[1, 1, 1, 1]),
    "conv1d": _tcase(nd=1, kernel=[3], strides=[3], dilations=[2], outpad=[2], pads=[2, 0], dims=[4]),
    "conv3d": _tcase(nd=3, kernel=[2, 2, 2], strides=[2, 1, 2], dilations=[1, 2, 1], outpad=[1, 0, 1],
                     pads=[1, 0, 1, 1, 0, 1], dims=[3, 3, 2], n=1),
}


@pytest.mark.parametrize("name", sorted(EXPLICIT_CONV_T))
def test_conv_transpose_explicit(name):
    run_conv_transpose(EXPLICIT_CONV_T[name])


@pytest.mark.parametrize("attrs, pads", [
    ({"auto_pad": "SAME_UPPER"}, [0, 1]),             # total 1: the odd pad at the end
    ({"auto_pad": "SAME_LOWER"}, [1, 0]),
    ({"output_shape": [8], "auto_pad": "SAME_UPPER"}, [0, 1]),
    ({"output_shape": [7], "auto_pad": "SAME_LOWER"}, [1, 1]),
    ({"output_shape": [9], "auto_pad": "SAME_UPPER", "output_padding": [1]}, [0, 1]),
])
def test_conv_transpose_auto_pad_and_output_shape(attrs, pads):
    """Pads from the ONNX "ConvTranspose" spec: total = s*(D-1) + output_padding + span - out, with SAME_UPPER
    putting the smaller half first (the ``pads`` column is that arithmetic done by hand, for D=4, s=2, k=3)."""
    case = _tcase(nd=1, kernel=[3], strides=[2], dilations=[1], outpad=attrs.get("output_padding", [0]), pads=pads,
                  dims=[4], seed=2)
    run_conv_transpose(case, {"pads": None, **attrs})


# ------------------------------------------------------------------------------------------ float32 under onnxruntime


def ort_vs_torch(op, ins, attrs, torch_fn, seed=0):
    """revgraph's float32 gradients run by onnxruntime against float64 PyTorch autograd."""
    rng = np.random.default_rng(seed)
    ins32 = {k: v.astype(np.float32) for k, v in ins.items()}
    g = one_node_graph(op, ins32, attrs)
    tin = {k: torch.tensor(v, requires_grad=True) for k, v in ins.items()}
    y = torch_fn(**tin)
    u = rng.standard_normal(tuple(y.shape))
    loss = (y * torch.tensor(u)).sum()
    loss.backward()
    lg, _ = with_loss(g, {"y0": y.detach().numpy().astype(np.float32)})
    gg = rg.gradient(lg, loss="loss", wrt=list(ins))
    out = rg.Session(gg, backend="onnxruntime").run({**ins32, "y0_u": u.astype(np.float32)})
    np.testing.assert_allclose(out["loss"], loss.item(), rtol=1e-4, atol=1e-4)
    for k in ins:
        np.testing.assert_allclose(out[f"{k}_grad"], tin[k].grad.numpy(), rtol=1e-4, atol=1e-4, err_msg=k)


@pytest.mark.parametrize("nd, n, c, m, group, dims, kernel, strides, dilations, pads, outpad", [
    (2, 2, 4, 6, 2, [3, 3], [3, 3], [2, 2], [1, 1], [1, 1], [1, 0]),
    (2, 2, 4, 4, 4, [3, 4], [3, 3], [2, 1], [1, 2], [1, 0], [1, 0]),
    (1, 1, 3, 6, 3, [5], [3], [3], [2], [2], [1]),
    (2, 1, 2, 3, 1, [3, 3], [2, 3], [3, 2], [2, 1], [0, 1], [2, 1]),
])
def test_conv_transpose_float32_onnxruntime(nd, n, c, m, group, dims, kernel, strides, dilations, pads, outpad):
    x, w, b = arrays(7, (n, c, *dims), (c, m // group, *kernel), (m,))
    attrs = {"strides": strides, "dilations": dilations, "pads": pads + pads, "output_padding": outpad, "group": group}
    ort_vs_torch("ConvTranspose", {"x": x, "w": w, "b": b}, attrs,
                 lambda x, w, b: CONV_T[nd](x, w, b, strides, pads, outpad, group, dilations))


@pytest.mark.parametrize("nd, group, cg, mg, dims, kernel, strides, dilations, pads", [
    (2, 1, 3, 2, [7, 6], [3, 3], [2, 2], [1, 1], [1, 0, 2, 1]),
    (2, 3, 1, 2, [7, 5], [3, 2], [2, 3], [2, 1], [1, 1, 0, 0]),
    (3, 2, 2, 1, [4, 5, 3], [2, 3, 2], [2, 1, 2], [1, 1, 1], [0, 1, 1, 1, 0, 0]),
    (1, 2, 2, 2, [9], [3], [3], [2], [2, 1]),
])
def test_conv_float32_onnxruntime(nd, group, cg, mg, dims, kernel, strides, dilations, pads):
    x, w, b = arrays(8, (2, cg * group, *dims), (mg * group, cg, *kernel), (mg * group,))
    attrs = {"strides": strides, "dilations": dilations, "pads": pads, "group": group}
    ort_vs_torch("Conv", {"x": x, "w": w, "b": b}, attrs, torch_conv(nd, strides, dilations, pads, group))


def test_conv_transpose_output_shape_notset_float32_onnxruntime():
    """output_shape without auto_pad: the larger half of the total padding goes first (ONNX "ConvTranspose";
    for D=4, s=2, k=3 and out=8 the total is 1, so pads [1, 0]). The reference evaluator cannot run this
    forward, so onnxruntime checks it."""
    x, w, b = arrays(9, (2, 2, 4), (2, 3, 3), (3,))
    ort_vs_torch("ConvTranspose", {"x": x, "w": w, "b": b}, {"strides": [2], "output_shape": [8]},
                 torch_conv_transpose(1, [2], [1], [1, 0], [0], 1))



# ------------------------------------------------------------------------------------------ Col2Im


def torch_col2im(image, block, strides, dilations, pads):
    """Col2Im as PyTorch's ``fold`` onto the padded image (ONNX pads may be asymmetric), the pads cut off."""
    k = len(image)

    def fn(x, **_):
        padded = [d + pads[i] + pads[i + k] for i, d in enumerate(image)]
        y = F.fold(x, padded, block, dilation=dilations, padding=0, stride=strides)
        return y[(slice(None), slice(None), *(slice(pads[i], pads[i] + image[i]) for i in range(k)))]
    return fn


def col2im_case(image, block, strides, dilations, pads, n=2, c=2, seed=0):
    k = len(image)
    blocks = [(d + pads[i] + pads[i + k] - (dilations[i] * (block[i] - 1) + 1)) // strides[i] + 1
              for i, d in enumerate(image)]
    (x,) = arrays(seed, (n, c * int(np.prod(block)), int(np.prod(blocks))))
    ins = {"x": x, "image": np.array(image, dtype=np.int64), "block": np.array(block, dtype=np.int64)}
    return ins, {"strides": strides, "dilations": dilations, "pads": pads}


@pytest.mark.parametrize("image, block, strides, dilations, pads", [
    ([4, 5], [2, 2], [1, 1], [1, 1], [0, 0, 0, 0]),
    ([5, 6], [2, 3], [2, 1], [1, 2], [1, 0, 1, 2]),   # overlapping and skipped pixels, asymmetric pads
    ([6, 4], [3, 1], [3, 2], [2, 1], [2, 1, 0, 1]),   # blocks that reach into the padding only
])
def test_col2im(image, block, strides, dilations, pads):
    ins, attrs = col2im_case(image, block, strides, dilations, pads)
    g = one_node_graph("Col2Im", ins, attrs)
    check_rule(g, {"x": ins["x"]}, torch_col2im(image, block, strides, dilations, pads))


def test_col2im_3d():
    """A volume: central differences and second order (PyTorch's fold is 2-D only)."""
    ins, attrs = col2im_case([3, 4, 3], [2, 2, 1], [1, 2, 1], [1, 1, 2], [0, 1, 0, 1, 0, 1], n=1)
    check_rule(one_node_graph("Col2Im", ins, attrs), {"x": ins["x"]})


def test_col2im_float32_onnxruntime():
    ins, attrs = col2im_case([5, 6], [2, 3], [2, 1], [1, 2], [1, 0, 1, 2])
    x = ins.pop("x")
    g = one_node_graph("Col2Im", {"x": x.astype(np.float32), **ins}, attrs)
    tx = torch.tensor(x, requires_grad=True)
    y = torch_col2im([5, 6], [2, 3], [2, 1], [1, 2], [1, 0, 1, 2])(tx)
    u = np.random.default_rng(1).standard_normal(tuple(y.shape))
    (y * torch.tensor(u)).sum().backward()
    lg, _ = with_loss(g, {"y0": y.detach().numpy().astype(np.float32)})
    out = rg.Session(rg.gradient(lg, loss="loss", wrt=["x"]), backend="onnxruntime").run(
        {"x": x.astype(np.float32), "y0_u": u.astype(np.float32)})
    np.testing.assert_allclose(out["x_grad"], tx.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_col2im_block_shape_at_run_time():
    """A block shape fed at run time: the identity kernel is built in the graph (first order only: the Conv
    VJP of the gradient graph would need the kernel size when the graph is built)."""
    ins, attrs = col2im_case([5, 6], [2, 3], [2, 1], [1, 2], [1, 0, 1, 2])
    g = one_node_graph("Col2Im", ins, attrs, float_inputs=["x"])
    g.inputs.append(ValueInfo("block", np.dtype(np.int64), (2,)))
    del g.initializers["block"]
    check_rule(g, {"x": ins["x"], "block": ins["block"]}, torch_col2im([5, 6], [2, 3], [2, 1], [1, 2], [1, 0, 1, 2]),
               wrt=["x"], second_order=False, no_jvp="forward mode transposes the VJP: the same Conv VJP")


# ------------------------------------------------------------------------------------------ DeformConv


def torch_deform_conv(strides, dilations, pads, group, offset_group, kernel):
    """DeformConv in PyTorch (torchvision's ``deform_conv2d`` is not importable here), any spatial rank: each
    input channel sampled multilinearly at ``o*s - pb + k*d + offset`` (zero outside the input), times the
    mask, then contracted with the weight per group (ONNX "DeformConv"; the offsets laid out as
    ``[offset_group, *kernel, rank]``, the mask as ``[offset_group, *kernel]``)."""
    def fn(x, w, off, b=None, mask=None, **_):
        n, c, dims, k, og = x.shape[0], x.shape[1], list(x.shape[2:]), x.dim() - 2, offset_group
        out = [(dims[j] + pads[j] + pads[j + k] - (kernel[j] - 1) * dilations[j] - 1) // strides[j] + 1
               for j in range(k)]
        taps, length, pixels = int(np.prod(kernel)), int(np.prod(out)), int(np.prod(dims))
        offs = off.reshape(n, og, taps, k, length)
        grid = np.indices(list(kernel) + out).reshape(2 * k, taps, length)
        pos = [torch.tensor(grid[k + j] * strides[j] - pads[j] + grid[j] * dilations[j], dtype=x.dtype)
               + offs[:, :, :, j] for j in range(k)]
        planes = x.reshape(n, og, c // og, pixels)
        val = 0
        for bits in itertools.product((0, 1), repeat=k):
            idx, weight = 0, 1
            for j, bit in enumerate(bits):
                low = torch.floor(pos[j])
                at = low + bit
                frac = pos[j] - low
                weight = weight * (frac if bit else 1 - frac) * ((at >= 0) & (at <= dims[j] - 1)).to(x.dtype)
                idx = idx * dims[j] + at.clamp(0, dims[j] - 1).long()
            read = torch.gather(planes, 3, idx.reshape(n, og, 1, -1).expand(n, og, c // og, taps * length))
            val = val + read * weight.reshape(n, og, 1, -1)
        if mask is not None:
            val = val * mask.reshape(n, og, 1, -1)
        cols = val.reshape(n, group, (c // group) * taps, length)
        y = torch.matmul(w.reshape(group, w.shape[0] // group, -1), cols).reshape(n, w.shape[0], *out)
        return y if b is None else y + b.reshape(1, -1, *[1] * k)
    return fn


def deform_case(dims=(5, 6), kernel=(2, 3), strides=(1, 2), dilations=(2, 1), pads=(1, 0, 0, 1), group=2,
                offset_group=2, n=2, cg=2, mg=2, scale=1.5, bias=True, mask=True, seed=0):
    """Inputs and attributes of a DeformConv; offsets of standard deviation ``scale`` (some samples fall
    outside the input), a mask of any sign."""
    k = len(dims)
    c, m = cg * group, mg * group
    out = [(d + pads[j] + pads[j + k] - (kernel[j] - 1) * dilations[j] - 1) // strides[j] + 1
           for j, d in enumerate(dims)]
    taps = int(np.prod(kernel))
    x, w, off, b, msk = arrays(seed, (n, c, *dims), (m, cg, *kernel), (n, offset_group * taps * k, *out), (m,),
                               (n, offset_group * taps, *out))
    ins = {"x": x, "w": w, "off": off * scale}
    if bias or mask:
        ins["b"] = b if bias else np.zeros(0)
    if mask:
        ins["mask"] = msk
    attrs = {"strides": list(strides), "dilations": list(dilations), "pads": list(pads), "group": group,
             "offset_group": offset_group}
    fn = torch_deform_conv(list(strides), list(dilations), list(pads), group, offset_group, list(kernel))
    return ins, attrs, fn


def deform_graph(ins, attrs, opset=22):
    float_ins = {k: v for k, v in ins.items() if v.size or k != "b"}
    g = one_node_graph("DeformConv", float_ins, attrs)
    if "b" in ins and not ins["b"].size:  # mask without bias: an empty name for B
        g.nodes[0].inputs = ["x", "w", "off", "", "mask"]
    g.opsets = {"": opset}
    return g, float_ins


@pytest.mark.parametrize("kw", [
    {},                                                            # groups, offset groups, mask and bias
    {"group": 1, "offset_group": 1, "bias": False, "mask": False},  # DCN v1
    {"group": 1, "offset_group": 2, "cg": 2, "bias": False},        # mask, no bias
    {"group": 2, "offset_group": 1, "strides": (2, 2), "pads": (2, 2, 2, 2), "scale": 3.0},  # far outside
    {"dims": (4, 4), "kernel": (3, 3), "strides": (1, 1), "dilations": (1, 1), "pads": (1, 1, 1, 1), "group": 1,
     "offset_group": 1, "n": 1, "cg": 3, "mg": 2},
])
def test_deform_conv(kw):
    ins, attrs, fn = deform_case(**kw)
    g, feeds = deform_graph(ins, attrs)
    check_rule(g, feeds, lambda **t: fn(**t))


def test_deform_conv_kernel_shape_attribute_opset21_and_symbolic_batch():
    ins, attrs, fn = deform_case(group=1, offset_group=1, n=2, cg=1, mg=2)
    g, feeds = deform_graph(ins, {**attrs, "kernel_shape": [2, 3]}, opset=21)
    g.inputs = [ValueInfo(v.name, v.dtype, ("N", *v.shape[1:]) if v.name in ("x", "off", "mask") else v.shape)
                for v in g.inputs]
    check_rule(g, feeds, lambda **t: fn(**t))


def test_deform_conv_reference_evaluator_agrees_with_torch():
    """The PyTorch reference above against onnxruntime's kernel and onnx's DeformConv (GridSample on
    normalised coordinates, which rounds to ~1e-7)."""
    ins, attrs, fn = deform_case(dims=(4, 5), n=1, cg=1, mg=1, scale=2.0)
    g, feeds = deform_graph(ins, attrs)
    expected = fn(**{k: torch.tensor(v) for k, v in feeds.items()}).numpy()
    for backend, tol in (("onnxruntime", 1e-12), ("reference", 1e-6)):
        got = rg.Session(g, backend=backend).run(feeds)["y0"]
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, err_msg=backend)


@pytest.mark.parametrize("dims, kernel", [((7,), (3,)), ((4, 3, 3), (2, 1, 2))])
def test_deform_conv_other_ranks(dims, kernel):
    """1-D and 3-D DeformConv (the spec's N-D case): neither onnxruntime nor the reference evaluator runs
    them, but the gradient graph does not contain the forward node, so it runs; against PyTorch autograd."""
    k = len(dims)
    ins, attrs, fn = deform_case(dims=dims, kernel=kernel, strides=(1,) * k, dilations=(1,) * k, pads=(1,) * (2 * k),
                                 group=1, offset_group=1, n=1, cg=2, mg=2)
    g, feeds = deform_graph(ins, attrs)
    tin = {k_: torch.tensor(v, requires_grad=True) for k_, v in feeds.items()}
    y = fn(**tin)
    u = np.random.default_rng(3).standard_normal(tuple(y.shape))
    (y * torch.tensor(u)).sum().backward()
    g.outputs = [ValueInfo("y0", np.dtype(np.float64), tuple(y.shape))]
    gg = rg.gradient(g, loss="y0", wrt=list(feeds), seed="input")
    gg.outputs = [o for o in gg.outputs if o.name.endswith("_grad") and o.name != "y0_grad"]
    gg.nodes = [nd for nd in gg.nodes if nd.op_type != "DeformConv"]
    out = rg.Session(gg, backend="onnxruntime").run({**feeds, "y0_grad": u})
    for name in feeds:
        np.testing.assert_allclose(out[f"{name}_grad"], tin[name].grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def test_deform_conv_float32_onnxruntime():
    ins, attrs, fn = deform_case(seed=4)
    _, feeds = deform_graph(ins, attrs)
    ort_vs_torch("DeformConv", feeds, attrs, lambda **t: fn(**t))


def test_deform_conv_input_gradient_independent_of_thread_count():
    """Offsets that pull every sample to a few pixels: the input gradient adds many rows at few positions,
    with the sequential ScatterElements kernel (no reducing ScatterND), so onnxruntime's thread count does
    not change it (tests/test_determinism.py)."""
    ins, attrs, fn = deform_case(dims=(8, 8), kernel=(3, 3), strides=(1, 1), dilations=(1, 1), pads=(1, 1, 1, 1),
                                 group=1, offset_group=1, n=2, cg=16, mg=4, bias=False, mask=False, seed=5)
    base = np.indices((3, 3, 8, 8)).reshape(4, 9, 64)
    target = np.stack([3.5 - (base[2] - 1 + base[0]), 4.25 - (base[3] - 1 + base[1])], axis=1)  # all at (3.5, 4.25)
    ins["off"] = np.broadcast_to(target.reshape(1, 18, 8, 8), ins["off"].shape).copy()
    feeds = {k: v.astype(np.float32) for k, v in ins.items()}
    g = one_node_graph("DeformConv", feeds, attrs)
    tin = {k: torch.tensor(v, requires_grad=True) for k, v in ins.items()}
    y = fn(**tin)
    u = np.random.default_rng(6).standard_normal(tuple(y.shape))
    (y * torch.tensor(u)).sum().backward()
    lg, _ = with_loss(g, {"y0": y.detach().numpy().astype(np.float32)})
    gg = rg.gradient(lg, loss="loss", wrt=["x"])
    assert not any(n.op_type == "ScatterND" and n.attrs.get("reduction", "none") != "none" for n in gg.nodes)
    model = rg.to_onnx(gg).SerializeToString()
    first = None
    for threads in (1, 2, 4):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        got = sess.run(["x_grad"], {**feeds, "y0_u": u.astype(np.float32)})[0]
        np.testing.assert_allclose(got, tin["x"].grad.numpy(), rtol=1e-4, atol=1e-4)
        first = got if first is None else first
        np.testing.assert_array_equal(got, first, err_msg=f"{threads} threads")
