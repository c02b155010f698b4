"""Micro-benchmarks behind the step-time hotspots, each measured side by side on onnxruntime.

- ``relu_vjp``: the ReLU VJP revgraph writes, ``Where(Greater(x, 0), g, 0)``, against ``Mul(g, Cast(Greater(x,
  0)))`` (the same values for finite cotangents) on the activation shapes of the benchmark models.
- ``conv_forward_layout``: a forward convolution with its weight as a constant (onnxruntime's NCHWc kernels)
  against the same with its weight as a graph input (a training graph), and PyTorch.
- ``conv_weight_grad``: the weight gradient of a 3x3 convolution (the CNN's largest layer) as revgraph writes
  it (one batched ``MatMul`` per kernel tap, rules/conv.py ``weight_grad_taps``), against the formulation
  revgraph used before and still uses for grouped convolutions (a ``Conv`` of the transposed input with the
  transposed output gradient as kernel, between ``Transpose`` nodes), an im2col form in standard ONNX
  (``Pad``, nine ``Slice`` taps, ``Concat``, one ``Gemm`` over the batch and pixels), and PyTorch's
  ``convolution_backward`` for the weight.
"""

from __future__ import annotations

import time

import numpy as np


def _session(model, threads):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _time(run, seconds):
    run()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds or n < 3:
        run()
        n += 1
    return (time.perf_counter() - t0) / n


def _opset(nodes, inputs, outputs, inits):
    from onnx import helper

    return helper.make_model(helper.make_graph(nodes, "m", inputs, outputs, inits),
                             opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _only(model, output: str):
    """``model`` computing only ``output``: the other outputs and the nodes they alone need are dropped."""
    needed, keep = {output}, []
    for node in reversed(model.graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(keep))
    outs = [o for o in model.graph.output if o.name == output]
    del model.graph.output[:]
    model.graph.output.extend(outs)
    ins = [i for i in model.graph.input if i.name in needed]
    del model.graph.input[:]
    model.graph.input.extend(ins)
    return model


def relu_vjp(threads: int = 2, seconds: float = 0.3, rounds: int = 3) -> list[dict]:
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    out = []
    for shape in ([64, 512], [64, 32, 512], [64, 16, 32, 32]):
        vi = [helper.make_tensor_value_info(n, T.FLOAT, shape) for n in ("x", "g")]
        y = [helper.make_tensor_value_info("y", T.FLOAT, shape)]
        zero = [numpy_helper.from_array(np.array(0, np.float32), "zero")]
        greater = helper.make_node("Greater", ["x", "zero"], ["c"])
        variants = {
            "Where(x > 0, g, 0) (revgraph)": [greater, helper.make_node("Where", ["c", "g", "zero"], ["y"])],
            "Mul(g, Cast(x > 0))": [greater, helper.make_node("Cast", ["c"], ["m"], to=T.FLOAT),
                                    helper.make_node("Mul", ["g", "m"], ["y"])],
        }
        rng = np.random.default_rng(0)
        feeds = {"x": rng.standard_normal(shape).astype(np.float32), "g": rng.standard_normal(shape).astype(np.float32)}
        sessions = {k: _session(_opset(v, vi, y, zero), threads) for k, v in variants.items()}
        ref = None
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(rounds):
            for k, s in sessions.items():
                times[k].append(_time(lambda s=s, f=feeds: s.run(None, f), seconds))
        for s in sessions.values():
            r = s.run(None, feeds)[0]
            ref = r if ref is None else ref
            assert np.array_equal(r, ref)
        out.append({"shape": shape, **{k: float(np.median(v)) for k, v in times.items()}})
    return out


def conv_weight_grad(threads: int = 2, seconds: float = 0.3, rounds: int = 3) -> dict:
    import torch
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    import revgraph as rg
    from revgraph.ir import Graph, Node, ValueInfo

    n, c, o, h, k = 64, 16, 16, 32, 3
    # revgraph's weight gradient only: the forward Conv's output is not a graph output
    g = Graph([Node("Conv", ["x", "w"], ["y"], {"pads": [1, 1, 1, 1]}, "conv"),
               Node("Mul", ["y", "dy"], ["p"], name="p"), Node("ReduceSum", ["p"], ["loss"], {"keepdims": 0}, "loss")],
              [ValueInfo("x", np.float32, (n, c, h, h)), ValueInfo("w", np.float32, (o, c, k, k)),
               ValueInfo("dy", np.float32, (n, o, h, h))], [ValueInfo("loss", np.float32, ())])
    from revgraph.autodiff.rules import conv as conv_rules

    gg = rg.gradient(g, "loss", ["w"])
    model = _only(rg.to_onnx(gg), "w_grad")  # the weight gradient alone: no forward Conv, no loss
    taps, conv_rules.MAX_TAPS = conv_rules.MAX_TAPS, 0  # the formulation revgraph used before
    try:
        whole = _only(rg.to_onnx(rg.gradient(g, "loss", ["w"])), "w_grad")
    finally:
        conv_rules.MAX_TAPS = taps
    keep = {"w_grad"}
    inits = [numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads"),
             numpy_helper.from_array(np.array([2, 3], np.int64), "ax23"),
             numpy_helper.from_array(np.array([2], np.int64), "ax2"),
             numpy_helper.from_array(np.array([c * k * k, -1], np.int64), "s1"),
             numpy_helper.from_array(np.array([o, -1], np.int64), "s2"),
             numpy_helper.from_array(np.array([o, c, k, k], np.int64), "s3")]
    nodes = [helper.make_node("Pad", ["x", "pads"], ["xp"])]
    taps = []
    for i in range(k):
        for j in range(k):
            inits += [numpy_helper.from_array(np.array([i, j], np.int64), f"b{i}{j}"),
                      numpy_helper.from_array(np.array([i + h, j + h], np.int64), f"e{i}{j}")]
            nodes += [helper.make_node("Slice", ["xp", f"b{i}{j}", f"e{i}{j}", "ax23"], [f"t{i}{j}"]),
                      helper.make_node("Unsqueeze", [f"t{i}{j}", "ax2"], [f"u{i}{j}"])]
            taps.append(f"u{i}{j}")
    nodes += [helper.make_node("Concat", taps, ["patches"], axis=2),                 # [N, C, 9, H, W]
              helper.make_node("Transpose", ["patches"], ["pt"], perm=[1, 2, 0, 3, 4]),
              helper.make_node("Reshape", ["pt", "s1"], ["P"]),                        # [C*9, N*H*W]
              helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3]),
              helper.make_node("Reshape", ["dyt", "s2"], ["D"]),                       # [O, N*H*W]
              helper.make_node("Gemm", ["D", "P"], ["dw"], transB=1),
              helper.make_node("Reshape", ["dw", "s3"], ["w_grad"])]
    im2col = _opset(nodes, [helper.make_tensor_value_info("x", T.FLOAT, [n, c, h, h]),
                            helper.make_tensor_value_info("dy", T.FLOAT, [n, o, h, h])],
                    [helper.make_tensor_value_info("w_grad", T.FLOAT, [o, c, k, k])], inits)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, h)).astype(np.float32)
    dy = rng.standard_normal((n, o, h, h)).astype(np.float32)
    w = rng.standard_normal((o, c, k, k)).astype(np.float32)
    s_rg, s_im, s_whole = _session(model, threads), _session(im2col, threads), _session(whole, threads)
    feeds_rg = {i.name: {"x": x, "w": w, "dy": dy}[i.name] for i in model.graph.input}
    feeds_whole = {i.name: {"x": x, "w": w, "dy": dy}[i.name] for i in whole.graph.input}
    a = s_rg.run(list(keep), feeds_rg)[0]
    a_whole = s_whole.run(list(keep), feeds_whole)[0]
    b = s_im.run(None, {"x": x, "dy": dy})[0]
    torch.set_num_threads(threads)
    tx, tdy, tw = torch.from_numpy(x), torch.from_numpy(dy), torch.from_numpy(w)

    def torch_run():
        return torch.ops.aten.convolution_backward(tdy, tx, tw, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                   [False, True, False])[1]

    t = torch_run().numpy()
    scale = float(np.abs(t).max())
    runners = {
        "revgraph (per-tap MatMul)": lambda: s_rg.run(list(keep), feeds_rg),
        "Conv with the output gradient as kernel (Transpose, Conv, Transpose)":
            lambda: s_whole.run(list(keep), feeds_whole),
        "im2col: Pad, 9 Slice, Concat, Gemm": lambda: s_im.run(None, {"x": x, "dy": dy}),
        "PyTorch convolution_backward (weight)": torch_run,
    }
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            times[name].append(_time(run, seconds))
    return {"shape": {"x": [n, c, h, h], "w": [o, c, k, k]},
            "max_rel_diff": {"revgraph": float(np.abs(a - t).max() / scale), "im2col": float(np.abs(b - t).max() / scale),
                             "whole-gradient Conv": float(np.abs(a_whole - t).max() / scale)},
            "nodes": {"revgraph": [nd.op_type for nd in model.graph.node]},
            "seconds": {k: float(np.median(v)) for k, v in times.items()}}


