"""Pictures of graphs: Graphviz DOT text, rendered to SVG or PNG by the ``dot`` program.

:func:`to_dot` writes the DOT text itself (no Python graphviz package). What it draws:

- operator nodes, coloured by what they are, read from the names the backward pass gives its nodes
  (DESIGN.md section 5): forward nodes (blue), backward nodes ``grad/<forward node>/...`` (orange), seeds
  ``seed/<y>/...`` (yellow) and accumulation nodes ``accum/<value>/...`` (red hexagons, bold border);
  ``Constant`` nodes are drawn small;
- graph inputs (green ellipses), outputs (green double ellipses; orange for gradient outputs, those computed
  by backward nodes) and initializers (small grey boxes, or folded into their readers' labels when a graph has
  many of them);
- ``Loop``, ``Scan`` and ``If`` nodes as clusters (``subgraph cluster_...``) that hold the node and its
  bodies; a body's inputs and outputs are small white ellipses in it, and nested loops are nested clusters;
- edges labelled with the value they carry, when that adds something (not for values named after their
  producer, as backward values are) and while the graph is small enough for labels to stay readable; long
  names are shortened in the middle (SVG tooltips hold the full names).

:func:`write` writes DOT text, SVG or PNG atomically (a temporary file in the target directory, then
``os.replace``; nothing is left behind on failure). SVG and PNG need Graphviz's ``dot`` on ``PATH``;
:func:`find_dot` says how to install it when it is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RevgraphError
from ..ir import Graph, Node
from ..onnx_io.atomic import atomic_path
from ..text import literal

#: Output formats by file suffix.
FORMATS = {".svg": "svg", ".png": "png", ".dot": "dot", ".gv": "dot"}

#: Node kinds :func:`node_kind` tells apart, with their DOT attributes.
STYLES: dict[str, dict[str, str]] = {
    "forward": {"shape": "box", "style": "rounded,filled", "fillcolor": "#cfe2f3", "color": "#3d6fa5"},
    "backward": {"shape": "box", "style": "rounded,filled", "fillcolor": "#fce5cd", "color": "#b45f06"},
    "seed": {"shape": "box", "style": "rounded,filled", "fillcolor": "#fff2cc", "color": "#bf9000"},
    "accum": {"shape": "hexagon", "style": "filled,bold", "fillcolor": "#f4cccc", "color": "#990000",
              "penwidth": "2"},
}
_VALUE_STYLES: dict[str, dict[str, str]] = {
    "input": {"shape": "ellipse", "style": "filled", "fillcolor": "#d9ead3", "color": "#38761d"},
    "output": {"shape": "ellipse", "style": "filled", "fillcolor": "#d9ead3", "color": "#38761d", "peripheries": "2"},
    "grad_output": {"shape": "ellipse", "style": "filled", "fillcolor": "#fce5cd", "color": "#b45f06",
                    "peripheries": "2"},
    "initializer": {"shape": "box", "style": "filled", "fillcolor": "#eeeeee", "color": "#999999",
                    "fontsize": "8", "height": "0.2", "margin": "0.04,0.02"},
    "body_input": {"shape": "ellipse", "style": "dashed", "color": "#666666", "fontsize": "8", "height": "0.25"},
    "body_output": {"shape": "ellipse", "style": "dashed", "color": "#666666", "fontsize": "8", "height": "0.25"},
    "missing": {"shape": "plaintext", "fontcolor": "#cc0000", "fontsize": "8"},
}
_REF_STYLE = {"shape": "box", "style": "rounded,dashed", "color": "#3d6fa5", "fontcolor": "#3d6fa5", "fontsize": "8",
              "height": "0.2", "margin": "0.04,0.02"}
_FOLDED = {"folded": "initializer", "const": "constant"}
_UP = "\u2191 "
_EDGE_COLOURS = {"forward": "#5b7fa6", "backward": "#b45f06", "seed": "#bf9000", "accum": "#990000",
                 "input": "#38761d", "initializer": "#999999", "body_input": "#666666", "missing": "#cc0000"}
_CLUSTER_COLOURS = {"forward": ("#f3f8fc", "#3d6fa5"), "backward": ("#fff8f0", "#b45f06"),
                    "seed": ("#fffbee", "#bf9000"), "accum": ("#fdf2f2", "#990000")}


def node_kind(node: Node) -> str:
    """What a node is, from its name: ``"accum"``, ``"seed"``, ``"backward"`` or ``"forward"``.

    The backward pass names its nodes ``grad/<forward node>/...``, ``accum/<value>/...`` and ``seed/<y>/...``
    (DESIGN.md section 5), and the names survive saving and loading, so a gradient graph read back from a
    file is coloured the same way. Recomputations (``remat/<forward node>``, DESIGN.md section 7) run in the
    backward and are drawn as backward nodes.
    """
    name = node.name or ""
    if name.startswith("accum/"):
        return "accum"
    if name.startswith("seed/"):
        return "seed"
    if name.startswith(("grad/", "remat/")):  # (remat/: a forward node the memory planner reruns in the backward)
        return "backward"
    return "forward"


def shorten(text: str, width: int) -> str:
    """``text`` cut in the middle with an ellipsis to at most ``width`` characters (unchanged if it fits)."""
    if len(text) <= width or width < 5:
        return text
    head = (width - 1) // 3
    tail = width - 1 - head
    return text[:head] + "\u2026" + text[-tail:]


@dataclass
class DotOptions:
    """Knobs of :func:`to_dot`; the defaults keep large graphs readable.

    ``edge_labels``: ``"auto"`` (label edges while the graph has at most ``max_labelled_edges`` edges),
    ``True`` or ``False``. ``initializers``: ``"auto"`` (draw each as a small box while there are at most
    ``max_initializer_nodes`` of them, else fold them), ``"nodes"`` or ``"fold"`` (no boxes: each reader's
    label counts the initializers it reads, its tooltip names them). ``cut_long_edges``: ``"auto"`` (when there
    are more than ``max_uncut_nodes`` nodes), ``True`` or ``False``: draw each forward value that backward nodes
    read as a small reference (``\u2191 name``) next to them instead of an edge across the whole picture, and fold
    ``Constant`` nodes into their readers' labels (this also keeps ``dot`` fast on large graphs: minutes become
    seconds). ``name_width``: longer node names and value labels are shortened in the middle. ``legend``: add
    a legend when the graph has backward nodes.
    """

    edge_labels: bool | str = "auto"
    max_labelled_edges: int = 150
    initializers: str = "auto"
    max_initializer_nodes: int = 64
    name_width: int = 28
    cut_long_edges: bool | str = "auto"
    max_uncut_nodes: int = 250
    rankdir: str = "TB"
    legend: bool = True
    title: str | None = None


@dataclass
class _Edge:
    src: str
    dst: str
    value: str
    kind: str
    extra: dict[str, str] = field(default_factory=dict)


def _q(text: object) -> str:
    """A DOT double-quoted string. ``text`` is one line (a str) or several (a tuple of lines, joined by DOT's
    line break). Within a line every character is drawn as the terminal shows it (:func:`revgraph.text.literal`):
    a newline in a name is the visible ``\\n``, not a break, a NUL, ESC or bidirectional override its escape,
    and a backslash is doubled as on the terminal; the backslashes are then escaped for DOT, so that graphviz
    reads no escape (``\\N``, ``\\l``) of its own in a name and a NUL never reaches the file (dot stops reading
    a string at one)."""
    lines = text if isinstance(text, tuple) else (text,)
    return '"' + "\\n".join(literal(line).replace("\\", "\\\\").replace('"', '\\"') for line in lines) + '"'


def _attrs(attrs: dict[str, str]) -> str:
    return "[" + ", ".join(f"{k}={_q(v)}" for k, v in attrs.items()) + "]"


def _op_label_name(node: Node) -> str:
    """The part of a node's name worth showing next to its op type (``grad/fc1/Mul_2`` -> ``grad/fc1``)."""
    name = node.name or ""
    head, sep, last = name.rpartition("/")
    numbered = last.startswith(node.op_type + "_") and last[len(node.op_type) + 1:].isdigit()
    if sep and (last == node.op_type or numbered):
        name = head
    return "" if name == node.op_type else name


