"""VJPs of matrix products and determinants (ONNX operator spec, "MatMul", "Gemm", "Einsum", "Det"; derivatives
as in JAX's ``jax/_src/lax/lax.py`` (``_dot_general_transpose_lhs/rhs``) and PyTorch's
``tools/autograd/derivatives.yaml`` (``mm``, ``addmm``, ``einsum``, ``linalg_det``)).

The cotangent of a product with respect to one factor is again a product: of the output cotangent with the
other factors. Broadcast batch dimensions are undone afterwards with :meth:`Emitter.reduce_to`.
"""

from __future__ import annotations

import string
from collections import Counter
from functools import cache, partial

import numpy as np

from ...errors import GraphError
from ...ir import Node, onnx_dtype
from ..algebra import Val
from ..context import Ctx
from ..emitter import Emitter
from ..registry import vjp
from .tables import eye as _eye_of
from .tables import small

ELLIPSIS = "..."


def _last_swapped(rank: int) -> list[int]:
    """The permutation that swaps the last two of ``rank`` axes (the batched matrix transpose)."""
    return [*range(rank - 2), rank - 1, rank - 2]


@vjp("MatMul", bounded=True, finite=True, product=True, mixing=True)
def matmul(ctx: Ctx, node: Node, cts: list) -> list:
    """``dA = dY @ B^T`` and ``dB = A^T @ dY``, summed over broadcast batch axes (numpy.matmul semantics,
    ONNX "MatMul"). A 1-D operand is promoted to a matrix as numpy does (``[k] -> [1, k]`` on the left,
    ``[k] -> [k, 1]`` on the right) and the promoted axis is summed away at the end."""
    e, (a, b), g = ctx.e, ctx.vals(*node.inputs), ctx.val(cts[0])
    ra, rb = e.need_rank(a.name, node), e.need_rank(b.name, node)
    if ra == 0 or rb == 0:
        raise GraphError(f"{node.label()}: MatMul operands must have rank >= 1")

    @cache
    def g2() -> Val:  # the output dropped the promoted axes: put them back so that dY is a batch of matrices
        axes = ([-2] if ra == 1 else []) + ([-1] if rb == 1 else [])
        return g.unsqueeze(axes) if axes else g

    def da() -> Val:
        bt = b.unsqueeze([0]) if rb == 1 else b.transpose(_last_swapped(rb))  # B^T as [..., m, k]
        t = g2() @ bt  # [batch..., n, k]
        if ra == 1:  # the promoted row axis (size 1) and every batch axis are summed: [k]
            return t.apply("ReduceSum", e.ints(range(max(rb, 2) - 1)), keepdims=0, like=a)
        return t.reduce_to(a)

    def db() -> Val:
        k, m = (a.dims or (None,))[-1], (b.dims or (None,))[-1]
        if rb == 2 and ra >= 3 and isinstance(k, int) and isinstance(m, int):
            # A batch of activations times a weight matrix: one GEMM over the flattened batch, rather than a
            # batched MatMul whose [batch..., k, m] result a ReduceSum then sums (the same sum, in one kernel).
            return a.reshape([-1, k]).apply("Gemm", g.reshape([-1, m]), transA=1, like=b)
        at = a.unsqueeze([1]) if ra == 1 else a.transpose(_last_swapped(ra))  # A^T as [..., k, n]
        t = at @ g2()  # [batch..., k, m]
        if rb == 1:  # sum the batch axes and the promoted column axis: [k]
            rt = max(ra, 2)
            return t.apply("ReduceSum", e.ints([*range(rt - 2), rt - 1]), keepdims=0, like=b)
        return t.reduce_to(b)

    return [da, db]


