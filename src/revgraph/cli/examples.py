"""The examples at the end of each subcommand's ``--help`` (the epilog; :func:`revgraph.cli.layout.finish` puts them
there), keyed by the subcommand as typed after ``revgraph``. Each is a command one can run as written once the
files it names exist; the comment says what it does."""

from __future__ import annotations

EXAMPLES: dict[str, list[tuple[str, str]]] = {
    "": [  # revgraph --help
        ("revgraph demo", "train, check and draw two small models on scikit-learn's digits"),
        ("revgraph grad model.onnx -o model.grad.onnx", "the gradient graph"),
        ("revgraph train --help", "a command's options by group, and its examples"),
    ],
    "info": [
        ("revgraph info model.onnx", "inputs, outputs, initializers, operators, opset"),
        ("revgraph info model.grad.onnx", "the gradient outputs a grad run added"),
    ],
    "run": [
        ("revgraph run model.onnx", "random inputs (seed 0): a table of the outputs"),
        ("revgraph run model.onnx --inputs in.npz -o out.npz", "inputs by name from in.npz"),
        ("revgraph run model.onnx --backend reference --seed 3", "onnx's reference evaluator"),
    ],
    "grad": [
        ("revgraph grad model.onnx -o model.grad.onnx", "a <name>_grad output per input and initializer"),
        ("revgraph grad model.onnx -o vjp.onnx --loss logits --wrt W1 --cotangent input",
         "a VJP: the cotangent of logits is an input"),
        ("revgraph grad model.onnx -o g.onnx --memory-budget 0.5",
         "store at most half the residuals, recompute the rest"),
    ],
    "check": [
        ("revgraph check model.onnx", "all gradients against float64 central differences"),
        ("revgraph check model.onnx --loss loss --wrt W1 --inputs in.npz", "at the given inputs"),
        ("revgraph check model.onnx --seed 7 --rtol 1e-3", "other random inputs, a looser tolerance"),
    ],
    "show": [
        ("revgraph show model.onnx -o model.svg", "the forward graph (needs Graphviz's dot)"),
        ("revgraph show model.onnx --grad -o model.grad.dot", "forward and backward, as DOT text"),
    ],
    "jvp": [
        ("revgraph jvp model.onnx -o model.jvp.onnx", "a <x>_tangent input per input, <y>_tangent = J t outputs"),
        ("revgraph jvp model.onnx -o jvp.onnx --outputs logits --wrt x", "the tangent of logits along x only"),
    ],
    "hvp": [
        ("revgraph hvp model.onnx -o model.hvp.onnx", "<x>_grad and <x>_hvp outputs for a <x>_tangent input"),
        ("revgraph hvp model.onnx -o hvp.onnx --loss loss --wrt W1 --checkpoint sqrt", "loops in O(sqrt(T)) memory"),
    ],
    "jacobian": [
        ("revgraph jacobian model.onnx -o model.jacobian.onnx", "<y>_jacobian_<x> outputs"),
        ("revgraph jacobian model.onnx -o jac.onnx --outputs logits --wrt x --mode reverse",
         "one VJP per element of logits"),
    ],
    "hessian": [
        ("revgraph hessian model.onnx -o model.hessian.onnx", "<x>_hessian and cross blocks <xi>_hessian_<xj>"),
        ("revgraph hessian model.onnx -o h.onnx --loss loss --wrt W1 b1", "the blocks of two values"),
    ],
    "train": [
        ("revgraph train mlp.onnx --data digits.npz --loss-fn cross-entropy --epochs 20 -o mlp.trained.onnx",
         "Adam, batch 32, shuffled"),
        (("revgraph train llama.onnx --data tokens.npz --loss-fn causal-lm --lora 8 --max-steps 200 "
          "--lr-schedule cosine --warmup-steps 20 --precision bf16 -o llama.lora.onnx"), "LoRA fine-tuning"),
        (("revgraph train mlp.onnx --data digits.npz --loss-fn cross-entropy --epochs 20 --nproc 2 "
          "--snapshot-dir ckpt -o mlp.trained.onnx"), "data-parallel in 2 processes, resumable"),
    ],
    "demo": [
        ("revgraph demo", "two models trained, checked and drawn in ./revgraph-demo"),
        ("revgraph demo --quick -o /tmp/demo", "a short run (a smoke test)"),
    ],
    "lora": [
        ("revgraph lora extract llama.lora.onnx -o adapters.npz", "the adapters of a --lora run"),
        ("revgraph lora apply llama.onnx adapters.npz -o llama.merged.onnx --merge", "folded into the weights"),
    ],
    "lora extract": [
        ("revgraph lora extract llama.lora.onnx -o adapters.npz", "arrays by name and the configuration"),
        ("revgraph lora extract llama.lora.onnx --format peft --task-type CAUSAL_LM -o adapter/",
         "a directory PEFT loads"),
    ],
    "lora apply": [
        ("revgraph lora apply llama.onnx adapters.npz -o llama.adapted.onnx", "adapters as separate nodes"),
        ("revgraph lora apply llama.onnx adapter/ -o llama.merged.onnx --merge", "a PEFT directory, folded in"),
    ],
}


def epilog(command: str) -> str | None:
    """The ``examples:`` block of ``command``'s ``--help`` (each command on its own line, its comment below it,
    so that no line needs wrapping at 80 columns), or ``None`` for a command without examples."""
    if command not in EXAMPLES:
        return None
    lines = ["examples:"]
    for cmd, what in EXAMPLES[command]:
        lines += [*_wrapped(cmd), f"      # {what}"]
    return "\n".join(lines)


def _wrapped(command: str, width: int = 78) -> list[str]:
    """``command`` in lines of at most ``width`` columns, continued with a backslash as a shell reads it; an
    option stays on the line of its value."""
    words = command.split()
    pieces: list[str] = []
    for word in words:  # "--lora 8" is one piece
        if pieces and pieces[-1].startswith("-") and " " not in pieces[-1] and not word.startswith("-"):
            pieces[-1] += " " + word
        else:
            pieces.append(word)
    lines = ["  " + pieces[0]]
    for piece in pieces[1:]:
        if len(lines[-1]) + len(piece) + 3 > width:
            lines[-1] += " \\"
            lines.append("      " + piece)
        else:
            lines[-1] += " " + piece
    return lines