class _Writer:
    def __init__(self, opts: DotOptions, n_initializers: int, n_edges: int, n_nodes: int):
        self.opts = opts
        self.lines: list[str] = []
        self.edges: list[_Edge] = []
        self.counter = 0
        self.clusters = 0
        self.kinds: dict[str, int] = {}
        self.refs: dict[tuple[int, str], str] = {}
        self._top_insert = 0  # where placeholders of the top level go (after the graph attributes)
        self.cut = opts.cut_long_edges is True or (opts.cut_long_edges == "auto" and n_nodes > opts.max_uncut_nodes)
        self.fold = opts.initializers == "fold" or (
            opts.initializers == "auto" and n_initializers > opts.max_initializer_nodes)
        if opts.initializers not in ("auto", "fold", "nodes"):
            raise RevgraphError(f"unknown initializers option {opts.initializers!r}; choose auto, nodes or fold")
        self.labels = opts.edge_labels is True or (opts.edge_labels == "auto" and n_edges <= opts.max_labelled_edges)

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def emit(self, depth: int, text: str) -> None:
        self.lines.append("  " * depth + text)

    def value_node(self, depth: int, kind: str, name: str, extra_label: str = "") -> str:
        vid = self.fresh("v")
        attrs = dict(_VALUE_STYLES[kind])
        label = (shorten(name, self.opts.name_width), *((extra_label,) if extra_label else ()))  # (lines: _q)
        attrs.update(label=label, tooltip=f"{kind.replace('_', ' ')} {name}")
        self.emit(depth, f"{vid} {_attrs(attrs)}")
        return vid

    def edge(self, src: tuple[str, str], dst: str, value: str, producer_name: str | None, named: bool = False) -> None:
        src_id, kind = src
        label = ""
        # Values named after their producer (every backward value), or going to a value node that shows their
        # name (``named``: outputs), need no label.
        if self.labels and not named and kind in ("forward", "backward", "seed", "accum") and value != producer_name:
            if producer_name and value.startswith(producer_name + ":"):
                label = value[len(producer_name):]  # output k of a multi-output backward node: ":k"
            else:
                label = shorten(value, self.opts.name_width)
        extra = {"label": label, "fontsize": "8"} if label else {}
        self.edges.append(_Edge(src_id, dst, value, kind, extra))

    # ------------------------------------------------------------------------------------------- graphs

    def graph(self, g: Graph, scopes: list[dict[str, tuple[str, str, str | None]]], depth: int,
              top: bool) -> list[str]:
        """Emit ``g``'s nodes at ``depth``; returns its roots (the nodes no other node of ``g`` feeds), which a
        body hangs from its loop node by."""
        scope: dict[str, tuple[str, str, str | None]] = {}  # value -> (dot id, producer kind, producer node name)
        chain = [scope, *scopes]
        roots: list[str] = []
        readers: dict[str, int] = {}
        for node in g.nodes:
            for i in node.inputs:
                readers[i] = readers.get(i, 0) + 1
            for sub in node.subgraphs.values():
                for n2 in _all_reads(sub):
                    readers[n2] = readers.get(n2, 0) + 1
        for o in g.output_names:
            readers[o] = readers.get(o, 0) + 1

        inits = set(g.initializers)
        for vi in g.inputs:
            if vi.name in inits:
                continue
            kind = "input" if top else "body_input"
            vid = self.value_node(depth, kind, vi.name, vi.describe() if top and vi.dtype is not None else "")
            scope[vi.name] = (vid, kind, None)
            roots.append(vid)
        for name, arr in g.initializers.items():
            if name not in readers:
                continue
            if self.fold:
                scope[name] = ("", "folded", None)
                continue
            shape = "x".join(str(d) for d in getattr(arr, "shape", ())) or "scalar"
            vid = self.value_node(depth, "initializer", name, shape)
            scope[name] = (vid, "initializer", None)
            roots.append(vid)

        for node in g.nodes:
            kind = node_kind(node)
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            subs = node.subgraphs
            if self.cut and node.op_type == "Constant" and not node.inputs and not subs:
                # Large graphs: constants (often shared across the whole backward pass) fold into their readers.
                scope.update({o: ("", "const", node.name) for o in node.outputs if o})
                continue
            nid = self.fresh("n")
            attrs = dict(STYLES[kind])
            title = node.op_type if not node.domain else f"{node.domain}:{node.op_type}"
            shown = _op_label_name(node)
            label = (title, *((shorten(shown, self.opts.name_width),) if shown else ()))  # (lines: _q)
            folded = {i: _lookup(chain, i, ("", ""))[1] for i in dict.fromkeys(node.inputs) if i}
            folded = {i: k for i, k in folded.items() if k in _FOLDED}
            counts = Counter(folded.values())
            if counts:
                label += (", ".join(f"+{c} {_FOLDED[k]}{'s' if c > 1 else ''}" for k, c in sorted(counts.items())),)
            tooltip = (f"{node.name or '(unnamed)'} ({title})", f"in: {', '.join(i or '-' for i in node.inputs)}",
                       f"out: {', '.join(o or '-' for o in node.outputs)}")
            if folded:
                tooltip += (f"not drawn: {', '.join(folded)}",)
            attrs.update(label=label, tooltip=tooltip)
            if node.op_type == "Constant" and not subs:
                attrs.update(fontsize="8", height="0.2", margin="0.04,0.02")
            if subs:
                attrs["style"] += ",bold"
                self.clusters += 1
                cid = f"cluster_{self.clusters}_{_ident(node.name or node.op_type)}"
                fill, border = _CLUSTER_COLOURS[kind]
                self.emit(depth, f"subgraph {_q(cid)} {{")
                self.emit(depth + 1, f"label={_q(shorten(f'{title} {node.name}'.strip(), 2 * self.opts.name_width))}; "
                                     f"style=\"rounded,filled\"; fillcolor={_q(fill)}; color={_q(border)}; "
                                     "fontsize=\"10\"; labeljust=\"l\";")
                self.emit(depth + 1, f"{nid} {_attrs(attrs)}")
                self._inputs(node, nid, chain, depth + 1, kind)
                for attr, sub in subs.items():
                    if len(subs) > 1 or node.op_type == "If":
                        self.clusters += 1
                        sid = f"cluster_{self.clusters}_{_ident(attr)}"
                        self.emit(depth + 1, f"subgraph {_q(sid)} {{")
                        self.emit(depth + 2, f"label={_q(attr)}; style=\"rounded,dashed\"; color={_q(border)}; "
                                             "fontsize=\"9\";")
                        body_roots = self.graph(sub, chain, depth + 2, False)
                        self.emit(depth + 1, "}")
                    else:
                        body_roots = self.graph(sub, chain, depth + 1, False)
                    # The body hangs below its node: one dashed edge named after the attribute, the rest invisible.
                    for k, root in enumerate(body_roots):
                        extra = {"style": "dashed", "color": border, "arrowhead": "none", "label": attr,
                                 "fontsize": "8", "fontcolor": border} if k == 0 else {"style": "invis"}
                        self.edges.append(_Edge(nid, root, attr, "body", extra))
                self.emit(depth, "}")
            else:
                self.emit(depth, f"{nid} {_attrs(attrs)}")
                self._inputs(node, nid, chain, depth, kind)
            if not any(i in scope and scope[i][1] not in _FOLDED for i in node.inputs if i):
                roots.append(nid)
            for o in node.outputs:
                if o:
                    scope[o] = (nid, kind, node.name)

        for vi in g.outputs:
            src = _lookup(chain, vi.name, None)
            if src is None:
                src = chain[-1][vi.name] = (self.missing(vi.name), "missing", None)
            elif src[1] in _FOLDED:
                src = (*self.unfold(vi.name), None)
            if top:
                kind = "grad_output" if src[1] in ("backward", "accum", "seed") else "output"
                vid = self.value_node(depth, kind, vi.name, vi.describe() if vi.dtype is not None else "")
            else:
                vid = self.value_node(depth, "body_output", vi.name)
                if vi.name not in scope:
                    roots.append(vid)
            self.edge((src[0], src[1]), vid, vi.name, src[2], named=True)
        return roots

    def _inputs(self, node: Node, nid: str, chain: list[dict], depth: int, kind: str) -> None:
        seen: set[str] = set()
        for i in node.inputs:
            if not i or i in seen:
                continue
            seen.add(i)
            src = _lookup(chain, i, None)
            if src is None:
                src = (self.missing(i), "missing", None)
                chain[-1][i] = src
            if src[1] in _FOLDED:
                continue
            if self.cut and kind != "forward" and src[1] in ("forward", "input", "initializer"):
                # A backward node reading a forward value: a small reference next to it, not an edge across the page.
                key = (id(chain[0]), i)
                if key not in self.refs:
                    self.refs[key] = rid = self.fresh("r")
                    attrs = {**_REF_STYLE, "label": _UP + shorten(i, self.opts.name_width),
                             "tooltip": f"forward value {i} (drawn here instead of a long edge)"}
                    self.emit(depth, f"{rid} {_attrs(attrs)}")
                self.edges.append(_Edge(self.refs[key], nid, i, src[1]))
                continue
            self.edge((src[0], src[1]), nid, i, src[2])

    def missing(self, name: str) -> str:
        """A red placeholder for a name nothing writes (a malformed graph is drawn, not refused)."""
        vid = self.fresh("v")
        self.lines.insert(self._top_insert, f"  {vid} {_attrs({**_VALUE_STYLES['missing'], 'label': name + ' ?'})}")
        return vid

    def unfold(self, name: str) -> tuple[str, str]:
        """An initializer box for a folded initializer that is a graph output (rare)."""
        vid = self.fresh("v")
        self.lines.insert(self._top_insert, f"  {vid} {_attrs({**_VALUE_STYLES['initializer'], 'label': name})}")
        return vid, "initializer"