@vjp("Gemm", bounded=True, finite=True, product=True, mixing=True)
def gemm(ctx: Ctx, node: Node, cts: list) -> list:
    """``Y = alpha * op(A) @ op(B) + beta * C`` (ONNX "Gemm"): ``d op(A) = alpha * dY @ op(B)^T``,
    ``d op(B) = alpha * op(A)^T @ dY``, ``dC = beta * dY`` summed to C's (unidirectionally broadcast)
    shape. Each matrix cotangent is written as one more ``Gemm`` whose transpose flags absorb ``op``."""
    e, (a, b), g = ctx.e, node.inputs[:2], cts[0]
    c = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    alpha = float(node.attrs.get("alpha", 1.0))
    beta = float(node.attrs.get("beta", 1.0))
    ta, tb = int(node.attrs.get("transA", 0)), int(node.attrs.get("transB", 0))
    al = alpha if alpha != 1.0 else None

    def flag(v: int) -> int | None:
        return 1 if v else None

    def da() -> str:
        if ta:  # A = op(A)^T, so dA = alpha * op(B) @ dY^T
            return e.op("Gemm", [b, g], alpha=al, transA=flag(tb), transB=1, like=a)
        return e.op("Gemm", [g, b], alpha=al, transB=flag(1 - tb), like=a)

    def db() -> str:
        if tb:  # dB = alpha * dY^T @ op(A)
            return e.op("Gemm", [g, a], alpha=al, transA=1, transB=flag(ta), like=b)
        return e.op("Gemm", [a, g], alpha=al, transA=flag(1 - ta), like=b)

    def dc() -> Val:
        gv = ctx.val(g)
        return (gv if beta == 1.0 else gv * beta).reduce_to(c)

    return [da, db, None if c is None else dc][:len(node.inputs)]


# ---------------------------------------------------------------------------------------------- Einsum


def _tokens(term: str) -> list[str]:
    """The subscripts of one operand: letters, and ``...`` as one token."""
    head, dots, tail = term.partition(ELLIPSIS)
    return [*head, *([ELLIPSIS] if dots else []), *tail]


def parse_equation(equation: str) -> tuple[list[str], str]:
    """``(input terms, output term)`` of an Einsum equation; the implicit form's output is the ellipsis
    followed by the letters used exactly once, in ASCII order (ONNX "Einsum", numpy.einsum)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if not arrow:
        counts = Counter(ch for t in terms for ch in t.replace(ELLIPSIS, ""))
        rhs = (ELLIPSIS if any(ELLIPSIS in t for t in terms) else "") + "".join(
            sorted(ch for ch, n in counts.items() if n == 1)
        )
    return terms, rhs


def _eye(e: Emitter, x: str, axis: int) -> str:
    """An identity matrix of size ``x.shape[axis]`` and ``x``'s dtype (the Kronecker delta that puts a
    cotangent back on a diagonal)."""
    s = e.shape(x)
    dt = e.dtype(x)
    if s is not None and dt is not None:
        return _eye_of(e, s[axis], x)  # a constant when small, EyeLike otherwise
    n = e.op("Gather", [e.shape_of(x), e.ints([axis])], axis=0)
    zeros = e.op("ConstantOfShape", [e.op("Concat", [n, n], axis=0)],
                 value=np.zeros(1, dtype=dt if dt is not None else np.float32))
    one = e.op("EyeLike", [zeros])
    return one if dt is not None else e.op("CastLike", [one, x])


def _fit(e: Emitter, t: str, x: str) -> str:
    """``t`` (aligned with ``x`` from the right, possibly with extra leading axes, broadcast axes, and
    size-1 axes where ``x`` was summed only in its own term) made into ``x``'s shape: ``Expand`` where
    ``x`` is larger, then :meth:`Emitter.reduce_to` where ``t`` is."""
    dt, dx = e.dims(t), e.dims(x)
    fits = (
        dt is not None and dx is not None and len(dt) >= len(dx)
        and all(b in (a, 1) for a, b in zip(dt[len(dt) - len(dx):], dx, strict=True))
    )
    if not fits:
        t = e.op("Expand", [t, e.shape_of(x)])
    return e.reduce_to(t, x)


def _layout(tokens: list[str], lead: int, k: int) -> list[int]:
    """The permutation from ``[ellipsis (lead axes)..., letters...]`` to ``[lead - k extra axes...,
    operand layout...]``, the operand's ellipsis being the last ``k`` of the ``lead`` axes."""
    perm = list(range(lead - k))
    letter = 0
    for tok in tokens:
        if tok == ELLIPSIS:
            perm.extend(range(lead - k, lead))
        else:
            perm.append(lead + letter)
            letter += 1
    return perm