def conv_forward_layout(threads: int = 2, seconds: float = 0.3, rounds: int = 3) -> dict:
    """The forward 3x3 convolution of the CNN's first residual block on onnxruntime with its weight as a constant
    initializer (onnxruntime's NCHWc layout transformer rewrites it into ``com.microsoft.nchwc.Conv``) and as a
    graph input (as in every training graph, where weights change between steps), and PyTorch's ``conv2d``."""
    import torch
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    x = rng.standard_normal([64, 16, 32, 32]).astype(np.float32)
    w = rng.standard_normal([16, 16, 3, 3]).astype(np.float32)
    x_vi = helper.make_tensor_value_info("x", T.FLOAT, list(x.shape))
    w_vi = helper.make_tensor_value_info("w", T.FLOAT, list(w.shape))
    y = [helper.make_tensor_value_info("y", T.FLOAT, None)]
    conv = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])]
    s_const = _session(_opset(conv, [x_vi], y, [numpy_helper.from_array(w, "w")]), threads)
    s_input = _session(_opset(conv, [x_vi, w_vi], y, []), threads)
    torch.set_num_threads(threads)
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    runners = {
        "weight as initializer (NCHWc Conv)": lambda: s_const.run(None, {"x": x}),
        "weight as graph input (training graphs)": lambda: s_input.run(None, {"x": x, "w": w}),
        "PyTorch conv2d": lambda: torch.nn.functional.conv2d(tx, tw, padding=1),
    }
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            times[name].append(_time(run, seconds))
    return {"shape": {"x": list(x.shape), "w": list(w.shape)}, "seconds": {k: float(np.median(v)) for k, v in times.items()}}