def _lookup(chain: list[dict], name: str, default):
    for scope in chain:
        if name in scope:
            return scope[name]
    return default


def _all_reads(g: Graph) -> set[str]:
    names: set[str] = set()
    for _, node in g.walk():
        names.update(i for i in node.inputs if i)
    stack = [g]
    while stack:
        s = stack.pop()
        names.update(s.output_names)
        for node in s.nodes:
            stack.extend(node.subgraphs.values())
    return names


def _ident(text: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in text)[:40]
    return out or "node"


def _count_edges(g: Graph) -> int:
    n = 0
    stack = [g]
    while stack:
        s = stack.pop()
        n += len(s.output_names)
        for node in s.nodes:
            n += sum(1 for i in node.inputs if i)
            stack.extend(node.subgraphs.values())
    return n


def to_dot(graph: Graph, options: DotOptions | None = None, **kwargs) -> str:
    """The DOT text of a picture of ``graph`` (forward, or forward plus backward as built by
    :func:`revgraph.gradient`); see the module docstring for what is drawn.

    ``options`` (a :class:`DotOptions`) or keyword arguments of the same names tune labels, initializers and
    the title. Nodes are named ``n<k>``, values ``v<k>`` and clusters ``cluster_<k>_<node name>``.
    """
    opts = options or DotOptions(**kwargs)
    if options is not None and kwargs:
        raise TypeError("pass either options or keyword arguments, not both")
    n_inits = 0
    stack = [graph]
    while stack:
        s = stack.pop()
        n_inits += len(s.initializers)
        for node in s.nodes:
            stack.extend(node.subgraphs.values())
    w = _Writer(opts, n_inits, _count_edges(graph), sum(1 for _ in graph.walk()))
    title = opts.title if opts.title is not None else graph.name
    w.emit(0, "digraph revgraph {")
    w.emit(1, f"graph [rankdir={_q(opts.rankdir)}, fontname=\"Helvetica\", "
              f"fontsize=\"12\", labelloc=\"t\", label={_q(title)}, nodesep=\"0.25\", ranksep=\"0.35\"];")
    w.emit(1, 'node [fontname="Helvetica", fontsize="10", height="0.3", margin="0.08,0.03"];')
    w.emit(1, 'edge [fontname="Helvetica", fontsize="8", arrowsize="0.6"];')
    w._top_insert = len(w.lines)
    w.graph(graph, [], 1, True)
    if opts.legend and any(w.kinds.get(k) for k in ("backward", "accum", "seed")):
        w.emit(1, f"legend [shape=\"plaintext\", label={_LEGEND_HTML}];")
    for e in w.edges:
        attrs = {"color": _EDGE_COLOURS.get(e.kind, "#666666")}
        if e.kind == "initializer":
            attrs["style"] = "dotted"
        attrs.update(e.extra)
        attrs.setdefault("tooltip", e.value)
        w.emit(1, f"{e.src} -> {e.dst} {_attrs(attrs)}")
    w.emit(0, "}")
    return "\n".join(w.lines) + "\n"


