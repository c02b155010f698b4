"""The names a backward pass is asked about, checked at the API boundary: the loss, the wrt values, the seeds.

Each check raises :class:`RevgraphError` with one line naming the value and what to do (close names are
suggested).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from ..errors import RevgraphError
from ..ir import Graph, NameSet, ValueInfo, is_float_dtype
from ..onnx_io.value_types import differentiable


def used_names(graph: Graph) -> set[str]:
    """Every value and node name of ``graph`` and its subgraphs (fresh names must avoid them all)."""
    return NameSet(graph.names_in_use())


def known_names(graph: Graph) -> set[str]:
    names = set(graph.input_names) | set(graph.initializers)
    for node in graph.nodes:
        names.update(o for o in node.outputs if o)
    return names


def default_wrt(graph: Graph, types: dict[str, ValueInfo]) -> list[str]:
    """Every floating-point graph input and initializer, in declaration order."""
    names = [*graph.input_names, *graph.initializers]
    return [n for n in dict.fromkeys(names) if (vi := types.get(n)) is not None and vi.is_float]


def suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


def names_argument(names: object, what: str) -> list[str]:
    """``names`` (a str or an iterable of str) as a list without repeats; :class:`RevgraphError` otherwise."""
    if isinstance(names, str):
        return [names]
    if isinstance(names, (bytes, Mapping)) or not isinstance(names, Iterable):
        raise RevgraphError(f"{what} must be a value name or a list of names, got {type(names).__name__}")
    names = list(names)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise RevgraphError(f"{what} holds {bad[0]!r} ({type(bad[0]).__name__}); value names are str")
    return list(dict.fromkeys(names))


def seeds_argument(ys: object) -> dict[str, str | None]:
    """``ys`` of :func:`backward` as ``{name: seed name or None}``; :class:`RevgraphError` for other types."""
    if isinstance(ys, Mapping):
        names = names_argument(list(ys), "ys")
        bad = [(k, v) for k, v in ys.items() if v is not None and not isinstance(v, str)]
        if bad:
            raise RevgraphError(f"the seed of {bad[0][0]!r} is {type(bad[0][1]).__name__}; give None (ones) or the "
                                "name of a value holding the cotangent")
        return {n: ys[n] for n in names}
    return dict.fromkeys(names_argument(ys, "ys"))


def refuse_integer_loss(loss: str, types: dict[str, ValueInfo]) -> None:
    """Raise :class:`RevgraphError` if ``loss`` is known to be an integer or boolean value: it has no gradient
    (a ``Cast`` to an integer is piecewise constant), and differentiating it would give zeros, or gradients
    of the float value before the cast, silently."""
    vi = types.get(loss)
    if vi is not None and vi.dtype is not None and vi.kind == "tensor" and not is_float_dtype(vi.dtype):
        raise RevgraphError(f"the loss {loss!r} is {vi.describe()}, not floating point: an integer or boolean value "
                            "has no gradient; differentiate the floating-point value it is computed from")


def resolve_loss(graph: Graph, loss: str | None) -> str:
    """The loss name: ``loss`` if it names a value, else the only graph output; one-line errors otherwise."""
    outputs = graph.output_names
    if loss is None:
        if len(outputs) == 1:
            return outputs[0]
        raise RevgraphError(
            f"the model has {len(outputs)} outputs ({', '.join(outputs)}); choose the loss with --loss NAME"
        )
    known = known_names(graph)
    if loss not in known:
        raise RevgraphError(f"no value named {loss!r} to use as the loss{suggest(loss, known)}")
    return loss


def resolve_wrt(graph: Graph, wrt: Iterable[str] | str | None, types: dict[str, ValueInfo]) -> list[str]:
    """The wrt names: the default (every floating input and initializer) or the given ones, checked."""
    if wrt is None:
        names = default_wrt(graph, types)
        if not names:
            raise RevgraphError("the model has no floating-point inputs or initializers to differentiate; "
                                "name values with --wrt")
        return names
    return _floating_names(graph, names_argument(wrt, "wrt"), types, "to differentiate with respect to",
                           "{name!r} is {type}; only floating-point values have gradients")


def resolve_outputs(graph: Graph, outputs: Iterable[str] | str | None, types: dict[str, ValueInfo]) -> list[str]:
    """The differentiated outputs of forward mode and Jacobians: the given names (checked: known, floating
    point), or every floating-point tensor output of the graph."""
    if outputs is None:
        names = [o for o in graph.output_names
                 if differentiable(types.get(o)) and (types.get(o) or ValueInfo(o)).kind == "tensor"]
        if not names:
            raise RevgraphError("the model has no floating-point outputs to differentiate; name values with --outputs")
        return names
    return _floating_names(graph, names_argument(outputs, "outputs"), types, "to differentiate",
                           "the output {name!r} is {type}, not floating point: an integer or boolean value has no "
                           "derivative; name the floating-point value it is computed from")


def _floating_names(graph: Graph, names: list[str], types: dict[str, ValueInfo], role: str,
                    not_float: str) -> list[str]:
    """``names`` when each names a value of ``graph`` whose type is floating point (or unknown); else a one-line
    :class:`RevgraphError`: "no value named ... {role}" (with close names), or ``not_float`` formatted."""
    known = known_names(graph)
    for name in names:
        if name not in known:
            raise RevgraphError(f"no value named {name!r} {role}{suggest(name, known)}")
        vi = types.get(name)
        if vi is not None and vi.kind == "sequence" and vi.dtype is not None and vi.dtype.kind == "f":
            # floating point, but not a tensor: forward mode and the gradients' outputs take tensors only
            raise RevgraphError(f"{name!r} is {vi.describe()}, a sequence: only tensors can be named {role}; "
                                "name a tensor read from it (SequenceAt, ConcatFromSequence) or computed into it")
        if vi is not None and vi.dtype is not None and not vi.is_float:
            raise RevgraphError(not_float.format(name=name, type=vi.describe()))
    return names
