"""The names a backward pass is asked about, checked at the API boundary: the loss, the wrt values, the seeds.

Each check raises :class:`RevgraphError` with one line naming the value and what to do (close names are
suggested).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from ..errors import RevgraphError
from ..ir import Graph, NameSet, ValueInfo, is_float_dtype


def used_names(graph: Graph) -> set[str]:
    """Every value and node name of ``graph`` and its subgraphs (fresh names must avoid them all)."""
    return NameSet(graph.all_names() | {n.name for _, n in graph.walk() if n.name})


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
            raise RevgraphError("the model has no floating-point inputs or initializers to differentiate; name values with --wrt")
        return names
    names = names_argument(wrt, "wrt")
    known = known_names(graph)
    for n in names:
        if n not in known:
            raise RevgraphError(f"no value named {n!r} to differentiate with respect to{suggest(n, known)}")
        vi = types.get(n)
        if vi is not None and vi.dtype is not None and not vi.is_float:
            raise RevgraphError(f"{n!r} is {vi.describe()}; only floating-point values have gradients")
    return names
