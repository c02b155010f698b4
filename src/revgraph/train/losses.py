"""Losses appended to a model output: :func:`loss_graph` and the registry :data:`LOSSES`.

Losses (``labels`` is the graph input holding the targets; the mean is over the counted elements, as the
PyTorch losses with ``reduction="mean"``):

- ``"cross-entropy"``: logits ``[..., C]`` float, labels int64 ``[...]`` (class indices in ``[0, C)``);
  ``-mean(log_softmax(logits)[..., label])`` (``torch.nn.functional.cross_entropy`` for ``[N, C]`` logits).
  Options (as ``cross_entropy``'s): ``ignore_index`` (targets equal to it are not counted; default none),
  ``label_smoothing`` ``S`` (``(1 - S) * nll + S * mean over classes of -log p``), ``class_weights`` ``w``
  (float ``[C]``: each target's terms scaled by ``w[target]``, the sum divided by the sum of the counted
  targets' weights; the smoothing term is ``-sum_c w_c log p_c / C``, as torch's).
- ``"causal-lm"``: logits ``[B, T, V]`` against token ids ``[B, T]`` shifted by one: position ``t`` predicts
  token ``t + 1`` and the last position is dropped, i.e. ``cross_entropy(logits[:, :-1].reshape(-1, V),
  ids[:, 1:].reshape(-1), ignore_index=-100)``. The ids are a model input (``labels_from``: default the only
  int64 input of rank 2, else ``input_ids``; no labels input then), or, with ``labels_from="labels"`` and no
  model input of that name, an explicit ``labels`` input ``[B, T]`` (Hugging Face's convention: the labels
  are given unshifted and shifted here). ``ignore_index`` defaults to -100; smoothing and class weights as
  for cross-entropy.
- ``"mse"``: output and labels of the same shape and float dtype; ``mean((output - labels)^2)``.
- ``"bce"``: logits and labels (probabilities in [0, 1]) of the same shape and float dtype;
  ``mean(softplus(z) - z * y)`` = ``torch.nn.functional.binary_cross_entropy_with_logits``. ``softplus(z)``
  is written ``m + log(exp(-m) + exp(z - m))`` with ``m = max(z, 0)``: no overflow for large ``|z|``, and the
  exact gradient ``sigmoid(z)`` also at ``z = 0`` (the derivative with respect to ``m`` vanishes, so the
  tie convention of ``Max`` does not matter).
- ``"output:NAME"``: the model computes its own loss: its float scalar output ``NAME`` is the loss, and the
  data holds only the model's inputs (no labels).

No counted target (every target ignored, or a zero weight sum): torch's mean is ``0 / 0 = NaN``; here the
loss is 0 and its gradient zero (the sum is divided by ``max``-like ``where(count > 0, count, 1)``), so a
batch of padding alone leaves the parameters to the optimizer's zero-gradient step instead of NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from .. import validate as V
from ..autodiff.memory.budget import BUDGET
from ..errors import RevgraphError
from ..ir import Graph, Node, ValueInfo
from ..ir.arguments import GRAPH
from ..ir.ssa import is_ssa, to_ssa
from ..onnx_io.value_types import infer_types
from .graphbuild import Builder


@dataclass(frozen=True)
class Build:
    """What a loss's ``build`` is given: the graph (a copy in SSA form, whose inputs it may extend with labels),
    the node builder ``b``, the model output ``out`` and its type ``vi`` (a float tensor), the checked options
    and the settings being recorded (``build`` may add to them)."""

    g: Graph
    b: Builder
    out: str
    vi: ValueInfo
    opts: dict
    settings: dict
    #: the memory budget ``chunk_tokens="auto"`` chooses under (:mod:`revgraph.train.chunked_loss`)
    memory: object = None
    #: the chunk loops a class loss emitted (``LossSpec.recompute``)
    recompute: list = field(default_factory=list)


@dataclass(frozen=True)
class LossKind:
    """A registry entry, with its behaviour. ``labels`` is ``"required"``, ``"none"`` or ``"optional"`` (whether
    the data holds a ``labels`` array), ``options`` the loss options it takes (:func:`loss_graph`'s keywords).
    ``build(Build) -> (loss value, labels input or None, targets input or None)`` emits the loss nodes.
    ``classes``: the targets are class indices (their range is checked against the data, ``ignore_index`` and
    class weights make the loss a mean over counted targets: :func:`loss_weight`); ``shifted``: the targets
    are the token ids one position on (causal-lm). ``accuracy(out, targets, labels, ignore) -> (correct,
    answers)`` scores an evaluation batch (``None``: the loss has no accuracy). A new loss is one entry here."""

    labels: str
    options: tuple[str, ...]
    help: str
    build: Callable[[Build], tuple[str, str | None, str | None]]
    classes: bool = False
    shifted: bool = False
    accuracy: Callable | None = None


def _labels_like(x: Build) -> str:
    labels = x.b.fresh("labels")
    x.g.inputs.append(ValueInfo(labels, x.vi.dtype, x.vi.shape))
    return labels


def _mse(x: Build) -> tuple[str, str | None, str | None]:
    """``mean((output - labels)^2)``."""
    b, labels = x.b, _labels_like(x)
    d = b.op("Sub", [x.out, labels])
    return b.op("ReduceMean", [b.op("Mul", [d, d])], keepdims=0), labels, None


def _bce(x: Build) -> tuple[str, str | None, str | None]:
    """Binary cross-entropy with logits: ``softplus(z) - z y``, softplus written without overflow (module doc)."""
    b, labels, z = x.b, _labels_like(x), x.out
    m = b.op("Max", [z, b.const(0.0, x.vi.dtype)])
    lse = b.op("Log", [b.op("Add", [b.op("Exp", [b.op("Neg", [m])]), b.op("Exp", [b.op("Sub", [z, m])])])])
    per_sample = b.op("Sub", [b.op("Add", [m, lse]), b.op("Mul", [z, labels])])
    return b.op("ReduceMean", [per_sample], keepdims=0), labels, None


def _class_logits(x: Build, kind: str, need: int, exact: bool, what: str) -> None:
    vi, w = x.vi, x.opts["class_weights"]
    if vi.shape is None or len(vi.shape) < need or (exact and len(vi.shape) != need):
        raise RevgraphError(f"{kind} needs logits of shape {what}; {x.out!r} is {vi.describe()}")
    classes = vi.shape[-1]
    if w is not None and isinstance(classes, int) and len(w) != classes:
        raise RevgraphError(f"--class-weights holds {len(w)} weights; the logits {x.out!r} have {classes} classes")


def _cross_entropy_loss(x: Build) -> tuple[str, str | None, str | None]:
    """Logits ``[..., C]`` against int64 class labels ``[...]`` (:func:`_cross_entropy`)."""
    _class_logits(x, "cross-entropy", 2, False, "[..., classes]")
    labels = x.b.fresh("labels")
    x.g.inputs.append(ValueInfo(labels, np.int64, x.vi.shape[:-1]))
    return _class_loss(x, labels), labels, labels


def _causal_lm(x: Build) -> tuple[str, str | None, str | None]:
    """Logits ``[B, T, V]`` against the ids shifted by one: position ``t`` predicts token ``t + 1``."""
    _class_logits(x, "causal-lm", 3, True, "[batch, positions, vocabulary]")
    b, labels = x.b, None
    ids = _ids_input(x.g, x.opts["labels_from"], x.vi)
    x.settings["labels_from"] = ids
    if ids not in x.g.input_names:
        x.g.inputs.append(ValueInfo(ids, np.int64, x.vi.shape[:2]))
        labels = ids
    i64 = lambda v: b.const([v], np.int64)
    # Every position's logits against the next token, the last position's target the ignored index (always set
    # for causal-lm: default -100): the same counted terms as slicing logits[:, :-1], without that [B, T-1, V]
    # copy in the forward and the Pad back to [B, T, V] in the backward (issue 42: the vocabulary-sized tensors)
    shifted = b.op("Slice", [ids, i64(1), i64(2**62), i64(1)])
    last = b.op("Slice", [ids, i64(-1), i64(2**62), i64(1)])
    none = b.op("Add", [b.op("Mul", [last, b.const(0, np.int64)]), b.const(x.opts["ignore_index"], np.int64)])
    targets = b.op("Concat", [shifted, none], axis=1)
    return _class_loss(x, targets), labels, ids


def _class_loss(x: Build, targets: str) -> str:
    """:func:`_cross_entropy` of the logits at ``targets``, or its chunked form where ``chunk_tokens`` asks for it
    and the logits come from a projection (:mod:`revgraph.train.chunked_loss`; recorded as the setting
    ``chunk_tokens``: the chunk size used)."""
    from . import chunked_loss

    chunks = chunked_loss.plan(x.g, x.out, x.vi, x.opts.get("chunk_tokens", "off"), x.memory)
    if chunks is None:
        return _cross_entropy(x.b, x.out, targets, len(x.vi.shape) - 1, x.vi.dtype, x.opts)
    value, loop = chunked_loss.chunked_cross_entropy(x.b, chunks[0], targets, x.vi.dtype, x.opts, chunks[1])
    x.settings["chunk_tokens"] = chunks[1]
    x.recompute.append(loop)
    return value


def _own_output(x: Build) -> tuple[str, str | None, str | None]:
    """The model's float scalar output is the loss."""
    vi = x.vi
    if vi.shape is None or any(d != 1 for d in vi.shape):
        raise RevgraphError(f"--loss-fn output:{x.out} needs a float scalar output; {x.out!r} is {vi.describe()}")
    return (x.b.op("Reshape", [x.out, x.b.const([], np.int64)]) if vi.shape else x.out), None, None


def _class_accuracy(out: np.ndarray, targets: np.ndarray, labels, ignore, shifted: bool) -> tuple[float, float]:
    """Argmax against the target class (the next token when ``shifted``), over the counted targets."""
    t, guess = targets, np.argmax(out, axis=-1)
    if shifted:
        t, guess = t[:, 1:], guess[:, :-1]
    keep = t != ignore if ignore is not None else np.ones(t.shape, bool)
    return np.sum((guess == t) & keep), keep.sum()


def _bce_accuracy(out: np.ndarray, targets, labels: np.ndarray, ignore) -> tuple[float, float]:
    """The sign of the logit against ``label > 0.5``."""
    return np.sum((out > 0) == (labels > 0.5)), labels.size


_CE_OPTIONS = ("ignore_index", "label_smoothing", "class_weights", "chunk_tokens")

#: The losses :func:`loss_graph` builds, by name; ``"output:NAME"`` is a pattern (any output name). The CLI's
#: ``--loss-fn`` validates and documents from this (:func:`parse_loss`); the data checks, the evaluation's accuracy
#: and the loss weights of micro-batches and ranks read each entry's behaviour.
LOSSES: dict[str, LossKind] = {
    "cross-entropy": LossKind("required", _CE_OPTIONS, "logits [..., C] against int64 class labels [...]",
                              _cross_entropy_loss, classes=True,
                              accuracy=lambda o, t, lab, ii: _class_accuracy(o, t, lab, ii, False)),
    "mse": LossKind("required", (), "mean squared error against float labels of the output's shape", _mse),
    "bce": LossKind("required", (), "binary cross-entropy with logits against probabilities of the output's shape",
                    _bce, accuracy=_bce_accuracy),
    "causal-lm": LossKind("optional", ("labels_from", *_CE_OPTIONS),
                          "logits [B, T, V] against the input ids shifted by one (position t predicts t+1)",
                          _causal_lm, classes=True, shifted=True,
                          accuracy=lambda o, t, lab, ii: _class_accuracy(o, t, lab, ii, True)),
    "output:NAME": LossKind("none", (), "the model's own float scalar output NAME is the loss (no labels)",
                            _own_output),
}


def loss_kind(kind: str) -> LossKind:
    """The registry entry of a :class:`LossSpec`'s ``kind`` (``"output"`` is the ``output:NAME`` pattern)."""
    return LOSSES["output:NAME" if kind == "output" else kind]


#: ``ignore_index`` when none is given: torch's -100 for causal-lm; none (every target counted) for cross-entropy
DEFAULT_IGNORE = {"causal-lm": -100, "cross-entropy": None}


def parse_loss(loss: str) -> tuple[str, str | None]:
    """``(kind, NAME)``: ``("output", NAME)`` for ``"output:NAME"``, ``(loss, None)`` for a registered name.
    Raises :class:`RevgraphError` naming the choices for anything else."""
    if isinstance(loss, str) and loss.startswith("output:"):
        name = loss[len("output:"):]
        if not name:
            raise RevgraphError("--loss-fn output:NAME needs the name of the model output that is the loss")
        return "output", name
    if loss not in LOSSES or loss == "output:NAME":
        raise RevgraphError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
    return loss, None


@dataclass
class LossSpec:
    """What :func:`loss_graph` added: the loss (a float scalar), the labels input (``None`` when the data
    holds no labels: ``output:NAME``, ``causal-lm`` on its input ids), the model output used, the kind
    (``"output"`` for ``output:NAME``) and ``settings`` (JSON-able: ``kind``, ``output`` and every loss option,
    class weights as a list; what checkpoints record and :func:`loss_graph` rebuilds from)."""

    loss: str
    labels: str | None
    output: str
    kind: str
    settings: dict = field(default_factory=dict)
    #: causal-lm: the graph input holding the token ids (a model input or ``labels``)
    targets: str | None = None
    #: the names of the ``Loop`` nodes of a chunked loss (``chunk_tokens``), which :func:`revgraph.training_graph`
    #: differentiates with the ``recompute`` policy (:mod:`revgraph.train.chunked_loss`)
    recompute: list[str] = field(default_factory=list)

    def rebuild(self) -> tuple[str, dict]:
        """``(loss, options)`` that give this loss again with :func:`loss_graph` (``eval_graph`` uses it), unchunked:
        evaluation reads the whole logits for the accuracy anyway (``chunk_tokens`` is left out)."""
        s = dict(self.settings)
        s.pop("chunk_tokens", None)
        kind = s.pop("kind", self.kind)
        output = s.pop("output", self.output)
        if kind == "output":
            return f"output:{output}", {}
        if s.get("class_weights") is not None:
            s["class_weights"] = np.asarray(s["class_weights"])
        return kind, {"output": output, **s}


@V.arguments(model=GRAPH, output=V.NAME)
def resolve_output(model: Graph, output: str | None) -> str:
    """The model output the loss reads: ``output`` or the only output; one-line errors otherwise."""
    names = model.output_names
    if output is None:
        if len(names) == 1:
            return names[0]
        raise RevgraphError(f"the model has {len(names)} outputs ({', '.join(names)}); choose one for the loss "
                            "(--model-output NAME, or output=NAME)")
    if output not in names:
        raise RevgraphError(f"the model has no output {output!r}; its outputs are {', '.join(names)}")
    return output


def check_options(kind: str, options: Mapping) -> dict:
    """The loss options of ``kind`` with defaults filled in and values checked (one-line errors naming the
    option): ``label_smoothing`` in [0, 1], ``class_weights`` finite non-negative floats ``[C]``,
    ``ignore_index`` an integer, ``labels_from`` a name, ``chunk_tokens`` a whole number >= 1, ``"auto"`` (default)
    or ``"off"``."""
    allowed = LOSSES["output:NAME" if kind == "output" else kind].options
    given = {k: v for k, v in options.items() if v is not None and not (k == "label_smoothing" and v == 0)}
    extra = [k for k in given if k not in allowed]
    known = {o for v in LOSSES.values() for o in v.options}
    if extra and extra[0] not in known:  # a typo: no loss takes it, so "it goes with" would name nothing
        raise RevgraphError(f"unknown loss option {extra[0]!r} (loss_options=); the options are "
                            f"{', '.join(sorted(known))}")
    if extra:
        flag = {"chunk_tokens": "--loss-chunk"}.get(extra[0], "--" + extra[0].replace("_", "-"))
        raise RevgraphError(f"{flag} ({extra[0]}=) does not apply to --loss {kind}; it goes with "
                            f"{' or '.join(k for k, v in LOSSES.items() if extra[0] in v.options)}")
    out: dict = {}
    if "ignore_index" in allowed:
        ii = options.get("ignore_index", DEFAULT_IGNORE[kind])
        ii = DEFAULT_IGNORE[kind] if ii is None else ii
        # isinstance first: float("x") would raise a bare ValueError (a traceback) for a string
        if ii is not None and (isinstance(ii, bool) or not isinstance(ii, (int, float, np.integer, np.floating))
                               or not float(ii).is_integer()):
            raise RevgraphError(f"--ignore-index must be an integer, got {ii!r}")
        if ii is not None and not -2**63 <= int(ii) < 2**63:  # the labels are int64 (an OverflowError later)
            raise RevgraphError(f"--ignore-index must fit in int64, got {ii!r}")
        out["ignore_index"] = None if ii is None else int(ii)
        s = options.get("label_smoothing") or 0.0
        if isinstance(s, bool) or not isinstance(s, (int, float, np.integer, np.floating)):
            raise RevgraphError(f"--label-smoothing must be a number in [0, 1], got {s!r}")
        s = float(s)
        if not 0.0 <= s <= 1.0:
            raise RevgraphError(f"--label-smoothing must be in [0, 1], got {s}")
        out["label_smoothing"] = s
        w = options.get("class_weights")
        if w is not None:
            w = np.asarray(w)
            if w.ndim != 1 or w.dtype.kind not in "fiu" or not np.isfinite(w).all() or (w < 0).any():
                bad = "" if w.ndim != 1 or w.dtype.kind not in "fiu" else next(
                    f" (weight {i} is {v})" for i, v in enumerate(w.tolist()) if not (math.isfinite(v) and v >= 0))
                raise RevgraphError(f"--class-weights must be finite non-negative numbers of shape [classes], got "
                                    f"{w.dtype} {list(w.shape)}{bad}")
            if not w.any():  # every target would weigh 0: the loss is 0 and nothing trains (torch gives NaN)
                raise RevgraphError("--class-weights are all 0: no target would count and nothing would train; "
                                    "give at least one positive weight")
            w = [float(v) for v in w]
        out["class_weights"] = w
        from .chunked_loss import check_chunk

        out["chunk_tokens"] = check_chunk(options.get("chunk_tokens"))
    if "labels_from" in allowed:
        out["labels_from"] = options.get("labels_from")
    return out


@V.arguments(model=GRAPH, loss=V.TEXT, output=V.NAME, memory=BUDGET)
def loss_graph(model: Graph, loss: str = "cross-entropy", *, output: str | None = None, memory=None,
               **options) -> tuple[Graph, LossSpec]:
    """A copy of ``model`` (in SSA form) with an input for the labels (when the loss has them) and a scalar loss.

    The result's outputs are ``[loss, output]``; parameters stay initializers (so ``revgraph.check_gradients``
    can check the loss with ``wrt`` = the parameters). ``loss``: a name of :data:`LOSSES` or ``"output:NAME"``;
    ``options``: ``ignore_index``, ``label_smoothing``, ``class_weights`` (cross-entropy, causal-lm),
    ``labels_from`` (causal-lm), see the module doc; ``chunk_tokens`` (cross-entropy, causal-lm: a whole number,
    ``"auto"`` or ``"off"``) computes the output projection and the loss together in chunks of tokens, under the
    budget ``memory`` for ``"auto"`` (:mod:`revgraph.train.chunked_loss`). Labels: int64 with the logits' shape
    minus the last axis for ``"cross-entropy"``, the output's dtype and shape for ``"mse"`` and ``"bce"``, the
    ids' shape for ``causal-lm`` with ``labels_from="labels"``. Raises :class:`RevgraphError` for an unknown loss,
    option or output, an output that is not a float tensor of known rank, an ``output:NAME`` that is not a float scalar,
    class weights of another length than the classes, a missing ids input.
    """
    kind, named = parse_loss(loss)
    if kind == "output" and output is not None and output != named:
        # output:NAME names the loss itself; a second output would be ignored without a word
        raise RevgraphError(f"--model-output {output} (output=) does not go with --loss-fn output:{named}, whose loss "
                            f"is the output {named!r}: leave --model-output out")
    opts = check_options(kind, options)
    g = (model if is_ssa(model) else to_ssa(model)).copy()
    out = resolve_output(g, named if kind == "output" else output)
    types = infer_types(g)
    vi = types.get(out) or ValueInfo(out)
    b = Builder(g.names_in_use())
    b.prefix = f"loss/{kind}"
    settings = {"kind": kind, "output": out, **{k: v for k, v in opts.items() if k != "chunk_tokens"}}
    if not vi.is_float:
        what = f"--loss-fn output:{out} needs a float scalar output" if kind == "output" else \
            "the loss needs a floating-point model output"
        raise RevgraphError(f"{what}; {out!r} is {vi.describe()}")
    x = Build(g, b, out, vi, opts, settings, memory)
    value, labels, targets = loss_kind(kind).build(x)
    return _finish(g, b, value, vi, labels, LossSpec("", labels, out, kind, settings, targets=targets,
                                                     recompute=x.recompute))


def _finish(g: Graph, b: Builder, value: str, vi: ValueInfo, labels, spec: LossSpec) -> tuple[Graph, LossSpec]:
    name = b.fresh("loss")
    b.nodes.append(Node("Identity", [value], [name], name=b.fresh(f"loss/{spec.kind}/output")))
    g.nodes.extend(b.nodes)
    g.outputs = [ValueInfo(name, vi.dtype, ()), ValueInfo(vi.name, vi.dtype, vi.shape)]
    spec.loss = name
    return g, spec


def _ids_input(g: Graph, labels_from: str | None, logits: ValueInfo) -> str:
    """The causal-lm targets: ``labels_from`` (a model input, or ``"labels"`` for a new labels input), else the
    only int64 input of rank 2, else ``input_ids``."""
    if labels_from is not None:
        if labels_from == "labels":
            return labels_from
        if labels_from in g.input_names:
            # the targets meet int64 constants in the loss: another dtype or rank made onnxruntime refuse the graph
            vi = next(v for v in g.inputs if v.name == labels_from)
            if vi.dtype != np.dtype(np.int64) or (vi.shape is not None and len(vi.shape) != 2):
                raise RevgraphError(f"--labels-from {labels_from}: input {labels_from!r} is {vi.describe()}; "
                                    "causal-lm's targets are int64 token ids [batch, positions] (export the ids as "
                                    "int64, or give --labels-from labels and a labels array)")
            return labels_from
        raise RevgraphError(f"--labels-from {labels_from!r}: the model has no such input (its inputs are "
                            f"{', '.join(g.input_names)}); name its token ids input, or 'labels' for a labels array")
    ints = [v.name for v in g.inputs if v.dtype == np.dtype(np.int64) and v.shape is not None and len(v.shape) == 2]
    if len(ints) == 1:
        return ints[0]
    if "input_ids" in g.input_names:
        return _ids_input(g, "input_ids", logits)  # checked as if named: an int32 input_ids is refused in one line
    raise RevgraphError(f"causal-lm: the model has {len(ints)} int64 inputs of rank 2 ({', '.join(ints) or 'none'}) "
                        "and none named input_ids; name the token ids with --labels-from NAME (labels_from=)")


def _cross_entropy(b: Builder, logits: str, targets: str, axis: int, dt, opts: dict) -> str:
    """The mean cross-entropy of ``logits`` (class axis ``axis``, the last) at ``targets`` with the options of
    the module doc; the plain form (no option) is ``-mean(log_softmax[target])``. With options, as torch's
    ``cross_entropy``: ``sum(m * ((1 - S) w_y nll + S/C * -sum_c w_c log p_c)) / sum(m * w_y)`` (``m``: not
    ignored), the denominator replaced by 1 where it is 0 (module doc)."""
    ii, smooth, w = opts["ignore_index"], opts["label_smoothing"], opts["class_weights"]
    logp = b.op("LogSoftmax", [logits], axis=axis)
    last = b.const([axis], np.int64)
    if ii is None and not smooth and w is None:
        picked = b.op("GatherElements", [logp, b.op("Unsqueeze", [targets, last])], axis=axis)
        return b.op("Neg", [b.op("ReduceMean", [picked], keepdims=0)])
    counted = None
    if ii is not None:  # ignored targets pick class 0 (any valid index) and are masked out of both sums
        mask = b.op("Not", [b.op("Equal", [targets, b.const(ii, np.int64)])])
        targets = b.op("Where", [mask, targets, b.const(0, np.int64)])
        counted = b.op("Cast", [mask], to=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt)))
    nll = b.op("Neg", [b.op("Squeeze", [b.op("GatherElements", [logp, b.op("Unsqueeze", [targets, last])],
                                             axis=axis), last])])
    table = None
    if w is not None:
        table = b.const(np.asarray(w), dt)
        wy = b.op("Gather", [table, targets], axis=0)  # each target's weight
        nll = b.op("Mul", [nll, wy])
    per = nll
    if smooth:  # -sum_c w_c log p_c / C (w = 1 without class weights): torch weights it per class
        lp = logp if table is None else b.op("Mul", [logp, table])
        uniform = b.op("Neg", [b.op("ReduceMean", [lp, last], keepdims=0)])
        per = b.op("Add", [b.op("Mul", [per, b.const(1.0 - smooth, dt)]), b.op("Mul", [uniform, b.const(smooth, dt)])])
    if counted is None and table is None:  # (smoothing alone: every element counted)
        return b.op("ReduceMean", [per], keepdims=0)
    num = b.op("ReduceSum", [per if counted is None else b.op("Mul", [per, counted])], keepdims=0)
    weights = wy if counted is None else (counted if table is None else b.op("Mul", [wy, counted]))
    den = b.op("ReduceSum", [weights], keepdims=0)
    if table is None:  # a count of targets: 0 or at least 1, so max(count, 1) is the count or the 1 of no target;
        # a divisor the sign analysis proves >= 1 (autodiff/ranges.py) leaves the backward without the
        # zero-partial tests a possibly-zero divisor puts on every product after it, [B, T, V] ones included
        safe = b.op("Max", [den, b.const(1.0, dt)])
    else:  # class weights may sum below 1
        safe = b.op("Where", [b.op("Greater", [den, b.const(0.0, dt)]), den, b.const(1.0, dt)])
    return b.op("Div", [num, safe])