_LEGEND_HTML = (
    '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="2" CELLPADDING="3">'
    '<TR><TD COLSPAN="2"><B>legend</B></TD></TR>'
    '<TR><TD BGCOLOR="#cfe2f3">forward</TD><TD BGCOLOR="#fce5cd">backward (grad/...)</TD></TR>'
    '<TR><TD BGCOLOR="#f4cccc"><B>accumulation (accum/...)</B></TD><TD BGCOLOR="#fff2cc">seed (seed/...)</TD></TR>'
    '<TR><TD BGCOLOR="#d9ead3">input / output</TD><TD BGCOLOR="#eeeeee">initializer</TD></TR>'
    "</TABLE>>"
)


# ---------------------------------------------------------------------------------------------- output


def output_format(path: str | os.PathLike) -> str:
    """``"svg"``, ``"png"`` or ``"dot"`` from the suffix of ``path``; :class:`RevgraphError` otherwise."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise RevgraphError(f"cannot tell the picture format of {str(path)!r}; name it FILE.svg, FILE.png or FILE.dot")
    return FORMATS[suffix]


def find_dot() -> str:
    """The path of Graphviz's ``dot`` program; :class:`RevgraphError` saying how to install it if missing."""
    found = shutil.which("dot")
    if found is None:
        raise RevgraphError(
            "rendering SVG or PNG needs Graphviz's 'dot' program, which is not on PATH; install Graphviz "
            "(apt-get install graphviz, brew install graphviz, or conda install graphviz), "
            "or write DOT text with -o FILE.dot, which needs nothing"
        )
    return found


