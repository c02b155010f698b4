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

Candidates measured for the CNN's training step (bench/models.py), each side by side at the CNN's real layer
shapes, with the step-level outcome in their docstrings:

- ``conv_weight_grad_forms``: other weight-gradient forms of a 3x3 layer (one 2-D GEMM per tap over the batch
  and pixels at once, contiguous "wide row" taps, an unfold by a Conv with one-hot kernels) against revgraph's.
- ``conv_input_grad``: the input gradient as ``ConvTranspose`` (revgraph) against a ``Conv`` with the flipped,
  channel-transposed weight.
- ``batch_norm_variance``: ``ReduceSumSquare`` against ``ReduceMean(Mul)`` for the batch-norm backward's
  per-channel variance (rules/norm.py ``_batch_norm_training_y``).
"""

from __future__ import annotations

import time

import numpy as np

INT64_MIN = int(np.iinfo(np.int64).min)


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
            "max_rel_diff": {"revgraph": float(np.abs(a - t).max() / scale),
                             "im2col": float(np.abs(b - t).max() / scale),
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
    return {"shape": {"x": list(x.shape), "w": list(w.shape)},
            "seconds": {k: float(np.median(v)) for k, v in times.items()}}


# ------------------------------------------------------------------- candidates measured for the CNN's backward

#: the CNN's 3x3 stride-1 layers: (channels in, channels out, image size), batch 64
CNN_3X3 = ((16, 16, 32), (32, 32, 16), (64, 64, 8))


def _ints(inits: list, name: str, v) -> str:
    from onnx import numpy_helper

    inits.append(numpy_helper.from_array(np.array(v, np.int64), name))
    return name


def _wgrad_model(nodes, inits, n, c, m, h):
    from onnx import TensorProto as T
    from onnx import helper

    return _opset(nodes, [helper.make_tensor_value_info("x", T.FLOAT, [n, c, h, h]),
                          helper.make_tensor_value_info("dy", T.FLOAT, [n, m, h, h])],
                  [helper.make_tensor_value_info("dw", T.FLOAT, [m, c, 3, 3])], inits)


def _wgrad_revgraph(n, c, m, h):
    """The weight gradient revgraph writes for a 3x3 pad-1 Conv (rules/conv.py), output renamed ``dw``."""
    from onnx import TensorProto as T
    from onnx import helper

    import revgraph as rg
    from revgraph.ir import Graph, Node, ValueInfo

    g = Graph([Node("Conv", ["x", "w"], ["y"], {"pads": [1, 1, 1, 1]}, "conv"),
               Node("Mul", ["y", "dy"], ["p"], name="p"), Node("ReduceSum", ["p"], ["loss"], {"keepdims": 0}, "loss")],
              [ValueInfo("x", np.float32, (n, c, h, h)), ValueInfo("w", np.float32, (m, c, 3, 3)),
               ValueInfo("dy", np.float32, (n, m, h, h))], [ValueInfo("loss", np.float32, ())])
    model = _only(rg.to_onnx(rg.gradient(g, "loss", ["w"])), "w_grad")
    for node in model.graph.node:
        node.output[:] = ["dw" if o == "w_grad" else o for o in node.output]
    del model.graph.output[:]
    model.graph.output.extend([helper.make_tensor_value_info("dw", T.FLOAT, [m, c, 3, 3])])
    return model


def _wgrad_gemm_per_tap(n, c, m, h, dy_rows: bool):
    """``x`` transposed once to ``[C, N, H, W]`` and padded, nine strided ``Slice`` taps, one 2-D ``MatMul``
    per tap over ``K = N*H*W`` (no batched GEMMs, no sum over the batch): ``[C, NHW] x [NHW, M]`` with ``dy``
    transposed to NHWC, or (``dy_rows``) ``[M, NHW] x [NHW, C]`` with the tap transposed into the GEMM."""
    from onnx import helper

    inits: list = []
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
             helper.make_node("Pad", ["xt", _ints(inits, "pads", [0, 0, 1, 1, 0, 0, 1, 1])], ["xp"]),
             helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3] if dy_rows else [0, 2, 3, 1]),
             helper.make_node("Flatten", ["dyt"], ["D"], axis=1 if dy_rows else 3)]
    taps = []
    for i, j in np.ndindex(3, 3):
        nodes += [helper.make_node("Slice", ["xp", _ints(inits, f"b{i}{j}", [i, j]),
                                             _ints(inits, f"e{i}{j}", [i + h, j + h]),
                                             _ints(inits, f"a{i}{j}", [2, 3])],
                                   [f"s{i}{j}"]),
                  helper.make_node("Flatten", [f"s{i}{j}"], [f"f{i}{j}"], axis=1)]
        if dy_rows:
            nodes += [helper.make_node("Transpose", [f"f{i}{j}"], [f"ft{i}{j}"], perm=[1, 0]),
                      helper.make_node("MatMul", ["D", f"ft{i}{j}"], [f"t{i}{j}"])]      # [M, C]
        else:
            nodes.append(helper.make_node("MatMul", [f"f{i}{j}", "D"], [f"t{i}{j}"]))  # [C, M]
        taps.append(f"t{i}{j}")
    perm = [0, 2, 1] if dy_rows else [2, 0, 1]
    nodes += [helper.make_node("Concat", taps, ["cat"], axis=1),
              helper.make_node("Reshape", ["cat", _ints(inits, "r3", [0, 9, -1])], ["c3"]),
              helper.make_node("Transpose", ["c3"], ["tt"], perm=perm),
              helper.make_node("Reshape", ["tt", _ints(inits, "s", [m, c, 3, 3])], ["dw"])]
    return _wgrad_model(nodes, inits, n, c, m, h)


def _wgrad_wide_rows(n, c, m, h):
    """Contiguous taps: ``x`` padded by (1, 2) rows and (1, 1) columns and flattened per image and channel, so
    tap ``(i, j)`` is the 1-D slice at offset ``i*(W+2) + j``; ``dy`` padded by two zero columns to the same
    ``W+2`` row length; one batched ``MatMul`` per tap and a sum over the batch (6% more multiply-adds)."""
    from onnx import helper

    wp, inits = h + 2, []
    nodes = [helper.make_node("Pad", ["x", _ints(inits, "pads", [0, 0, 1, 1, 0, 0, 2, 1])], ["xp"]),
             helper.make_node("Reshape", ["xp", _ints(inits, "r1", [n, c, -1])], ["xf"]),
             helper.make_node("Pad", ["dy", _ints(inits, "dpads", [0, 0, 0, 0, 0, 0, 0, 2])], ["dyp"]),
             helper.make_node("Reshape", ["dyp", _ints(inits, "r2", [n, m, -1])], ["dyf"]),
             helper.make_node("Transpose", ["dyf"], ["D"], perm=[0, 2, 1])]
    taps = []
    for i, j in np.ndindex(3, 3):
        off = i * wp + j
        nodes += [helper.make_node("Slice", ["xf", _ints(inits, f"b{i}{j}", [off]),
                                             _ints(inits, f"e{i}{j}", [off + h * wp]), _ints(inits, f"a{i}{j}", [2])],
                                   [f"s{i}{j}"]),
                  helper.make_node("MatMul", [f"s{i}{j}", "D"], [f"t{i}{j}"])]
        taps.append(f"t{i}{j}")
    nodes += [helper.make_node("Concat", taps, ["cat"], axis=1),
              helper.make_node("ReduceSum", ["cat", _ints(inits, "a0", [0])], ["red"], keepdims=0),
              helper.make_node("Reshape", ["red", _ints(inits, "r3", [9, c, m])], ["c3"]),
              helper.make_node("Transpose", ["c3"], ["tt"], perm=[2, 1, 0]),
              helper.make_node("Reshape", ["tt", _ints(inits, "s", [m, c, 3, 3])], ["dw"])]
    return _wgrad_model(nodes, inits, n, c, m, h)


def _wgrad_onehot_unfold(n, c, m, h):
    """im2col without Slice: a grouped Conv with one-hot 3x3 kernels (9 per channel) unfolds ``x`` to
    ``[N, C*9, H*W]``, then one batched ``MatMul`` with ``dy`` and a sum over the batch."""
    from onnx import helper, numpy_helper

    k = np.zeros((c * 9, 1, 3, 3), np.float32)
    for ci, t in np.ndindex(c, 9):
        k[ci * 9 + t, 0, t // 3, t % 3] = 1
    inits = [numpy_helper.from_array(k, "K")]
    nodes = [helper.make_node("Conv", ["x", "K"], ["u"], pads=[1, 1, 1, 1], group=c),
             helper.make_node("Reshape", ["u", _ints(inits, "r1", [n, c * 9, -1])], ["U"]),
             helper.make_node("Reshape", ["dy", _ints(inits, "r2", [n, m, -1])], ["dyf"]),
             helper.make_node("Transpose", ["dyf"], ["D"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["U", "D"], ["t"]),
             helper.make_node("ReduceSum", ["t", _ints(inits, "a0", [0])], ["red"], keepdims=0),
             helper.make_node("Transpose", ["red"], ["tt"], perm=[1, 0]),
             helper.make_node("Reshape", ["tt", _ints(inits, "s", [m, c, 3, 3])], ["dw"])]
    return _wgrad_model(nodes, inits, n, c, m, h)


def _clock(threads: int):
    """CPU time for one thread (less sensitive to other processes), wall time otherwise."""
    return time.thread_time if threads == 1 else time.perf_counter


def _side_by_side(runners: dict, threads: int, seconds: float, rounds: int) -> dict:
    clock, times = _clock(threads), {k: [] for k in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            run()
            t0, n = clock(), 0
            while clock() - t0 < seconds or n < 3:
                run()
                n += 1
            times[name].append((clock() - t0) / n)
    return {k: float(np.median(v)) for k, v in times.items()}


def conv_weight_grad_forms(threads: int = 1, seconds: float = 0.15, rounds: int = 5) -> list[dict]:
    """The weight-gradient forms tried against revgraph's per-tap batched MatMul on the CNN's 3x3 stride-1
    layers (batch 64), with PyTorch's ``convolution_backward`` (weight only) for reference; every form is
    checked against PyTorch. Measured (1 thread, CPU ms, c16/c32/c64 layers): revgraph 6.15/3.56/3.94,
    per-tap 2-D GEMM over K = N*H*W 4.97/3.24/2.96, wide-row contiguous taps 4.86/3.13/3.94, one-hot Conv
    unfold 6.74/4.17/4.50, PyTorch 2.06/1.45/1.48. Neither faster form made the whole CNN step faster (1
    thread, 7-15 alternating turns, CPU time): the per-tap 2-D GEMM 0.97x-1.01x of the step time over five
    comparisons of its two layouts (onnxruntime's profile of the step: its ``Transpose`` nodes of ``x`` and
    ``dy`` took 4.1 ms where the batched form's took 0.3, its GEMMs 13.4 ms against 13.7), the wide rows
    1.04x, and cutting the taps that read no padding from ``x`` itself (no copy for a centre tap) 1.02x:
    the step is bound by memory traffic, which a copy just before its GEMM hardly adds to. So rules/conv.py
    keeps the batched form."""
    import onnxruntime as ort  # noqa: F401  (the sessions below)
    import torch

    forms = {"revgraph (per-tap batched MatMul, sum over N)": _wgrad_revgraph,
             "per-tap 2-D GEMM [C, NHW] x [NHW, M]": lambda *a: _wgrad_gemm_per_tap(*a, dy_rows=False),
             "per-tap 2-D GEMM [M, NHW] x [NHW, C]": lambda *a: _wgrad_gemm_per_tap(*a, dy_rows=True),
             "wide rows (contiguous 1-D taps)": _wgrad_wide_rows,
             "one-hot grouped Conv unfold, one MatMul": _wgrad_onehot_unfold}
    torch.set_num_threads(threads)
    out = []
    for c, m, h in CNN_3X3:
        n, rng = 64, np.random.default_rng(0)
        x = rng.standard_normal((n, c, h, h)).astype(np.float32)
        dy = rng.standard_normal((n, m, h, h)).astype(np.float32)
        w = rng.standard_normal((m, c, 3, 3)).astype(np.float32)
        tx, tdy, tw = torch.from_numpy(x), torch.from_numpy(dy), torch.from_numpy(w)

        def torch_run(tx=tx, tdy=tdy, tw=tw):
            return torch.ops.aten.convolution_backward(tdy, tx, tw, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                       [False, True, False])[1]

        ref = torch_run().numpy()
        runners, diffs = {"PyTorch convolution_backward (weight)": torch_run}, {}
        for name, make in forms.items():
            s = _session(make(n, c, m, h), threads)
            feeds = {i.name: {"x": x, "dy": dy, "w": w}[i.name] for i in s.get_inputs()}
            diffs[name] = float(np.abs(s.run(["dw"], feeds)[0] - ref).max() / np.abs(ref).max())
            runners[name] = lambda s=s, f=feeds: s.run(["dw"], f)
        out.append({"x": [n, c, h, h], "w": [m, c, 3, 3], "max_rel_diff": diffs,
                    "seconds": _side_by_side(runners, threads, seconds, rounds)})
    return out


def conv_input_grad(threads: int = 1, seconds: float = 0.15, rounds: int = 5) -> list[dict]:
    """The input gradient of the CNN's 3x3 stride-1 layers as revgraph writes it (``ConvTranspose(dy, w)``)
    against a ``Conv`` of ``dy`` with the flipped, channel-transposed weight (computed in the graph, as in a
    training step) and PyTorch. Measured (1 thread, CPU ms, c16/c32/c64): ConvTranspose 2.91/2.27/2.25,
    Conv 3.48/2.76/2.25, PyTorch 2.10/1.57/1.39: onnxruntime's Conv with a computed weight takes the generic
    im2col path too, so ConvTranspose stays."""
    import torch
    from onnx import TensorProto as T
    from onnx import helper

    torch.set_num_threads(threads)
    out = []
    for c, m, h in CNN_3X3:
        n, rng = 64, np.random.default_rng(0)
        dy = rng.standard_normal((n, m, h, h)).astype(np.float32)
        w = rng.standard_normal((m, c, 3, 3)).astype(np.float32)
        vi = [helper.make_tensor_value_info("dy", T.FLOAT, [n, m, h, h]),
              helper.make_tensor_value_info("w", T.FLOAT, [m, c, 3, 3])]
        dx = [helper.make_tensor_value_info("dx", T.FLOAT, [n, c, h, h])]
        inits: list = []
        flipped = [helper.make_node("Slice", ["w", _ints(inits, "st", [-1, -1]), _ints(inits, "en", [INT64_MIN] * 2),
                                              _ints(inits, "ax", [2, 3]), _ints(inits, "sp", [-1, -1])], ["wf"]),
                   helper.make_node("Transpose", ["wf"], ["wt"], perm=[1, 0, 2, 3]),
                   helper.make_node("Conv", ["dy", "wt"], ["dx"], pads=[1, 1, 1, 1])]
        transposed = helper.make_node("ConvTranspose", ["dy", "w"], ["dx"], pads=[1, 1, 1, 1])
        sessions = {"ConvTranspose(dy, w) (revgraph)": _session(_opset([transposed], vi, dx, []), threads),
                    "Conv(dy, flip(w) transposed)": _session(_opset(flipped, vi, dx, inits), threads)}
        tdy, tw, tx = torch.from_numpy(dy), torch.from_numpy(w), torch.zeros(n, c, h, h)

        def torch_run(tdy=tdy, tw=tw, tx=tx):
            return torch.ops.aten.convolution_backward(tdy, tx, tw, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                       [True, False, False])[0]

        ref = torch_run().numpy()
        runners = {"PyTorch convolution_backward (input)": torch_run}
        for name, s in sessions.items():
            assert np.abs(s.run(None, {"dy": dy, "w": w})[0] - ref).max() <= 1e-4 * np.abs(ref).max()
            runners[name] = lambda s=s, f={"dy": dy, "w": w}: s.run(None, f)
        out.append({"dy": [n, m, h, h], "w": [m, c, 3, 3], "seconds": _side_by_side(runners, threads, seconds, rounds)})
    return out


def batch_norm_variance(threads: int = 1, seconds: float = 0.1, rounds: int = 5) -> list[dict]:
    """The per-channel sum of squares of the batch-norm backward (rules/norm.py ``_batch_norm_training_y``) on
    the CNN's activation shapes: ``ReduceSumSquare(d)`` against ``ReduceMean(Mul(d, d))``. Measured (1
    thread, CPU ms, [64,16,32,32] / [64,32,16,16] / [64,64,8,8]): ReduceSumSquare 0.513/0.258/0.135,
    ReduceMean(Mul) 0.139/0.081/0.050 (onnxruntime's ReduceSumSquare misses its fast reduction path)."""
    from onnx import TensorProto as T
    from onnx import helper

    out = []
    for shape in ([64, 16, 32, 32], [64, 32, 16, 16], [64, 64, 8, 8]):
        inits: list = []
        ax = _ints(inits, "ax", [0, 2, 3])
        vi = [helper.make_tensor_value_info("d", T.FLOAT, shape)]
        v = [helper.make_tensor_value_info("v", T.FLOAT, None)]
        forms = {"ReduceSumSquare(d)": [helper.make_node("ReduceSumSquare", ["d", ax], ["v"])],
                 "ReduceMean(Mul(d, d)) (revgraph)": [helper.make_node("Mul", ["d", "d"], ["dd"]),
                                                      helper.make_node("ReduceMean", ["dd", ax], ["v"])]}
        d = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        sessions = {k: _session(_opset(nodes, vi, v, inits), threads) for k, nodes in forms.items()}
        runners = {k: (lambda s=s, f={"d": d}: s.run(None, f)) for k, s in sessions.items()}
        out.append({"shape": shape, "seconds": _side_by_side(runners, threads, seconds, rounds)})
    return out


def batch_norm_backward(threads: int = 1, seconds: float = 0.15, rounds: int = 5) -> list[dict]:
    """The training-mode batch-norm VJP revgraph writes for a step (the cotangent of Y only; gradients of X,
    scale and B), on the CNN's activation shapes: the form through onnxruntime's fused batch-norm kernels
    (static shapes, rules/norm.py ``_batch_norm_training_fused``) against the form of single passes that
    revgraph writes when the batch is symbolic (``_batch_norm_training_y``), and PyTorch's
    ``native_batch_norm_backward``. Measured (1 thread, CPU ms, the three shapes): fused 0.91/0.46/0.25,
    single passes 1.31/0.58/0.39, PyTorch 0.34/0.12/0.07. On the whole CNN step (1 thread, 9-11 alternating
    turns, CPU time): the form of single passes 0.91x the step time of the Stats-based form it replaced (74.2
    -> 67.5 ms), the fused form 0.96x-0.98x the form of single passes (four comparisons), both together 0.89x
    (71.3 -> 63.6 ms; 2 threads 0.91x). ``Einsum("nchw,nchw->c")`` for ``sum(dY xh)`` is 7-8x slower than
    ``Mul`` and ``ReduceSum`` on onnxruntime."""
    import torch

    import revgraph as rg
    from revgraph.ir import Graph, Node, ValueInfo

    torch.set_num_threads(threads)
    out = []
    for shape in ([64, 16, 32, 32], [64, 32, 16, 16], [64, 64, 8, 8]):
        c, rng = shape[1], np.random.default_rng(0)
        x, u = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        scale, bias = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
        stats = {"mean": np.zeros(c, np.float32), "var": np.ones(c, np.float32)}
        models = {}
        for name, xshape in (("fused kernels (revgraph, static shapes)", tuple(shape)),
                             ("single passes (revgraph, symbolic batch)", ("N", *shape[1:]))):
            g = Graph([Node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y", "rm", "rv"],
                            {"training_mode": 1}, "bn")],
                      [ValueInfo("x", np.float32, xshape), ValueInfo("scale", np.float32, (c,)),
                       ValueInfo("bias", np.float32, (c,))], [ValueInfo("y", np.float32, xshape)], initializers=stats)
            # the cotangent of Y as the input y_grad: the VJP alone, no loss
            model = rg.to_onnx(rg.gradient(g, "y", ["x", "scale", "bias"], seed="input"))
            keep, needed = [], {"x_grad", "scale_grad", "bias_grad"}
            for node in reversed(model.graph.node):  # the VJP only: not the forward node or the loss
                if any(o in needed for o in node.output):
                    keep.append(node)
                    needed.update(node.input)
            del model.graph.node[:]
            model.graph.node.extend(reversed(keep))
            outs = [o for o in model.graph.output if o.name.endswith("_grad")]
            del model.graph.output[:]
            model.graph.output.extend(outs)
            ins = [i for i in model.graph.input if i.name in needed]
            del model.graph.input[:]
            model.graph.input.extend(ins)
            models[name] = model
        feeds = {"x": x, "scale": scale, "bias": bias, "y_grad": u}
        tx, tu, ts, tb = (torch.from_numpy(a) for a in (x, u, scale, bias))
        _, tmean, tinv = torch.ops.aten.native_batch_norm(tx, ts, tb, None, None, True, 0.1, 1e-5)

        def torch_run(tx=tx, tu=tu, ts=ts, tmean=tmean, tinv=tinv):
            return torch.ops.aten.native_batch_norm_backward(tu, tx, ts, None, None, tmean, tinv, True, 1e-5,
                                                             [True, True, True])

        ref = [t.numpy() for t in torch_run()]
        runners, diffs = {"PyTorch native_batch_norm_backward": torch_run}, {}
        for name, model in models.items():
            s = _session(model, threads)
            f = {i.name: feeds[i.name] for i in s.get_inputs()}
            got = s.run(["x_grad", "scale_grad", "bias_grad"], f)
            diffs[name] = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got, ref, strict=True))
            runners[name] = lambda s=s, f=f: s.run(["x_grad", "scale_grad", "bias_grad"], f)
        out.append({"shape": shape, "max_rel_diff": diffs, "nodes": {k: len(m.graph.node) for k, m in models.items()},
                    "seconds": _side_by_side(runners, threads, seconds, rounds)})
    return out
