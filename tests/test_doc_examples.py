"""Every code block of the README and docs/ runs (issue 44, item 3), through sybil (tests/kit/doc_examples.py):
Python blocks execute, shell blocks run as a user runs them, and the outputs they show (comments after a
command, a text block right after a shell block) are compared with what the commands print.

Each page runs in a fresh directory with the files its blocks take as given (the fixtures below: the small
models the Python tours load, the digits data of the train guide, a tiny exported LLaMA). Blocks that need
what CI has not (two machines, npm, a full benchmark run, package downloads) carry sybil's skip directive
with the reason; blocks that take minutes at their printed size run under ``-m slow``
(``REVGRAPH_DOCS_FULL=1``), their output checked there.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from unittest import SkipTest

import numpy as np
import pytest
import sybil  # noqa: F401  # (in the test extra: missing, it fails instead of skipping)
from conftest import DATA_DIR
from kit.doc_examples import SYBIL

import revgraph as rg
from revgraph.ir import Node, ValueInfo

ROOT = Path(__file__).resolve().parent.parent
#: the README and every page of docs/ that has a code block
PAGES = [p for p in ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
         if any(True for _ in SYBIL.parse(ROOT / p))]
F32 = np.float32


def tiny_models(ns: dict) -> None:
    """model.onnx (``y = x w + b``, ``loss = mean(y * y)``; static shapes, for Jacobians) and classifier.onnx
    (an MLP of 3 classes over a symbolic batch), and the arrays the tours feed them."""
    rng = np.random.default_rng(0)
    x_info = ValueInfo("x", F32, (8, 4))
    model = rg.Graph([Node("MatMul", ["x", "w"], ["xw"]), Node("Add", ["xw", "b"], ["y"]),
                      Node("Mul", ["y", "y"], ["yy"]), Node("ReduceMean", ["yy"], ["loss"], {"keepdims": 0})],
                     [x_info], [ValueInfo("y", F32, (8, 3)), ValueInfo("loss", F32, ())],
                     {"w": rng.normal(0, 0.5, (4, 3)).astype(F32), "b": np.zeros(3, F32)})
    rg.save(model, "model.onnx")
    classifier = rg.Graph([Node("MatMul", ["x", "W1"], ["h0"]), Node("Add", ["h0", "b1"], ["h1"]),
                           Node("Relu", ["h1"], ["h"]), Node("MatMul", ["h", "W2"], ["o0"]),
                           Node("Add", ["o0", "b2"], ["logits"])],
                          [ValueInfo("x", F32, ("N", 4))], [ValueInfo("logits", F32, ("N", 3))],
                          {"W1": rng.normal(0, 0.5, (4, 16)).astype(F32), "b1": np.zeros(16, F32),
                           "W2": rng.normal(0, 0.5, (16, 3)).astype(F32), "b2": np.zeros(3, F32)})
    rg.save(classifier, "classifier.onnx")
    ns.update(x=rng.normal(0, 1, (8, 4)).astype(F32), y=rng.integers(0, 3, 8), g=rg.load("model.onnx"),
              x_test=rng.normal(0, 1, (8, 4)).astype(F32), y_test=rng.integers(0, 3, 8))


def digits(ns: dict) -> None:
    """The train guide's data and model: digits.npz, digits-test.npz, mlp.onnx (its first block makes them)."""
    from revgraph.tools import demo

    train, test = demo.digits()
    np.savez("digits.npz", **train)
    np.savez("digits-test.npz", **test)
    rg.save(demo.mlp_model(), "mlp.onnx")


def llama(ns: dict) -> None:
    """docs/huggingface.md's files: a tiny LLaMA exported by ``rg.export_torch`` as llama.onnx (the module as
    ``module`` and ``base_model``) and tokens.npz (its training data, also as ``data``)."""
    import torch
    import transformers as tf

    class Llama(tf.LlamaForCausalLM):  # the logits alone, as docs/training.md exports it
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    torch.manual_seed(0)
    model = Llama(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).eval()
    rg.export_torch(model, (torch.randint(0, 64, (2, 16)),), "llama.onnx", input_names=["input_ids"],
                    output_names=["logits"], dynamic_shapes={"input_ids": {0: "batch"}})
    tokens(ns)
    ns.update(module=model, base_model=model, data=dict(np.load("tokens.npz")))


def tokens(ns: dict) -> None:
    """tokens.npz: 32 sequences of 16 token ids below 64, the vocabulary of docs/training.md's LLaMA."""
    np.savez("tokens.npz", input_ids=np.random.default_rng(0).integers(0, 64, (32, 16)))


FIXTURES = {"docs/DESIGN.md": [tiny_models], "docs/guides/differentiate.md": [tiny_models],
            "docs/guides/forward-mode.md": [tiny_models], "docs/guides/lora.md": [digits],
            "docs/guides/distributed.md": [digits], "docs/huggingface.md": [llama], "docs/training.md": [tokens]}


