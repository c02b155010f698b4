"""onnxruntime's memory settings, as users set them: :class:`RuntimeOptions` (``rg.RuntimeOptions``).

Three settings of ``onnxruntime.SessionOptions`` decide how much memory a session keeps beyond the tensors
themselves:

- ``arena`` (``enable_cpu_mem_arena``): the CPU allocator keeps freed blocks in an arena that grows and is
  never given back to the system during the session; off, every tensor is allocated and freed with the C
  allocator (memory returns to the system as the step ends);
- ``arena_extend``: how the CPU arena grows when it runs out: ``"next_power_of_two"`` (onnxruntime's default: each
  session has its own arena, extended by chunks that double, reserving address space it may never touch) or
  ``"same_as_requested"``: one arena for the process (:func:`shared_arena`, onnxruntime's environment allocator,
  ``session.use_env_allocators``), shared by the sessions that ask for it and extended by what is requested. The
  shared arena keeps what it grew to until the process ends, also after its sessions are gone;
- ``memory_reuse`` (``enable_mem_reuse``): onnxruntime's allocation planner gives a new tensor the buffer of
  a freed tensor of the same shape, planned ahead, so that buffer stays allocated from its first tensor's birth to
  its last one's death, through the gap between them; off, each tensor is allocated when it is computed and freed
  after its last reader (the arena, on, then reuses freed blocks of any size as they come);
- ``memory_pattern`` (``enable_mem_pattern``): after a run onnxruntime records the sizes of the
  intermediate tensors and, for inputs of the same shapes, allocates them next time as one block planned
  ahead; off, each tensor is allocated when it is computed and freed after its last reader;
- ``execution_order`` (``execution_order``): the topological order onnxruntime runs the nodes in:
  ``"default"``, ``"priority_based"`` or ``"memory_efficient"`` (the last exists in onnxruntime's training
  builds only; a regular build refuses it when a session is made). ``"default"`` is a depth-first walk back from
  the graph's outputs; ``"priority_based"`` runs the nodes in the graph's own order (a node as soon as it is
  ready, the earliest in the file first), except nodes onnxruntime itself adds;
- ``graph_optimization`` (``graph_optimization_level``): ``"none"``, ``"basic"``, ``"extended"`` or ``"all"``
  (onnxruntime's default). Its fusions replace nodes by new ones, which ``"priority_based"`` runs last.

One setting is revgraph's own, for the sessions of a training engine on the CPU:

- ``frozen_weights``: ``"shared"`` (``None`` too) makes each large float initializer (a LoRA fine-tune's frozen base
  weight) an input of every session, bound to one copy (:mod:`revgraph.runtime.shared_initializers`);
  ``"constants"`` leaves it a constant of each session, which onnxruntime copies and prepacks per session:
  a step 1.01-1.03x faster at 64-512 rows a batch and 1.15x at 8 (bench/frozen_memory.py), at 8x its memory where there
  is an evaluation session and 4x without.

``None`` leaves a setting to whoever runs the graph: ``rg.Session`` keeps onnxruntime's defaults (arena on,
memory pattern and memory reuse on, the default order); ``rg.Trainer`` and ``revgraph train`` use
:data:`TRAINING_DEFAULT` (memory pattern and memory reuse off, arena on), chosen by ``bench/runtime_settings.py``
and ``bench/runtime_order.py`` (docs/benchmarks.md, "Runtime memory settings and buffer sets", "Memory in
revgraph's order").

Not a user setting: every revgraph session of a graph with quantized weights (``DequantizeLinear`` into
``MatMul``/``Gemm``) computes their products exactly, in float32 (:func:`exact_products`), so that a LoRA model
trained on a quantized base computes what its merged float model computes.
"""

from __future__ import annotations

from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace

from ..errors import RevgraphError

#: ``frozen_weights`` values (module doc).
FROZEN_WEIGHTS = ("shared", "constants")
#: ``execution_order`` values and the ``onnxruntime.ExecutionOrder`` members they name.
EXECUTION_ORDERS = {"default": "DEFAULT", "priority_based": "PRIORITY_BASED", "memory_efficient": "MEMORY_EFFICIENT"}
#: ``graph_optimization`` values and the ``onnxruntime.GraphOptimizationLevel`` members they name.
GRAPH_OPTIMIZATIONS = {"none": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
                       "all": "ORT_ENABLE_ALL"}