@vjp("Einsum", bounded=True, finite=True, reads="all", mixing=True)
def einsum(ctx: Ctx, node: Node, cts: list) -> list:
    """The cotangent of operand i is an Einsum of the output cotangent with the other operands whose
    output subscripts are operand i's (PyTorch ``einsum_backward``, the tensor-contraction form of
    ``dA = dY @ B^T``). Subscripts that make this impossible are fixed around it: a letter repeated in
    operand i (a diagonal) is renamed and tied to the original by an identity matrix; a letter that
    appears only in operand i (summed out) is dropped and broadcast back with ``Expand``; ellipsis and
    broadcast axes are placed first and summed with :meth:`Emitter.reduce_to`."""
    e, g = ctx.e, cts[0]
    terms, out_term = parse_equation(node.attrs["equation"])
    if len(terms) != len(node.inputs):
        raise GraphError(f"{node.label()}: the equation has {len(terms)} operands but the node {len(node.inputs)}")
    toks = [_tokens(t) for t in terms]
    has_ell = any(ELLIPSIS in t for t in toks)
    ell_rank = []
    for x, tk in zip(node.inputs, toks, strict=True):
        ell_rank.append(e.need_rank(x, node) - (len(tk) - 1) if ELLIPSIS in tk else 0)
    lead = max(ell_rank, default=0)  # the output cotangent's ellipsis rank
    taken = set(node.attrs["equation"])

    def cotangent(i: int) -> str:
        x, k = node.inputs[i], ell_rank[i]
        spare = (ch for ch in string.ascii_lowercase + string.ascii_uppercase if ch not in taken)
        operands = [(g, out_term)] + [(v, terms[j]) for j, v in enumerate(node.inputs) if j != i]
        letters: list[str] = []  # operand i's letters in order, repeats renamed
        for pos, tok in enumerate(toks[i]):
            if tok == ELLIPSIS:
                continue
            if tok in letters:
                fresh = next(spare, None)
                if fresh is None:
                    raise GraphError(f"{node.label()}: too many subscripts to differentiate the equation")
                axis = pos if ELLIPSIS not in toks[i][:pos] else pos + k - 1
                operands.append((_eye(e, x, axis), tok + fresh))
                tok = fresh
            letters.append(tok)
        present = {ch for _, t in operands for ch in t}
        kept = [ch for ch in letters if ch in present]
        res_term = (ELLIPSIS if has_ell else "") + "".join(kept)
        if len(operands) == 1 and res_term == out_term:
            t = g
        else:
            eq = ",".join(term for _, term in operands) + "->" + res_term
            if has_ell and any(e.shape(v) is None for v, _ in operands):
                # ONNX inference gives a broadcast ellipsis the first operand's symbolic dimensions, which
                # would hide the axes reduce_to must sum: record the rank only.
                t = e.op("Einsum", [v for v, _ in operands], equation=eq,
                         shape=(None,) * (lead + len(kept)), dtype=e.dtype(g))
            else:
                t = e.op("Einsum", [v for v, _ in operands], equation=eq)
        # Letters summed only within operand i come back as size-1 axes (expanded by _fit).
        missing = [lead + p for p, ch in enumerate(letters) if ch not in present]
        if missing:
            t = e.op("Unsqueeze", [t, e.ints(missing)])
        # Layout now [ellipsis (lead axes)..., letters...]; operand i wants its ellipsis (its last k
        # axes) where its term has it, behind the lead - k axes that reduce_to sums away.
        perm = _layout(toks[i], lead, k)
        if perm != list(range(len(perm))):
            t = e.op("Transpose", [t], perm=perm)
        return _fit(e, t, x)

    return [partial(cotangent, i) for i in range(len(node.inputs))]


# ---------------------------------------------------------------------------------------------- Det


