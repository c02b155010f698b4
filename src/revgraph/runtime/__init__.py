"""Run graphs: :class:`Session` over onnxruntime or ``onnx.reference.ReferenceEvaluator``.

revgraph has no executor of its own; a session converts the graph to ONNX and hands it to one of the two.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping
from contextlib import nullcontext

import numpy as np
import onnx

from .. import limits
from .. import validate as V
from ..errors import InputError, RevgraphError, UnsupportedModelError
from ..ir import Graph, ValueInfo, is_float_dtype
from ..ir.arguments import MODEL
from ..ir.constants import dense_constants
from ..onnx_io import load, to_onnx
from ..onnx_io.external_data import session_source
from .devices import Device
from .options import RuntimeOptions, check_runtime, disabled_optimizers, exact_products, overriding, refusal
from .options import session_options as session_options_for

BACKENDS = ("onnxruntime", "reference")

#: Rewrites for operator domains that no runtime executes, by domain: ``fn(graph) -> graph`` in standard
#: ONNX. revgraph.autodiff registers the expansion of ``ai.onnx.preview.training.Gradient`` here (so that
#: the runtime does not import autodiff).
EXPANDERS: dict = {}


class Session:
    """An executable graph.

    ``graph`` is a :class:`Graph`, an ``onnx.ModelProto`` or a path to an ONNX file (loaded with
    :func:`revgraph.load`). ``backend`` is ``"onnxruntime"`` (``threads`` sets its intra-op thread count, 0
    lets it choose) or ``"reference"`` (``onnx.reference.ReferenceEvaluator``, slow but written from the ONNX
    spec, CPU only). ``device`` is ``"cpu"``, ``"cuda"`` or ``"cuda:<i>"`` (:mod:`revgraph.runtime.devices`; CUDA needs
    onnxruntime-gpu); feeds and results are numpy arrays either way. ``runtime`` (a
    :class:`revgraph.RuntimeOptions`: arena, memory pattern, execution order; ``None`` keeps onnxruntime's
    defaults) and ``session_options`` (an ``onnxruntime.SessionOptions`` to start from; ``runtime`` then
    overrides the settings it names, and the object itself is left unchanged but for one config entry, added for a
    graph with quantized weights so that their products are exact: :func:`revgraph.runtime.options.exact_products`)
    configure onnxruntime's session.
    Raises :class:`RevgraphError` for an unknown backend or device, a CUDA device without onnxruntime's CUDA
    provider, runtime settings with the reference backend, or a graph the backend refuses.
    """

    @V.arguments(graph=MODEL, backend=V.choice(*BACKENDS), threads=V.THREADS)
    def __init__(self, graph: Graph | onnx.ModelProto | str | os.PathLike, backend: str = "onnxruntime", *,
                 threads: int = 0, device: str | Device = "cpu", runtime: RuntimeOptions | None = None,
                 session_options=None):
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise RevgraphError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
            raise RevgraphError(f"threads must be an int >= 0 (0: onnxruntime chooses), got {threads!r}")
        self.device = Device.parse(device)
        check_runtime(runtime)
        if backend == "reference" and (session_options is not None or runtime not in (None, RuntimeOptions())):
            raise RevgraphError("runtime settings (runtime=, session_options=; --arena, --memory-pattern, "
                                "--execution-order) configure onnxruntime; the reference backend takes none")
        if backend == "reference" and self.device.kind != "cpu":
            raise RevgraphError(f"the reference backend runs on the CPU only; use the onnxruntime backend on "
                                f"{self.device}")
        providers = self.device.providers() if backend == "onnxruntime" else None  # no CUDA provider: fail first
        if not isinstance(graph, Graph):
            graph = load(graph)
        graph = expand_domains(graph)
        self.graph = graph
        self.backend = backend
        self.model = to_onnx(graph)
        dense_constants(self.model)  # sparse Constants made dense, alike on both backends and in subgraphs
        if backend == "onnxruntime":
            import onnxruntime as ort

            _check_onnxruntime_opset(graph)
            # the default graph optimisation level (ORT_ENABLE_ALL), as users run models: gradient graphs are
            # tested at it (onnxruntime's transpose optimizer mishandles a Pad with an axes input, which
            # revgraph therefore never writes)
            if session_options is None:
                options = nullcontext(session_options_for(runtime, threads))
            else:  # the user's options, with runtime's settings while the session is made
                options = overriding(session_options, runtime, threads)
            try:
                with options as opts, session_source(self.model) as source:  # a path for a model over 2 GiB
                    self._sess = ort.InferenceSession(source, exact_products(opts, graph), providers=providers,
                                                      disabled_optimizers=disabled_optimizers(graph))
            except RevgraphError:
                raise
            except Exception as exc:  # noqa: BLE001 - onnxruntime's many exception types, one line
                raise RevgraphError(refusal(str(exc)) or f"onnxruntime refuses the graph: {_first_line(exc)}"
                                    f"{_missing_kernel_hint(str(exc), graph)}") from None
            self.device.check_session(self._sess)
        else:
            from onnx.reference import ReferenceEvaluator

            from .reference_ops import FIXED_OPS

            try:
                self._sess = ReferenceEvaluator(self.model, new_ops=FIXED_OPS)
            except Exception as exc:  # noqa: BLE001 - the reference evaluator's errors, one line
                raise RevgraphError(f"the reference evaluator refuses the graph: {_first_line(exc)}") from None

    @property
    def inputs(self) -> list[ValueInfo]:
        """The graph inputs that ``run`` needs (initializers excluded)."""
        return self.graph.inputs

    @property
    def outputs(self) -> list[ValueInfo]:
        return self.graph.outputs

    def run(self, feeds: Mapping[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """Run the graph on ``feeds`` (input name -> array) and return ``{output name: array}``.

        A sequence input is fed, and a sequence output returned, as a list of arrays. A sparse tensor output (a
        sparse ``Constant``'s) is returned dense, zeros where it has no value, on both backends (:func:`dense_output`).
        Raises :class:`InputError` for a missing or unknown feed, or a feed whose dtype or rank or static
        dimensions differ from the declared input; :class:`RevgraphError` if the backend fails.
        """
        if not isinstance(feeds, Mapping):
            raise InputError(f"feeds must map input names to arrays (a dict), got {type(feeds).__name__}; the graph's "
                             f"inputs are {_list(self.graph.inputs)}")
        bad = [k for k in feeds if not isinstance(k, str)]
        if bad:
            raise InputError(f"feed key {bad[0]!r} is {type(bad[0]).__name__}; feeds are keyed by input name (str)")
        names = self._output_names(outputs)
        sequences = {v.name for v in self.graph.inputs if v.kind == "sequence"}
        feeds = {
            k: [np.asarray(x) for x in v] if k in sequences and isinstance(v, (list, tuple)) else np.asarray(v)
            for k, v in feeds.items()
        }
        check_feeds(self.graph, feeds)
        try:
            if self.backend == "onnxruntime":
                # copies: onnxruntime may write an in-place output (the running statistics of a training
                # BatchNormalization) into the caller's fed array
                values = self._sess.run(names, {k: v if isinstance(v, list) else np.array(v) for k, v in feeds.items()})
            else:
                values = self._sess.run(names, feeds)
        except Exception as exc:  # noqa: BLE001 - onnxruntime's many exception types, one line
            hint = ""
            if "Inconsistent shape in loop output" in str(exc):
                hint = (" (a loop's per-iteration outputs change shape between iterations; a gradient graph's loops "
                        "need loop-carried values that keep their shape)")
            raise RevgraphError(f"{self.backend} failed to run the graph: {_first_line(exc)}{hint}") from None
        # np.asarray on a sequence (a list of arrays) would stack it, or fail when the arrays differ in shape.
        return {
            name: [np.asarray(x) for x in v] if isinstance(v, list) else dense_output(name, v)
            for name, v in zip(names, values, strict=True)
        }

    def _output_names(self, outputs: object) -> list[str]:
        """``outputs`` of :meth:`run` checked: ``None`` (every graph output) or a list of output names."""
        if outputs is None:
            return self.graph.output_names
        if isinstance(outputs, str) or not isinstance(outputs, (list, tuple)):
            raise InputError(f"outputs must be a list of output names, got {type(outputs).__name__}")
        known = set(self.graph.output_names)
        unknown = [o for o in outputs if not isinstance(o, str) or o not in known]
        if unknown:
            raise InputError(f"unknown output(s) {', '.join(map(repr, unknown))}; the graph's outputs are "
                             f"{_list(self.graph.outputs)}")
        return list(outputs) or self.graph.output_names


def random_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Random arrays for every graph input: floats (bfloat16 included) from N(0, 1), integers in [0, 2),
    booleans; symbolic or unknown dimensions are 1. ``seed`` is an int >= 0 (numpy's ``default_rng``).
    Raises :class:`InputError` for inputs that cannot be made up (strings, sequences, unknown dtype or rank),
    and before allocating anything for inputs of rank over 64 or over 2 GiB together
    (:func:`revgraph.limits.check_allocation`): a declared shape is a number in the model, not a promise."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise InputError(f"the seed must be an int >= 0, got {seed!r}")
    shapes = {}
    for v in graph.inputs:
        floating = is_float_dtype(v.dtype)
        if v.kind != "tensor" or v.dtype is None or v.shape is None or not (floating or v.dtype.kind in "iub"):
            raise InputError(f"cannot make up a random value for input {v.name!r} ({v.describe()}); "
                             "pass --inputs FILE.npz")
        shapes[v.name] = tuple(d if isinstance(d, int) and d >= 0 else 1 for d in v.shape)
        limits.check_allocation(f"input {v.name!r}", shapes[v.name], v.dtype, "a random input; pass --inputs FILE.npz")
    total = sum(math.prod(shapes[v.name]) * v.dtype.itemsize for v in graph.inputs)
    if total > limits.MAX_MATERIALIZED_BYTES:
        raise InputError(f"the graph's inputs would take {total:,} bytes together; revgraph makes up at most "
                         f"{limits.MAX_MATERIALIZED_BYTES:,} bytes of random inputs: pass --inputs FILE.npz")
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in graph.inputs:
        shape = shapes[v.name]
        if is_float_dtype(v.dtype):
            feeds[v.name] = rng.standard_normal(shape).astype(v.dtype)
        elif v.dtype.kind == "b":
            feeds[v.name] = rng.random(shape) < 0.5
        else:
            feeds[v.name] = rng.integers(0, 2, shape).astype(v.dtype)
    return feeds


def expand_domains(graph: Graph) -> Graph:
    """``graph`` with the nodes of :data:`EXPANDERS`' domains rewritten into standard ONNX."""
    domains = {n.domain for _, n in graph.walk()} & set(EXPANDERS)
    for domain in sorted(domains):
        graph = EXPANDERS[domain](graph)
    left = [n for _, n in graph.walk() if n.domain == "ai.onnx.preview.training"]
    if left:
        raise UnsupportedModelError(
            f"{left[0].label()} of domain ai.onnx.preview.training sits in a subgraph; runtimes do not "
            "execute it and revgraph expands it in the top-level graph only"
        )
    return graph


@functools.cache
def onnxruntime_newest_opset() -> int | None:
    """The newest default-domain opset the installed onnxruntime knows (the newest ``since_version`` of its
    operator schemas: 28 for onnxruntime 1.32), or ``None`` when its build does not list its schemas."""
    try:
        from onnxruntime.capi import _pybind_state

        schemas = _pybind_state.get_all_operator_schema()
        return max(s.since_version for s in schemas if s.domain in ("", "ai.onnx"))
    except Exception:  # noqa: BLE001 - an onnxruntime without the schema list
        return None


def _check_onnxruntime_opset(graph: Graph) -> None:
    """Refuse (:class:`UnsupportedModelError`) a graph at a default-domain opset newer than onnxruntime knows:
    it would read the nodes with older schemas. revgraph loads such a model (the installed onnx knows it); only
    running it on onnxruntime is refused."""
    import onnxruntime as ort

    newest = onnxruntime_newest_opset()
    if newest is not None and graph.opset > newest:
        raise UnsupportedModelError(
            f"the graph is at opset {graph.opset}; onnxruntime {ort.__version__} runs opsets up to {newest}: run it "
            f"with the reference backend (backend='reference', --backend reference) or load the model with "
            f"opset={newest}")


def check_feeds(graph: Graph, feeds: Mapping[str, np.ndarray]) -> None:
    """Raise :class:`InputError` unless ``feeds`` gives every graph input with its declared dtype and shape."""
    expected = {v.name: v for v in graph.inputs}
    missing = [n for n in expected if n not in feeds]
    if missing:
        raise InputError(f"missing input(s) {', '.join(map(repr, missing))}; the graph needs {_list(graph.inputs)}")
    unknown = [n for n in feeds if n not in expected]
    if unknown:
        raise InputError(f"unknown input(s) {', '.join(map(repr, unknown))}; "
                         f"the graph's inputs are {_list(graph.inputs)}")
    for name, arr in feeds.items():
        vi = expected[name]
        if vi.kind != "tensor":
            continue
        if vi.dtype is not None and arr.dtype != vi.dtype:
            raise InputError(f"input {name!r} has dtype {arr.dtype}; the graph declares {vi.describe()}")
        if vi.shape is not None and (
            arr.ndim != len(vi.shape)
            or any(isinstance(d, int) and d != s for d, s in zip(vi.shape, arr.shape, strict=True))
        ):
            raise InputError(f"input {name!r} has shape {list(arr.shape)}; the graph declares {vi.describe()}")


def _list(vis: list[ValueInfo]) -> str:
    return ", ".join(f"{v.name} {v.describe()}" for v in vis) or "none"


def _missing_kernel_hint(message: str, graph: Graph) -> str:
    """Where onnxruntime has no kernel for a node ("Could not find an implementation for Mul(14) node with name
    'm'"), the node's input types and what to do: onnxruntime's CPU build has almost no bfloat16 kernels."""
    match = re.search(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'", message)
    if not match:
        return ""
    op, version, name = match.groups()
    types = {v.name: v for v in [*graph.inputs, *graph.outputs, *graph.value_info.values()]}
    types.update((k, ValueInfo(k, np.asarray(a).dtype)) for k, a in graph.initializers.items())
    node = next((n for _, n in graph.walk() if n.name == name), None)
    dtypes = sorted({str(types[i].dtype) for i in (node.inputs if node else []) if i in types and types[i].dtype})
    typed = f" on {', '.join(dtypes)}" if dtypes else ""
    return (f" (onnxruntime has no {op}-{version} kernel{typed} for node {name!r} on this device: run it with "
            "the reference backend, --backend reference, or in float32)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if len(lines) == 1 else " ".join(lines)[:400]


def dense_output(name: str, value) -> np.ndarray:
    """An output of a run as a numpy array: a sparse tensor (onnxruntime's ``SparseTensor``, a sparse
    ``Constant``'s output) is densified, zeros where it has no value, so that every caller (``run -o`` writing
    an .npz, the checker, training) sees the tensor ONNX defines instead of a Python object; its dense form is
    refused over :data:`revgraph.limits.MAX_MATERIALIZED_BYTES` (:class:`RevgraphError`, one line)."""
    from ..limits import check_allocation

    if type(value).__name__ == "SparseTensor" and isinstance(getattr(value, "values", None), np.ndarray):
        # onnx.reference's SparseTensor (values, indices and shape as attributes): a Session hands the
        # evaluator dense Constants (constants.dense_constants); this keeps any other path that yields one alike
        from ..ir.constants import densify, linear_indices

        shape = tuple(int(d) for d in value.shape)
        check_allocation(f"sparse output {name!r}", shape, value.values.dtype, "its dense form")
        values = value.values.reshape(-1)
        return densify(values, linear_indices(value.indices, values.shape[0], shape, f"sparse output {name!r}"),
                       shape)
    if not hasattr(value, "dense_shape") or not hasattr(value, "values"):
        return np.asarray(value)

    shape = tuple(int(d) for d in value.dense_shape())
    values = np.asarray(value.values()).reshape(-1)
    check_allocation(f"sparse output {name!r}", shape, values.dtype, "its dense form")
    if "COO" not in str(value.format):
        raise RevgraphError(f"output {name!r} is a sparse tensor in {value.format} form; revgraph densifies COO "
                            "sparse outputs only")
    indices = np.asarray(value.get_coo_data().indices(), dtype=np.int64)
    dense = np.zeros(math.prod(shape), dtype=values.dtype)
    if indices.ndim == 2:  # [NNZ, rank] coordinates (ONNX allows them beside [NNZ] linear indices)
        indices = np.ravel_multi_index(tuple(indices.T), shape) if indices.size else indices.reshape(-1)
    dense[indices.reshape(-1)] = values
    return dense.reshape(shape)