def weighs_by_targets(spec: LossSpec) -> bool:
    """Is the loss a mean over counted targets (``ignore_index`` or class weights) rather than over samples?
    Then a share of the batch may count nothing, and :func:`loss_weight` gives it weight 0."""
    s = spec.settings
    return loss_kind(spec.kind).classes and (s.get("ignore_index") is not None
                                                           or s.get("class_weights") is not None)


def loss_weight(spec: LossSpec, feeds: Mapping[str, np.ndarray], count: int) -> float:
    """What the loss of a batch (``feeds`` by graph input, ``count`` samples) is the mean over: ``count`` for a
    mean over samples, else the counted targets (not ``ignore_index``; the sum of their class weights). Weighting
    each micro-batch's (or rank's) loss by this over the global batch's sum makes the step the mean over the
    global batch's counted targets, as one process computes it."""
    s = spec.settings
    ii, w = s.get("ignore_index"), s.get("class_weights")
    if not loss_kind(spec.kind).classes or (ii is None and w is None):
        return count
    t = np.asarray(feeds[spec.targets])
    if loss_kind(spec.kind).shifted:
        t = t[:, 1:]
    keep = t != ii if ii is not None else np.ones(t.shape, bool)
    if w is None:
        return int(keep.sum())
    return float(np.asarray(w, np.float64)[np.where(keep, t, 0)][keep].sum())
