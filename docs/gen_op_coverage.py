"""Write docs/op_coverage.md from revgraph's rule table: every operator of the default ONNX domain at the
newest opset revgraph reads, marked as having a VJP rule, not differentiable (and why), or missing.

    python docs/gen_op_coverage.py          # rewrites docs/op_coverage.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx

from revgraph.autodiff.registry import DOMAIN_RULES, LOWERED, NOT_DIFFERENTIABLE, RULES
from revgraph.ir import NEWEST_OPSET

#: operators that could have a rule but have none yet, and why
NOT_YET = {
    "Optional": "ONNX optional values are not differentiated yet (no exporter writes them on a path to a loss)",
    "OptionalGetElement": "as Optional",
    "LinearAttention": "opset 27 (Gated DeltaNet, RetNet-style linear attention with a recurrent state): no rule yet",
    "CausalConvWithState": "opset 27 (Mamba, Gated DeltaNet): a depthwise causal Conv1d with a carried state; "
                           "no rule yet",
}

#: what a VJP rule does not differentiate, where that is the point (issue 41)
RULE_NOTES = {
    "DynamicQuantizeLinear": "the scale, through max(0, max x) and min(0, min x); y and the zero point are rounded "
                             "integers: a DequantizeLinear of y is refused without --straight-through, and gets the "
                             "straight-through estimator with it",
    "Unique": "the values Y only (indices, inverse_indices and counts are integers); at ties, where Y is not "
              "differentiable, the cotangent goes to each value's first occurrence (jax.numpy.unique's convention)",
    "BitCast": "refused from float to float (the bits are reinterpreted: no derivative); from or to an integer type "
               "no gradient flows",
}

OUT = Path(__file__).with_name("op_coverage.md")


def default_domain_ops(opset: int = NEWEST_OPSET) -> list[str]:
    """Operators of the default domain that exist at ``opset`` (not deprecated there)."""
    names = set()
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain in ("", "ai.onnx") and schema.since_version <= opset:
            names.add(schema.name)
    ops = []
    for name in sorted(names):
        try:
            schema = onnx.defs.get_schema(name, opset, "")
        except onnx.defs.SchemaError:
            continue
        if not schema.deprecated:
            ops.append(name)
    return ops


#: the math of the operators outside ONNX's standard set (onnxruntime docs/ContribOperators.md), for the table
CONTRIB_MATH = {
    "SimplifiedLayerNormalization": "RMSNorm over `[axis, rank)`: `Y = X r scale`, `r = (mean(X^2) + eps)^-1/2`; "
                                    "the `inv_std_var` output (`r`) carries gradient too",
    "SkipLayerNormalization": "`LayerNorm(input + skip + bias) * gamma + beta` over the last axis; the `mean`, "
                              "`inv_std_var` and `input_skip_bias_sum` outputs carry gradient too",
    "SkipSimplifiedLayerNormalization": "RMSNorm of `input + skip + bias`, times `gamma`; `inv_std_var` and "
                                        "`input_skip_bias_sum` carry gradient (`mean` is zeros)",
    "Gelu": "`X Phi(X)` (erf)",
    "BiasGelu": "`Gelu(A + B)` (erf)",
    "FastGelu": "`x (1 + tanh(0.797885 x + 0.035677 x^3)) / 2`, `x = X + bias`",
    "QuickGelu": "`X sigmoid(alpha X)`",
    "BiasAdd": "`X + bias + skip` (onnxruntime runs it on CUDA only)",
    "FusedMatMul": "`alpha op(A) @ op(B)` with `transA`, `transB`, `transBatchA`, `transBatchB`",
    "MatMulNBits": "`A @ dequantize(B)^T + bias` (2, 4 or 8 bits, block-wise scales and zero points): a frozen base, "
                   "gradients to `A` and `bias` only (asking for the scales' is refused)",
    "RotaryEmbedding": "RoPE of 3-D or 4-D input (`interleaved`, `rotary_embedding_dim`, `position_ids` `[B, S]` or "
                       "one start); the cos/sin caches get rows at the positions",
    "GroupQueryAttention": "causal grouped-query attention with the KV cache (packed or separate QKV, `seqlens_k`, "
                           "`total_sequence_length`, `do_rotary`, `local_window_size`, `softcap`, `attention_bias`, "
                           "`head_sink`); quantized caches refused",
    "MultiHeadAttention": "attention with the projection bias, key padding mask (`mask_filter_value`), "
                          "`unidirectional`, `attention_bias`, past/present; packed QKV refused",
    "Attention": "`input @ weights + bias` split into Q, K, V (`qkv_hidden_sizes`), the masks of "
                 "MultiHeadAttention and `[2B]` end/start positions, past/present; `do_rotary` refused (not on CPU)",
    "EmbedLayerNormalization": "`LayerNorm(word[ids] + position[p] + segment[seg])`; the tables get rows at "
                               "their ids, `embedding_sum` carries gradient too",
    "LinearClassifier": "scores `post(X W^T + b)` (`NONE`, `LOGISTIC`, `SOFTMAX`, `SOFTMAX_ZERO`; one target with two "
                        "labels: `[1 - p, p]`), gradient to `X`; the label has none; `PROBIT` refused; "
                        "`W`, `b` are attributes: `--lift-constants` makes them trainable initializers",
    "LinearRegressor": "`post(X W^T + b)` (the transform for more than one target), gradient to `X`; "
                       "`--lift-constants` makes `W`, `b` trainable initializers",
    "Normalizer": "`x / z` per row, `z` the `MAX` (ties split, as ReduceMax), `L1` or `L2` norm; `x` where `z = 0`",
}


def contrib_rows() -> list[str]:
    """A row per operator outside ONNX's standard set with a VJP rule: onnxruntime's contrib operators
    (``com.microsoft``) and those onnxruntime writes in the default domain (``SimplifiedLayerNormalization``),
    with its math (:data:`CONTRIB_MATH`, else the first sentence of the rule's docstring); revgraph's private
    domains (``revgraph.*``) left out."""
    rules = {(d, op): r for (d, op), r in DOMAIN_RULES.items() if not d.startswith("revgraph")}
    rules.update((("ai.onnx (default)", op), r) for op, r in RULES.items() if not onnx.defs.has(op))
    rows = []
    for (domain, op), rule in sorted(rules.items()):
        doc = " ".join((rule.__doc__ or "").split()).split(". ")[0].rstrip(".")
        rows.append(f"| {op} | {domain} | {CONTRIB_MATH.get(op, doc)} |")
    return rows


def render() -> str:
    ops = default_domain_ops()
    rows, counts = [], {"VJP rule": 0, "not differentiable": 0, "missing": 0}
    for op in ops:
        if op in RULES:
            status, note = "VJP rule", RULE_NOTES.get(op, "")
        elif op in LOWERED:
            status, note = "VJP rule", LOWERED[op]
        elif op in NOT_DIFFERENTIABLE:
            status, note = "not differentiable", NOT_DIFFERENTIABLE[op]
        else:
            status, note = "missing", NOT_YET.get(op, "")
        counts[status] += 1
        rows.append(f"| {op} | {status} | {note} |")
    summary = ", ".join(f"{v} {k}" for k, v in counts.items())
    return "\n".join([
        "# Operator coverage",
        "",
        f"Every operator of the default ONNX domain at opset {NEWEST_OPSET} (onnx {onnx.__version__}): {summary}.",
        "Generated by `python docs/gen_op_coverage.py` from revgraph's rule table; do not edit by hand.",
        "",
        "| operator | gradient | note |",
        "|---|---|---|",
        *rows,
        "",
        "## Operators outside ONNX's standard set",
        "",
        ("onnxruntime's contrib operators, which its transformer optimizer and model builder write, and the "
         "`ai.onnx.ml` linear models skl2onnx writes. The forward keeps "
         "the node (onnxruntime runs it); its VJP is written in standard ONNX operators."),
        "",
        "| operator | domain | math |",
        "|---|---|---|",
        *contrib_rows(),
        "",
    ])


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
    sys.exit(0)