@pytest.fixture
def rule_slots():
    """docs/guides/adding-a-rule.md registers the rules of Mul, Sin and Tanh as they read: their slots are
    emptied for the page and the registry is restored after it."""
    from revgraph.autodiff import registry

    tables = {k: v for k, v in vars(registry).items() if isinstance(v, dict) and not k.startswith("__")}
    saved = {k: dict(v) for k, v in tables.items()}
    for table in tables.values():
        for op in ("Mul", "Sin", "Tanh"):
            table.pop(op, None)
    yield
    for k, table in tables.items():
        table.clear()
        table.update(saved[k])


def _run_page(page: str, tmp_path, monkeypatch, request) -> list[str]:
    """Every example of ``page`` in order, in a fresh directory; returns the skip reasons met (sybil's directive)."""
    monkeypatch.chdir(tmp_path)
    mm = DATA_DIR / "pytorch-operator" / "test_operator_mm" / "model.onnx"
    monkeypatch.setenv("M", str(mm))
    monkeypatch.setenv("L", str(DATA_DIR / "light" / "light_resnet50.onnx"))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # (pages run the examples by their repository path)
    if page in PAGE_SKIPS:
        pytest.skip(PAGE_SKIPS[page])
    document = SYBIL.parse(ROOT / page)
    document.namespace.update(rg=rg, np=np, shutil=shutil, FULL=os.environ.get("REVGRAPH_DOCS_FULL") == "1")
    if page == "docs/guides/adding-a-rule.md":
        request.getfixturevalue("rule_slots")
    for make in FIXTURES.get(page, []):
        make(document.namespace)
    skipped = []
    for example in document:
        try:
            example.evaluate()
        except SkipTest as exc:
            skipped.append(f"line {example.line}: {exc}")
    return skipped

#: pages whose blocks are not run, and why (a generated page cannot carry sybil's skip directive: bench/report.py
#: writes it whole)
PAGE_SKIPS = {"docs/benchmarks.md": "its blocks re-run the benchmarks (bench/run.py: minutes to hours, and JAX and "
              "onnxruntime-training environments to download); tests/test_bench_report.py re-renders this page"}


@pytest.mark.parametrize("page", PAGES)
def test_code_blocks_run(page, tmp_path, monkeypatch, request):
    _run_page(page, tmp_path, monkeypatch, request)


LONG = ["docs/guides/train.md", "docs/guides/lora.md"]  # pages with blocks that take minutes at their printed size


@pytest.mark.slow
@pytest.mark.parametrize("page", LONG)
def test_long_code_blocks_run(page, tmp_path, monkeypatch, request):
    monkeypatch.setenv("REVGRAPH_DOCS_FULL", "1")
    _run_page(page, tmp_path, monkeypatch, request)


def test_the_guide_shows_the_readmes_pytorch_example():
    """The differentiation guide's PyTorch example is the README's three commands (which run above), line for
    line: its Python block is README's export.py, and each of its shell lines is one of the README's."""
    import re

    def blocks(path: Path, language: str) -> list[str]:
        return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.DOTALL)

    readme, guide = ROOT / "README.md", ROOT / "docs" / "guides" / "differentiate.md"
    export = next(b for b in blocks(readme, "python") if b.startswith("# export.py:"))
    assert export.split("\n", 1)[1] in blocks(guide, "python")
    shell = next(b for b in blocks(guide, "bash") if b.startswith("revgraph grad bert_cls.onnx"))
    readme_lines = next(b for b in blocks(readme, "bash") if "bert_cls.onnx" in b).splitlines()
    assert all(line in readme_lines for line in shell.splitlines()), shell


@pytest.mark.parametrize(("shown", "printed", "agree"), [
    ("wrote g.onnx: 122 forward + 307 backward nodes", "wrote g.onnx: 122 forward + 307 backward nodes", True),
    ("wrote g.onnx: 122 forward + 307 backward nodes", "wrote g.onnx: 122 forward + 308 backward nodes", False),
    ("parameters: 4,810 trainable", "parameters: 4,811 trainable", False),
    ("eval data: loss 0.4692, accuracy 99.61%", "eval data: loss 0.4694, accuracy 99.61%", True),  # 1%
    ("eval data: loss 0.4692, accuracy 99.61%", "eval data: loss 0.4811, accuracy 99.61%", False),
    ("eval data: loss 0.4692, accuracy 99.61%", "eval data: loss 0.4692, accuracy 97.21%", False),
    ("outputs: a_grad, ...", "outputs: a_grad, b_grad, ... (35 more)", True),
    ("loss 0.0044 38,983 samples/s 0:00:01", "loss 0.0044 9,729 samples/s 0:00:04", True),  # times not compared
    ("test accuracy 97.49% after 30 epochs in 1.8 s", "test accuracy 97.49% after 31 epochs in 4.5 s", False),
    ("max rel error 4.7e-10", "max rel error 4.71e-10", True),
    ("max rel error 4.7e-10", "max rel error 5.2e-10", False),
    ("exit code 2", "exit code 1", False),
])
def test_shown_outputs_are_compared_by_value(shown, printed, agree):
    """The comparison the output checks make (tests/kit/doc_examples.py): counts exactly, decimals within 1%, the
    clock and throughput left out, ``...`` for the rest of a line."""
    from kit.doc_examples import matches

    assert matches(shown, printed) is agree