def check_output(path: str | os.PathLike) -> str:
    """Check, before any work, that a picture can be written to ``path``; return its format.

    Raises :class:`RevgraphError` for an unknown suffix, a missing directory, or (for SVG and PNG) a missing
    ``dot`` program.
    """
    fmt = output_format(path)
    parent = Path(path).parent
    if not parent.is_dir():
        raise RevgraphError(f"cannot write {str(path)!r}: directory {str(parent)!r} does not exist")
    if fmt != "dot":
        find_dot()
    return fmt


def write(dot_text: str, path: str | os.PathLike, fmt: str | None = None) -> None:
    """Write ``dot_text`` to ``path`` as DOT text, or rendered to SVG or PNG by ``dot``, atomically.

    ``fmt`` defaults to the suffix of ``path`` (:func:`output_format`). The result goes to a temporary file in
    the same directory and is moved into place with ``os.replace``; on any failure nothing is left behind and
    an existing file at ``path`` is untouched. Raises :class:`RevgraphError` (one line) when ``dot`` is
    missing or fails, or the directory does not exist.
    """
    fmt = fmt or output_format(path)
    if fmt not in ("svg", "png", "dot"):
        raise RevgraphError(f"unknown picture format {fmt!r}; choose svg, png or dot")
    dot = find_dot() if fmt != "dot" else None
    with atomic_path(path) as tmp:
        if dot is None:
            Path(tmp).write_text(dot_text, encoding="utf-8")
        else:
            _render(dot, fmt, dot_text, tmp, path)