def _cofactors(e: Emitter, x: str, rank: int) -> str:
    """The cofactor matrices of ``x`` ``[*, n, n]``: ``C[.., i, j] = (-1)^(i + j) det(x without row i and
    column j)``. The ``n^2`` minors are gathered as one ``[*, n, n, n-1, n-1]`` batch (rows and columns kept:
    ``keep[i, j] = j + (j >= i)``) and given to ``Det``, whose VJP is this one again (gradients of gradients).
    Constants when ``n`` is static, ``Range``-based indices otherwise."""
    dims, dt = e.dims(x), e.dtype(x)
    n = next((d for d in (dims[-1], dims[-2]) if isinstance(d, int)), None)
    i64 = np.int64
    if n is not None and small([n, n]):  # larger tables are computed by Range below (a [20000, 20000] Det)
        keep = e.const(np.array([[j + (j >= i) for j in range(n - 1)] for i in range(n)], dtype=i64).reshape(n, n - 1))
        signs = 1 - 2 * (np.add.outer(np.arange(n), np.arange(n)) % 2)
        sign = e.const(signs.astype(dt)) if dt is not None else e.op("CastLike", [e.const(signs.astype(np.float32)), x])
    else:
        size = e.op("Squeeze", [e.op("Shape", [x], start=-1)], dtype=np.dtype(i64), shape=())
        zero, one = e.const(i64(0)), e.const(i64(1))
        rows = e.op("Range", [zero, size, one])
        cols = e.op("Range", [zero, e.op("Sub", [size, one]), one])
        col_row = e.op("Unsqueeze", [cols, e.ints([0])])
        row_col = e.op("Unsqueeze", [rows, e.ints([1])])
        keep = e.op("Add", [col_row, e.op("Cast", [e.op("GreaterOrEqual", [col_row, row_col])],
                                          to=onnx_dtype(np.int64))])
        parity = e.op("Mod", [e.op("Add", [row_col, e.op("Unsqueeze", [rows, e.ints([0])])]), e.const(i64(2))])
        sign = e.op("CastLike", [e.op("Sub", [one, e.op("Mul", [parity, e.const(i64(2))])]), x])
    b = rank - 2
    minors = e.op("Gather", [e.op("Gather", [x, keep], axis=b), keep], axis=rank)  # [*, i, rows, j, cols]
    minors = e.op("Transpose", [minors], perm=[*range(b), b, b + 2, b + 1, b + 3])
    return e.op("Mul", [e.op("Det", [minors]), sign], like=x)


@vjp("Det", bounded=False, finite=False)
def det(ctx: Ctx, node: Node, cts: list) -> list:
    """``d det(X) / dX = adj(X)^T``, the cofactor matrix (Jacobi's formula; ONNX "Det"), so ``dX = dy C``.
    Written with cofactors, not ``det(X) X^-T`` (PyTorch's ``linalg_det_backward`` for invertible inputs;
    it takes an SVD at singular ones, and ONNX has neither an inverse nor an SVD): exact at singular matrices
    too (rank ``n - 1``: a rank-one adjugate; lower rank: 0). Cost ``n^2`` determinants of order ``n - 1`` per
    matrix (:func:`_cofactors`), ``O(n^5)`` time and ``O(n^4)`` memory: meant for the small matrices ``Det``
    is used on."""
    e, x, g = ctx.e, node.inputs[0], cts[0]
    rank = e.need_rank(x, node)
    dims = e.dims(x)
    if rank < 2 or (isinstance(dims[-1], int) and isinstance(dims[-2], int) and dims[-1] != dims[-2]):
        raise GraphError(f"{node.label()}: Det needs square matrices [*, M, M], not the shape {tuple(dims)}")

    def dx() -> str | Val:
        if dims[-1] == 0 or dims[-2] == 0:
            return e.zeros_like(x)
        gm = ctx.val(g).unsqueeze([-2, -1])
        if dims[-1] == 1 or dims[-2] == 1:  # det [[a]] = a (no 0 x 0 minors to gather)
            return gm.apply("Expand", e.shape_of(x), like=x)
        return gm.apply("Mul", _cofactors(e, x, rank), like=x)  # dy C

    return [dx]
