"""``revgraph show`` and :mod:`revgraph.tools.viz`: DOT text checked at the parse level (clusters, colours, shapes,
labels), SVG/PNG rendering through ``dot`` when it is installed, the one-line message when it is not, and
atomic writes that leave nothing behind on failure."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA_DIR
from kit.loops import F64, body, const, graph, loop, n

import revgraph as rg
from revgraph.cli import main
from revgraph.ir import Graph, ValueInfo
from revgraph.tools import viz

MM_MODEL = DATA_DIR / "pytorch-operator" / "test_operator_mm" / "model.onnx"
GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "differentiate.md"


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich would fold long paths in messages at 80 columns


# --------------------------------------------------------------------------------------- a small DOT reader


def parse_dot(text: str) -> dict:
    """Clusters (name -> parent cluster, label), nodes (id -> attrs, cluster) and edges (src, dst, attrs) of
    the DOT text to_dot writes (one statement per line). Checks that braces balance and strings close."""
    attr_re = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|<.*>)')

    def attrs(s: str) -> dict[str, str]:
        return {k: v[1:-1] if v.startswith('"') else v for k, v in attr_re.findall(s)}

    clusters: dict[str, dict] = {}
    nodes: dict[str, dict] = {}
    edges: list[tuple[str, str, dict]] = []
    stack: list[str] = []
    lines = text.splitlines()
    assert lines[0] == "digraph revgraph {" and lines[-1] == "}"
    for line in lines[1:-1]:
        s = line.strip()
        if m := re.fullmatch(r'subgraph "(cluster_[^"]*)" \{', s):
            clusters[m[1]] = {"parent": stack[-1] if stack else None}
            stack.append(m[1])
        elif s == "}":
            assert stack, "unbalanced braces"
            stack.pop()
        elif s.startswith("label=") and stack:
            clusters[stack[-1]]["label"] = attrs(s)["label"]
        elif m := re.fullmatch(r"(\w+) -> (\w+) \[(.*)\]", s):
            edges.append((m[1], m[2], attrs(m[3])))
        elif m := re.fullmatch(r"(\w+) \[(.*)\];?", s):
            if m[1] in ("graph", "node", "edge"):
                continue
            assert m[1] not in nodes, f"node {m[1]} declared twice"
            nodes[m[1]] = {**attrs(m[2]), "_cluster": stack[-1] if stack else None}
        else:
            raise AssertionError(f"unexpected DOT line: {line!r}")
    assert not stack, "unbalanced braces"
    for src, dst, _ in edges:
        assert src in nodes and dst in nodes, f"edge {src} -> {dst} to an undeclared node"
    return {"clusters": clusters, "nodes": nodes, "edges": edges}


def by_label(dot: dict, first_line: str, second: str | None = None) -> list[dict]:
    found = []
    for node in dot["nodes"].values():
        parts = node.get("label", "").split("\\n")
        if parts[0] == first_line and (second is None or (len(parts) > 1 and parts[1] == second)):
            found.append(node)
    return found


def depth(dot: dict, cluster: str) -> int:
    d, c = 0, cluster
    while c is not None:
        d, c = d + 1, dot["clusters"][c]["parent"]
    return d


# ------------------------------------------------------------------------------------------------ models


def accum_model() -> Graph:
    """loss = sum(x * w + x): x is read twice, so its gradient is accumulated."""
    return graph([n("Mul", ["x", "w"], "xw"), n("Add", ["xw", "x"], "y"), n("ReduceSum", ["y"], "loss", keepdims=0)],
                 {"x": (3,), "w": (3,)}, ["loss"])


def loop_model() -> Graph:
    """s <- s * x for M steps, with a scan output y = s_out^2 + x."""
    b = body([n("Mul", ["s_in", "x"], "s_out"), n("Mul", ["s_out", "s_out"], "sq"), n("Add", ["sq", "x"], "y")],
             [("s_in", "s_out")], scan=["y"], types={"s_in": (3,), "s_out": (3,)})
    return graph([loop(b, "M", ["s0"], ["s", "ys"]), n("ReduceSum", ["s"], "l1", keepdims=0),
                  n("ReduceSum", ["ys"], "l2", keepdims=0), n("Add", ["l1", "l2"], "loss")],
                 {"x": (3,), "s0": (3,)}, ["loss"], {"M": np.array(3, np.int64)})


def nested_model() -> Graph:
    inner = body([n("Mul", ["s3_in", "w"], "s3_out")], [("s3_in", "s3_out")], iter_name="k", cond_name="c3")
    middle = body([loop(inner, "M2", ["s2_in"], ["s2_mid"], "inner"), n("Sin", ["s2_mid"], "s2_out")],
                  [("s2_in", "s2_out")], iter_name="j", cond_name="c2")
    outer = body([loop(middle, "M3", ["s1_in"], ["s1_mid"], "middle"), n("Mul", ["s1_mid", "w"], "s1_out")],
                 [("s1_in", "s1_out")])
    return graph([loop(outer, "M", ["s0"], ["s"], "outer"), n("ReduceSum", ["s"], "loss", keepdims=0)],
                 {"s0": (2,), "w": (2,)}, ["loss"],
                 {"M": np.array(2, np.int64), "M2": np.array(2, np.int64), "M3": np.array(3, np.int64)})


def if_model() -> Graph:
    then = Graph([n("Sqrt", ["x"], "r")], [], [ValueInfo("r", F64, None)], name="then")
    other = Graph([n("Identity", ["x"], "r2")], [], [ValueInfo("r2", F64, None)], name="else")
    return graph([const("zero", 0.0), n("Greater", ["x", "zero"], "pos"),
                  n("If", ["pos"], ["y"], "if", then_branch=then, else_branch=other), n("Mul", ["y", "x"], "loss")],
                 {"x": ()}, ["loss"])


def chain_model(length: int) -> Graph:
    nodes, prev = [], "x"
    for k in range(length):
        nodes.append(n("Tanh", [prev], f"a_very_long_activation_name_number_{k}"))
        prev = f"a_very_long_activation_name_number_{k}"
    nodes.append(n("ReduceSum", [prev], "loss", keepdims=0))
    return graph(nodes, {"x": (2,)}, ["loss"])


# ------------------------------------------------------------------------------------------------ DOT text


def test_forward_loop_is_a_cluster_holding_its_node_and_body():
    dot = parse_dot(viz.to_dot(loop_model()))
    (cluster,) = dot["clusters"]
    assert cluster.startswith("cluster_") and "Loop" in dot["clusters"][cluster]["label"]
    inside = {v["label"] for v in dot["nodes"].values() if v["_cluster"] == cluster}
    assert {"Loop\\nloop", "Mul\\nMul_s_out", "Mul\\nMul_sq", "Add\\nAdd_y"} <= inside
    assert {"s_in", "s_out", "y", "i"} <= inside  # body inputs and outputs, drawn in the cluster
    outside = {v["label"] for v in dot["nodes"].values() if v["_cluster"] is None}
    assert "ReduceSum\\nReduceSum_l1" in outside
    # graph inputs, initializers and outputs are distinct nodes, in distinct styles
    (x,) = by_label(dot, "x")
    (m,) = by_label(dot, "M")
    (loss,) = by_label(dot, "loss")
    assert x["shape"] == "ellipse" and m["shape"] == "box" and loss.get("peripheries") == "2"
    assert len({x["fillcolor"], m["fillcolor"]}) == 2
    # the captured value x enters the body directly; no backward node anywhere, so no legend
    assert all(v["fillcolor"] == viz.STYLES["forward"]["fillcolor"] for v in by_label(dot, "Mul"))
    assert "legend" not in dot["nodes"]


def test_nested_loops_are_nested_clusters():
    dot = parse_dot(viz.to_dot(nested_model()))
    labels = {c["label"]: depth(dot, name) for name, c in dot["clusters"].items()}
    assert labels == {"Loop outer": 1, "Loop middle": 2, "Loop inner": 3}


def test_if_branches_are_two_clusters_inside_the_if_cluster():
    dot = parse_dot(viz.to_dot(if_model()))
    clusters = dot["clusters"]
    (top,) = [c for c, v in clusters.items() if v["parent"] is None]
    assert sorted(v["label"] for v in clusters.values() if v["parent"] == top) == ["else_branch", "then_branch"]


def test_backward_nodes_are_coloured_and_accumulation_is_marked():
    gg = rg.gradient(accum_model(), wrt=["x", "w"])
    dot = parse_dot(viz.to_dot(gg))
    fwd, bwd, acc = (viz.STYLES[k] for k in ("forward", "backward", "accum"))
    assert fwd["fillcolor"] != bwd["fillcolor"] != acc["fillcolor"] and acc["shape"] != bwd["shape"]
    kinds = {viz.node_kind(node) for node in gg.nodes}
    assert kinds == {"forward", "backward", "seed", "accum"}
    (sum_node,) = [v for v in dot["nodes"].values() if v.get("label", "").startswith("Sum\\naccum/x")]
    assert sum_node["shape"] == acc["shape"] == "hexagon" and sum_node["fillcolor"] == acc["fillcolor"]
    backward = [v for v in dot["nodes"].values() if "\\ngrad/" in v.get("label", "")]
    assert backward and all(v["fillcolor"] == bwd["fillcolor"] for v in backward)
    assert all(v["fillcolor"] == fwd["fillcolor"] for v in by_label(dot, "Mul", "Mul_xw"))
    # gradient outputs are output nodes in the backward colour; there is a legend
    (xg,) = by_label(dot, "x_grad")
    assert xg["peripheries"] == "2" and xg["fillcolor"] == bwd["fillcolor"]
    assert "accumulation" in dot["nodes"]["legend"]["label"]
    # edges from backward nodes are drawn in the backward colour
    back_ids = {k for k, v in dot["nodes"].items() if "\\ngrad/" in v.get("label", "")}
    assert {e["color"] for s, _, e in dot["edges"] if s in back_ids} == {"#b45f06"}


def test_gradient_of_a_loop_has_a_backward_loop_cluster():
    gg = rg.gradient(loop_model())
    dot = parse_dot(viz.to_dot(gg))
    fill = dict(dot["clusters"].items())
    assert len(fill) == 2
    backward = [c for c in fill if "grad" in dot["clusters"][c]["label"]]
    assert len(backward) == 1
    inside = [v for v in dot["nodes"].values() if v["_cluster"] == backward[0]]
    assert any(v.get("shape") == "hexagon" for v in inside)  # accumulation inside the backward body
    assert any(v.get("fillcolor") == viz.STYLES["backward"]["fillcolor"] and v["label"].startswith("Loop")
               for v in inside)


def test_edge_labels_name_values_and_are_omitted_when_redundant_or_too_many():
    dot = parse_dot(viz.to_dot(rg.gradient(accum_model(), wrt=["x"])))
    labels = {e.get("label") for _, _, e in dot["edges"]}
    assert {"xw", "y"} <= labels  # forward values
    assert not any(lab and lab.startswith("grad/") for lab in labels)  # backward values are named after nodes
    small = parse_dot(viz.to_dot(chain_model(5)))
    assert any(len(e.get("label", "")) > 0 and "\u2026" in e["label"] for _, _, e in small["edges"])  # shortened
    assert all(len(e.get("label", "")) <= 28 for _, _, e in small["edges"])
    big = parse_dot(viz.to_dot(chain_model(200)))
    assert not any(e.get("label") for _, _, e in big["edges"])
    assert parse_dot(viz.to_dot(chain_model(200), edge_labels=True))["edges"][1][2].get("label")


def test_large_gradient_graphs_cut_long_edges_and_fold_constants():
    gg = rg.gradient(chain_model(150))
    assert sum(1 for _ in gg.walk()) > 250
    dot = parse_dot(viz.to_dot(gg))
    refs = [v for k, v in dot["nodes"].items() if k.startswith("r")]
    assert refs and all(v["label"].startswith("\u2191 ") for v in refs)
    assert not by_label(dot, "Constant")
    uncut = parse_dot(viz.to_dot(gg, cut_long_edges=False))
    assert not any(k.startswith("r") for k in uncut["nodes"]) and by_label(uncut, "Constant")


def test_many_initializers_fold_into_their_readers():
    inits = {f"w{k}": np.full(2, float(k)) for k in range(5)}
    nodes = [n("Add", ["x", "w0"], "h0")] + [n("Add", [f"h{k - 1}", f"w{k}"], f"h{k}") for k in range(1, 5)]
    g = graph([*nodes, n("ReduceSum", ["h4"], "loss", keepdims=0)], {"x": (2,)}, ["loss"], inits)
    shown = parse_dot(viz.to_dot(g))
    (w3,) = by_label(shown, "w3")
    assert w3["shape"] == "box" and w3["label"] == "w3\\n2"  # small boxes with their shapes
    folded = parse_dot(viz.to_dot(g, initializers="fold"))
    assert not any(v["label"].startswith("w3") for v in folded["nodes"].values() if "label" in v)
    assert "+1 initializer" in by_label(folded, "Add", "Add_h3")[0]["label"]


def test_names_with_quotes_and_backslashes_are_escaped():
    g = graph([n("Neg", ['we"ird\\path'], "y", name='node "q"'), n("ReduceSum", ["y"], "loss", keepdims=0)],
              {'we"ird\\path': (2,)}, ["loss"])
    dot = parse_dot(viz.to_dot(g, title='a "title"'))
    # the backslash is doubled in what graphviz shows, as the terminal shows it (revgraph.text.literal): the name
    # drawn can be read back, a name's own backslash told from an escape (issue 28, part 4)
    assert by_label(dot, 'we\\"ird\\\\\\\\path') and by_label(dot, "Neg", 'node \\"q\\"')


def test_control_characters_in_names_are_escaped_in_the_dot_file():
    """A NUL (and ESC, a carriage return, a bidirectional override) in a name was written raw into ``show``'s DOT
    file: it is written as the visible escape the terminal shows, so the file holds no control character and
    graphviz draws ``a\\x00b``; a name's own backslash is doubled, so ``a\\nb`` and ``a<newline>b`` differ, and a
    newline in a name is drawn as the visible ``\\n``, never as a line break of the label (DOT's ``\\n``)."""
    names = ["a\x00b", "e\x1b[2Jc\r\u202e", "n\\nb", "n\nb"]
    g = graph([n("Neg", [names[0]], names[1], name="neg\x00"), n("Neg", [names[1]], names[2]),
               n("Neg", [names[2]], names[3]), n("ReduceSum", [names[3]], "loss", keepdims=0)],
              {names[0]: (2,)}, ["loss"])
    text = viz.to_dot(g)
    assert not [c for c in text if not c.isprintable() and c != "\n"], "a control character reached the DOT file"
    for shown in ("a\\\\x00b", "e\\\\x1b[2Jc\\\\r\\\\u202e", '"n\\\\\\\\nb"', '"n\\\\nb"', "neg\\\\x00"):
        assert shown in text, (shown, text)
    dot = viz.find_dot() if shutil.which("dot") else None
    if dot:  # graphviz reads the file (where installed: the file's text is checked above either way)
        done = subprocess.run([dot, "-Tsvg"], input=text.encode(), capture_output=True, timeout=60)
        assert done.returncode == 0 and b"a\\x00b" in done.stdout, done.stderr


# ---------------------------------------------------------------------------------------------- writing


def _fake_dot(tmp_path: Path, script: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    dot = bin_dir / "dot"
    dot.write_text("#!/bin/sh\n" + script)
    dot.chmod(0o755)
    return bin_dir


def test_writing_dot_text_is_atomic_and_needs_no_dot(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    text = viz.to_dot(loop_model())
    out = tmp_path / "out" / "g.dot"
    out.parent.mkdir()
    viz.write(text, out)
    assert out.read_text() == text and sorted(p.name for p in out.parent.iterdir()) == ["g.dot"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # a normal file, not mkstemp's private one


def test_a_failing_dot_leaves_nothing_behind_and_keeps_the_old_file(tmp_path, monkeypatch, capsys):
    # a dot that writes half a file, then fails
    bin_dir = _fake_dot(tmp_path, 'for a; do out="$a"; done\necho partial > "$out"\n'
                                  'echo "Error: syntax error in line 3" >&2\nexit 1\n')
    monkeypatch.setenv("PATH", str(bin_dir))
    work = tmp_path / "work"
    work.mkdir()
    old = work / "g.svg"
    old.write_text("old picture")
    code = main(["show", str(MM_MODEL), "-o", str(old)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "syntax error in line 3" in err and "Traceback" not in err
    assert sorted(p.name for p in work.iterdir()) == ["g.svg"] and old.read_text() == "old picture"


def test_missing_dot_is_one_line_saying_how_to_install_it(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    work = tmp_path / "work"
    work.mkdir()
    for suffix in ("svg", "png"):
        code = main(["show", str(MM_MODEL), "--grad", "-o", str(work / f"g.{suffix}")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert "dot" in err and "apt-get install graphviz" in err and "brew install graphviz" in err
        assert "-o FILE.dot" in err
    assert list(work.iterdir()) == []
    assert main(["show", str(MM_MODEL), "--grad", "-o", str(work / "g.dot")]) == 0  # DOT text needs nothing
    assert sorted(p.name for p in work.iterdir()) == ["g.dot"]
    parse_dot((work / "g.dot").read_text())


def test_show_renders_svg_and_png_with_dot(tmp_path, capsys):
    out_svg, out_png = tmp_path / "mm.svg", tmp_path / "loop.png"
    code = main(["show", str(MM_MODEL), "--grad", "-o", str(out_svg)])
    captured = capsys.readouterr()
    if shutil.which("dot") is None:  # no Graphviz here: the command says how to get it
        assert code == 2 and "apt-get install graphviz" in captured.err and not out_svg.exists()
        return
    assert code == 0, captured.err
    # seed (Constant, ConstantOfShape) and one Gemm per input; the gradient outputs need no Identity
    assert "2 forward and 4 backward nodes (0 accumulation), 0 subgraph clusters" in captured.out
    svg = out_svg.read_text()
    assert "<svg" in svg and "grad/Gemm_0" in svg and viz.STYLES["backward"]["fillcolor"] in svg
    loop_file = tmp_path / "loop.onnx"
    rg.save(loop_model(), loop_file)
    assert main(["show", str(loop_file), "--grad", "--checkpoint", "recompute", "-o", str(out_png)]) == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the DOT text of every model here is valid for dot itself
    for g in (nested_model(), if_model(), rg.gradient(nested_model()), rg.gradient(chain_model(150))):
        subprocess.run(["dot", "-Tcanon", "-o", "/dev/null"], input=viz.to_dot(g).encode(), check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop.onnx", "loop.png", "mm.svg"]


def test_show_of_a_saved_gradient_graph_colours_its_backward_nodes(tmp_path, capsys):
    grad_file, out = tmp_path / "mm.grad.onnx", tmp_path / "mm.grad.dot"
    assert main(["grad", str(MM_MODEL), "-o", str(grad_file)]) == 0
    assert main(["show", str(grad_file), "-o", str(out)]) == 0
    dot = parse_dot(out.read_text())
    assert [v for v in dot["nodes"].values() if v.get("fillcolor") == viz.STYLES["backward"]["fillcolor"]]
    assert "mm.grad.onnx" in out.read_text()  # the title names the file


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--loss", "3", "-o", "g.svg"], "--loss applies only with --grad"),
        (["--grad", "--wrt", "nope", "-o", "g.dot"], "nope"),
        (["-o", "g.jpg"], "FILE.svg, FILE.png or FILE.dot"),
        (["-o", "no/such/dir/g.dot"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["show", str(MM_MODEL), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expected in err, err
    assert list(tmp_path.iterdir()) == []


def test_guide_shows_the_command():
    text = GUIDE.read_text()
    assert "revgraph show" in text and "--grad" in text and "apt-get install graphviz" in text