def _render(dot: str, fmt: str, dot_text: str, tmp: str, path: str | os.PathLike) -> None:
    try:
        proc = subprocess.run([dot, f"-T{fmt}", "-o", tmp], input=dot_text.encode("utf-8"), capture_output=True,
                              check=False)
    except OSError as exc:
        raise RevgraphError(f"cannot run {dot!r}: {exc.strerror or exc}") from None
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
        detail = lines[0] if lines else f"exit status {proc.returncode}"
        raise RevgraphError(f"dot could not render {str(path)!r}: {detail}")


def summary(graph: Graph) -> dict[str, int]:
    """Node counts by :func:`node_kind` over the graph and its subgraphs, and the number of loop clusters."""
    counts = {"forward": 0, "backward": 0, "seed": 0, "accum": 0, "clusters": 0}
    for _, node in graph.walk():
        counts[node_kind(node)] += 1
        if node.subgraphs:
            counts["clusters"] += 1
    return counts


def show(graph: Graph, path: str | os.PathLike, options: DotOptions | None = None, **kwargs) -> str:
    """Draw ``graph`` to ``path`` (``.svg``, ``.png`` or ``.dot``): :func:`to_dot` then :func:`write`.

    Checks the format and, for SVG/PNG, that ``dot`` is installed before building the text. Returns the DOT text.
    """
    fmt = check_output(path)
    text = to_dot(graph, options, **kwargs)
    write(text, path, fmt)
    return text


__all__ = ["FORMATS", "STYLES", "DotOptions", "check_output", "find_dot", "node_kind", "output_format", "shorten",
           "show", "summary", "to_dot", "write"]