#: ``arena_extend`` values (onnxruntime's ``arena_extend_strategy``: kNextPowerOfTwo, kSameAsRequested)
ARENA_EXTENDS = {"next_power_of_two": 0, "same_as_requested": 1}
#: the session setting that makes a session allocate from the environment's allocators (:func:`shared_arena`)
ENV_ALLOCATORS = "session.use_env_allocators"
_shared: list[bool] = []  # whether shared_arena registered (or found) the process's arena


def shared_arena() -> None:
    """Register, once per process, the CPU arena that sessions with ``arena_extend="same_as_requested"`` share:
    onnxruntime's environment allocator (``onnxruntime.create_and_register_allocator``) with an ``OrtArenaCfg``
    of ``arena_extend_strategy`` kSameAsRequested (each extension the size requested), no size limit and
    onnxruntime's default chunk settings. When the process registered a CPU allocator already (onnxruntime
    refuses a second), the sessions share that one."""
    if _shared:
        return
    import onnxruntime as ort

    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    with suppress(Exception):  # (raised when one is registered already: the sessions use it)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, ARENA_EXTENDS["same_as_requested"], -1, -1))
    _shared.append(True)


@dataclass(frozen=True)
class RuntimeOptions:
    """onnxruntime memory settings (module doc); ``None`` leaves a setting at onnxruntime's default.

    ``arena``: ``enable_cpu_mem_arena`` (bool); ``memory_pattern``: ``enable_mem_pattern`` (bool);
    ``memory_reuse``: ``enable_mem_reuse`` (bool); ``arena_extend``: ``"next_power_of_two"`` or
    ``"same_as_requested"`` (the CPU arena's growth; the second shares one arena in the process);
    ``execution_order``: one of ``"default"``, ``"priority_based"``, ``"memory_efficient"``;
    ``graph_optimization``: one of ``"none"``, ``"basic"``, ``"extended"``, ``"all"``; ``frozen_weights``:
    ``"shared"`` (``None``: the same) or ``"constants"`` (revgraph's training engines on the CPU, module doc). Raises
    :class:`RevgraphError` (one line naming the argument and its choices) for any other value. Settings never
    change results beyond float rounding: they decide where tensors live, in which order nodes run and which
    nodes onnxruntime fuses.
    """

    arena: bool | None = None
    memory_pattern: bool | None = None
    execution_order: str | None = None
    graph_optimization: str | None = None
    memory_reuse: bool | None = None
    arena_extend: str | None = None
    frozen_weights: str | None = None

    def __post_init__(self) -> None:
        for name in ("arena", "memory_pattern", "memory_reuse"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise RevgraphError(f"RuntimeOptions {name} must be True, False or None (onnxruntime's default), "
                                    f"got {value!r}")
        for name, choices in (("execution_order", EXECUTION_ORDERS), ("graph_optimization", GRAPH_OPTIMIZATIONS),
                              ("arena_extend", ARENA_EXTENDS), ("frozen_weights", FROZEN_WEIGHTS)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value not in choices):
                raise RevgraphError(f"RuntimeOptions {name} must be one of {', '.join(choices)} or None "
                                    f"(onnxruntime's default), got {value!r}")

    def apply(self, options=None):
        """Set the fields that are not ``None`` on ``options`` (an ``onnxruntime.SessionOptions``; a new one
        when ``None``) and return it. Fields left at ``None`` keep ``options``' values."""
        import onnxruntime as ort

        if options is None:
            options = ort.SessionOptions()
        elif not isinstance(options, ort.SessionOptions):
            raise RevgraphError(f"session_options must be an onnxruntime.SessionOptions, got {type(options).__name__}")
        if self.arena is not None:
            options.enable_cpu_mem_arena = self.arena
        if self.memory_pattern is not None:
            options.enable_mem_pattern = self.memory_pattern
        if self.memory_reuse is not None:
            options.enable_mem_reuse = self.memory_reuse
        if self.arena_extend is not None:
            shared = self.arena_extend == "same_as_requested" and self.arena is not False
            if shared:
                shared_arena()
            options.add_session_config_entry(ENV_ALLOCATORS, "1" if shared else "0")
        if self.execution_order is not None:
            options.execution_order = getattr(ort.ExecutionOrder, EXECUTION_ORDERS[self.execution_order])
        if self.graph_optimization is not None:
            level = GRAPH_OPTIMIZATIONS[self.graph_optimization]
            options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        return options

    def over(self, base: RuntimeOptions | None) -> RuntimeOptions:
        """These settings where they are not ``None``, ``base``'s elsewhere."""
        if base is None:
            return self
        return replace(base, **{k: v for k, v in vars(self).items() if v is not None})

    def describe(self) -> str:
        """``"arena off, memory pattern off, execution order default"`` (settings left to onnxruntime say so)."""
        def word(v):
            return "onnxruntime's default" if v is None else ("on" if v else "off")

        order = self.execution_order or "onnxruntime's default"
        level = self.graph_optimization or "onnxruntime's default"
        extend = self.arena_extend or "onnxruntime's default"
        return (f"arena {word(self.arena)} (extended {extend}), memory pattern {word(self.memory_pattern)}, memory "
                f"reuse {word(self.memory_reuse)}, execution order {order}, graph optimization {level}, frozen "
                f"weights {self.frozen_weights or 'shared'}")


#: What ``rg.Trainer`` and ``revgraph train`` run with unless told otherwise (docs/benchmarks.md, "Runtime memory
#: settings and buffer sets", bench/runtime_settings.py): the memory pattern off, which about halves a step's
#: peak over setup (the planned block holds every intermediate at once) at no cost in step time, and the arena
#: on: off, every step's tensors are allocated and freed through the C allocator, which costs 8-30% more CPU time
#: per step on the CNN and the Transformer and lowers no peak but the LLaMA's by a few percent. The step graph
#: runs in the order revgraph wrote it ("priority_based", no graph optimizations, whose fused nodes that order
#: would run last), the order the memory planner's lifetimes assume (memory/lifetime.py): onnxruntime's default
#: order, a depth-first walk back from the outputs, held the LLaMA step of bench/memory_common.py at 1,183 MB
#: over setup at batch 64 against 784 MB in revgraph's order, at the same CPU time per step (docs/benchmarks.md,
#: "Memory in revgraph's order"; issue 42). Memory reuse off: the buffers onnxruntime's planner holds for a later
#: tensor of the same shape were a third of the LLaMA step's peak under ``memory=0.5`` (the arena reuses freed
#: blocks anyway, at no cost in step time; docs/benchmarks.md, "Memory in revgraph's order").
#: The arena extended by what is requested, one for the process: onnxruntime's doubling chunks held issue 42's
#: LLaMA at 2,104 MB at batch 80 against 1,739 MB (and its address space at 2,832 against 2,197 MB), and its
#: sessions (grad, update, evaluation) each kept an arena of their own.
TRAINING_DEFAULT = RuntimeOptions(arena=True, memory_pattern=False, execution_order="priority_based",
                                  graph_optimization="none", memory_reuse=False, arena_extend="same_as_requested")


#: onnxruntime graph optimizers that would merge a node the memory planner recomputes in the backward
#: (``remat/...``) back into its forward original: the gradient would stay right, the memory saving be lost
ORT_DISABLED_OPTIMIZERS = ("CommonSubexpressionElimination",)


#: onnxruntime's rewrite rule that folds ``Sum(Gemm(A, B), C)`` into ``Gemm(A, B, C)``. It throws while the
#: session is built (``gemm_sum_fusion.cc``: "gemm_input_edge.src_arg_index < 2 was false"; onnxruntime 1.32)
#: when the Gemm reads an output of its producer at position 2 or later: the rule checks the producer's output
#: position where it means the Gemm's input slot. A valid graph, which gradients write: a loop's third carried
#: value read by a Gemm whose weight is also read inside the loop, so that its gradient adds the Gemm's
#: contribution to the loop's (issue 41: the gradient of a JAX ``lax.scan``). It is a level-1 rule: every
#: optimization level but "disable all" runs it; other runtimes do not have it.
GEMM_SUM_FUSION = "GemmSumFusion"


def disabled_optimizers(graph) -> list[str]:
    """The ``disabled_optimizers`` argument of ``onnxruntime.InferenceSession`` for ``graph`` (a
    :class:`revgraph.Graph`): :data:`ORT_DISABLED_OPTIMIZERS` when a node anywhere in it is a recomputation
    (named ``remat/...``), and :data:`GEMM_SUM_FUSION` where :func:`gemm_sum_trap` finds the pattern it throws
    on; else none (onnxruntime's optimizers as users run them)."""
    from ..ir import REMAT_PREFIX

    disabled = []
    if any(node.name.startswith(REMAT_PREFIX) for _, node in graph.walk()):
        disabled += ORT_DISABLED_OPTIMIZERS
    if gemm_sum_trap(graph):
        disabled.append(GEMM_SUM_FUSION)
    return disabled


def gemm_sum_trap(graph) -> bool:
    """Whether ``graph`` (subgraphs included, each scope apart) has what :data:`GEMM_SUM_FUSION` throws on: a
    ``Gemm`` without its ``C`` input, read by a two-input ``Sum``, that reads an output of position 2 or later
    of the node producing it."""
    scopes = [graph] + [sub for _, node in graph.walk() for sub in node.subgraphs.values()]
    return any(scope_gemm_sum_trap(g) for g in scopes)


def scope_gemm_sum_trap(g) -> bool:
    """:func:`gemm_sum_trap` in the nodes of ``g`` itself (not its subgraphs: onnxruntime's edges join the
    nodes of one scope)."""
    late = {o for n in g.nodes for o in n.outputs[2:] if o}
    if not late:
        return False
    summed = {i for n in g.nodes if n.op_type == "Sum" and not n.domain and len(n.inputs) == 2 for i in n.inputs}
    return any(n.op_type == "Gemm" and not n.domain and (len(n.inputs) == 2 or not n.inputs[2])
               and late.intersection(n.inputs[:2]) and n.outputs[0] in summed for n in g.nodes)


#: onnxruntime's session config key for the compute type of the ``MatMulNBits`` nodes it makes when it fuses a
#: ``DequantizeLinear`` of a constant int4/uint4/int8/uint8 weight into the ``MatMul``/``Gemm`` reading it
#: (onnxruntime's ``kOrtSessionOptionsQDQMatMulNBitsAccuracyLevel``, onnxruntime_session_options_config_keys.h;
#: its default, "4", quantizes the activations to int8 inside the product; "0" computes in float32).
QDQ_ACCURACY_KEY = "session.qdq_matmulnbits_accuracy_level"


def quantized_products(graph) -> bool:
    """Whether ``graph`` (a :class:`revgraph.Graph`, subgraphs included) has a ``MatMul``/``Gemm`` reading the
    output of a ``DequantizeLinear``: a quantized base weight (QLoRA), the pattern onnxruntime's full
    optimization fuses into ``MatMulNBits``. An existing ``MatMulNBits`` node is not counted: its
    ``accuracy_level`` attribute is the model's own choice (the config entry leaves it alone, measured) and a
    merged LoRA model keeps that node as it is, so training and the merged model compute it alike."""
    walked = [n for _, n in graph.walk()]
    dequantized = {n.outputs[0] for n in walked if n.op_type == "DequantizeLinear" and n.outputs}
    return any(n.op_type in ("MatMul", "Gemm") and dequantized.intersection(n.inputs[:2]) for n in walked)


def exact_products(options, graph):
    """``options`` (an ``onnxruntime.SessionOptions``) set so that the session of ``graph`` computes the products of
    quantized weights exactly (to float32 rounding) as ``DequantizeLinear`` then a float ``MatMul``; returned.

    Why: onnxruntime fuses ``DequantizeLinear`` + ``MatMul``/``Gemm`` into ``MatMulNBits`` (int4, and int8 per
    tensor, per axis or blocked, in 1.32) whose default accuracy level quantizes the activations to int8, so a
    LoRA model trained and evaluated on a quantized base would compute 0.4-0.7% of the output scale away from
    its merged float model (``W + (alpha / r) A B`` folded into a float weight; measured on K=128 products,
    tests/test_qlora_exact.py); training must learn what is merged. :data:`QDQ_ACCURACY_KEY` "0" keeps the fused
    kernel (4-bit weights stay packed, same speed as the default on this CPU) computing in float32: within
    3-4e-7 of a float64 dequantize-and-matmul, as exact as the unfused graph. The alternatives cost more:
    disabling ``QDQSelectorActionTransformer`` dequantizes every weight on every run (3x the time of a
    2048x2048 int4 product), and ``session.disable_quant_qdq`` folds the weights into float constants (4-8x
    the memory). Set only when :func:`quantized_products` finds the pattern, and never over a value the user's
    options already give for the key (their explicit choice). onnxruntime offers no way to remove a config
    entry, so a user's options object keeps it afterwards."""
    if quantized_products(graph):
        try:
            options.get_session_config_entry(QDQ_ACCURACY_KEY)
        except RuntimeError:  # not set: onnxruntime raises for a missing key
            options.add_session_config_entry(QDQ_ACCURACY_KEY, "0")
    return options


def check_runtime(runtime: object, what: str = "runtime") -> RuntimeOptions | None:
    """``runtime`` if it is a :class:`RuntimeOptions` or ``None``; :class:`RevgraphError` otherwise."""
    if runtime is not None and not isinstance(runtime, RuntimeOptions):
        raise RevgraphError(f"{what} must be a revgraph.RuntimeOptions or None, got {type(runtime).__name__}")
    return runtime


def session_options(runtime: RuntimeOptions | None = None, threads: int = 0):
    """A new ``onnxruntime.SessionOptions`` for revgraph's own sessions: errors reach revgraph as exceptions
    (log level fatal only), ``threads`` intra-op threads (0: onnxruntime's choice) and ``runtime``'s settings
    (``None``: onnxruntime's defaults)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = threads
    return check_runtime(runtime).apply(options) if runtime is not None else options


@contextmanager
def overriding(base, runtime: RuntimeOptions | None = None, threads: int = 0):
    """``base`` (a user's ``onnxruntime.SessionOptions``) with ``runtime``'s settings and ``threads`` (unless 0)
    set on it while the block runs, and its own values back afterwards: a session copies its options when it is
    made, so the user's object keeps everything it holds (config entries, custom operator libraries) and is
    left as it was. Raises :class:`RevgraphError` when ``base`` is not an ``onnxruntime.SessionOptions``."""
    import onnxruntime as ort

    if not isinstance(base, ort.SessionOptions):
        raise RevgraphError(f"session_options must be an onnxruntime.SessionOptions, got {type(base).__name__}")
    names = ["enable_cpu_mem_arena", "enable_mem_pattern", "enable_mem_reuse", "execution_order",
             "graph_optimization_level", "intra_op_num_threads"]
    saved = {n: getattr(base, n) for n in names}
    env = config_entry(base, ENV_ALLOCATORS) or "0"
    try:
        if runtime is not None:
            check_runtime(runtime).apply(base)
        if threads:
            base.intra_op_num_threads = threads
        yield base
    finally:
        for n, v in saved.items():
            setattr(base, n, v)
        if runtime is not None and runtime.arena_extend is not None:  # (an entry cannot be removed: "0" is unset)
            base.add_session_config_entry(ENV_ALLOCATORS, env)


def config_entry(options, key: str) -> str | None:
    """``options``' (an ``onnxruntime.SessionOptions``) session config entry ``key``; ``None`` when never set."""
    try:
        return options.get_session_config_entry(key)
    except Exception:  # noqa: BLE001 - onnxruntime raises for an entry never set
        return None


def refusal(message: str) -> str | None:
    """The one-line error for onnxruntime refusing a session because of a setting here, or ``None``."""
    if "Memory efficient topological order is not enabled" in message:
        return ("onnxruntime refuses execution_order 'memory_efficient': this onnxruntime is not a training build "
                "(that order exists in onnxruntime-training only); use default or priority_based")
    return None
