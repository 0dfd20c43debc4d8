"""Weight-only int8 and int4 for an engine's shared weight store: linears as ``com.microsoft.MatMulNBits``.

Every linear of an exported serving graph is ``Reshape → Gemm(x, W, transB=1) → Reshape``
with ``W [out, in]`` a model tensor (or ``com.microsoft.FusedMatMul(x, W, transB=1)`` once
onnxruntime fusions have rewritten it). ``MatMulNBits`` stores its B as ``[N, n_blocks,
blob]`` and computes ``A @ dequant(B)^T``, so ``W [out, in]`` maps onto it directly with
``N = out``, ``K = in``: each such node becomes ``MatMulNBits(x, W.q<bits>, W.scales)``.

The quantization itself is onnxruntime's: :class:`onnxruntime.quantization.matmul_nbits_quantizer.
DefaultWeightOnlyQuantizer`'s ``qbits_block_quant`` (the C++ ``quantize_matmul_4bits`` /
``quantize_matmul_8bits`` kernels), given ``W^T [K, N]`` as it expects. The weights are those of
onnxruntime-genai's model builder for ``-p int4 -e cpu`` (``onnxruntime_genai/models/
quantization/quant_config.py`` and ``builders/base.py``, onnxruntime-genai 0.18): blocks of 32
along K, symmetric (no zero points: ``MatMulNBits`` then takes 8 for 4 bits and 128 for 8
bits), every ``MatMul`` including the LM head quantized; the activations are not (see "Accuracy
level" below: genai's ``accuracy_level=4`` is an option here); the token embedding is quantized only at 4 bits and only where it is tied to
the LM head (genai's ``shared_embeddings``: ``GatherBlockQuantized`` reads the LM head's int4
blocks; ``GatherBlockQuantized`` has no 8-bit path), otherwise it stays in the model's float
dtype and is read by ``Gather``. Here the tied gather reads the same bytes under a second
name shaped ``[N, K / 2]`` (genai reshapes in the graph): the store keeps identical bytes once,
so disk and memory hold one copy.

One copy: :class:`Quantizer` quantizes each weight once (by name) for the whole export, and
every graph (each budget's, the row-wise graph) references the same ``<name>.q4`` /
``<name>.scales`` tensors; a float weight that no node reads any more is dropped from the
graph, so it never reaches ``weights.bin``.

A graph composed from layer functions takes its weights as function arguments, so the
rewrite inlines the functions first (onnxruntime inlines them anyway when it loads a graph):
a quantized graph file holds the flat node list.

In memory the store is still mapped once, but ``MatMulNBits`` runs its fast kernels only over
weights onnxruntime has pre-packed, so the runtime pre-packs quantized engines by default
(:class:`looptool.backends.ort.runtime.Runtime`), and each session then holds its own packed
copy (onnxruntime shares packed weights across sessions only through its C API).

SmolLM2-135M at int4: the blocks and scales written here are byte-identical to those of
onnxruntime-genai's ``-p int4 -e cpu`` build (checked for the LM head and ``down_proj``).

Accuracy level (``MatMulNBits``' ``accuracy_level``: how the CPU kernel computes with the
dequantized weights). At :data:`ACCURACY_LEVEL` (1, the default) it multiplies float32
activations; at :data:`FAST_ACCURACY_LEVEL` (4, genai's CPU default) it first rounds each row's
activations to int8 per block of 32 and runs integer dot products. Measured with one
``MatMulNBits`` node in onnxruntime 1.32 (K 64-1536, N 64-49152, 4 and 8 bits, 1-8 threads,
M = 1-100 rows): at level 4 a row's result is bitwise the same whatever M and the other rows;
at level 1 it is bitwise one of two values, M = 1 (a vector kernel) or M > 1, ~1e-6 apart, as
float32 results of a different summation order are. Level 4 breaks batch invariance all the same,
because int8 rounding is not continuous: everything before a linear (attention over a longer
padded cache, the row-wise graph's masked passes, an LM head or level-1 kernel that ran at
another M) leaves a row's activations last-bit different in a batch than alone, and where that
moves one activation across a rounding boundary the output moves by a whole int8 step (~1e-3
where float32 moves ~1e-6). Through the layers, a level-4 engine's logits for a prompt move
with the batch it runs in by 1e-3 to 1e-2 (tiny test llamas) and up to ~1 (SmolLM2-135M), a
level-1 or float engine's by 1e-7 to 1e-4, so level 4 changes greedy tokens at near ties
(SmolLM2-135M int4, 8 prompts at mixed budgets: 3 answers change, none at level 1). So level 1
keeps the serving promise (a request's tokens do not depend on the others in its batch) as
float engines keep it; level 4 is faster (SmolLM2 int4 decoding: level 1 takes 1.39× its time
per step; tests/bench/README.md, "int4 and int8 accuracy levels"), and an engine exported with
it gives answers that depend on the batch. Levels 2 and
3 (fp16, bf16) compute in float32 on x86 CPUs (bitwise level 1's results) and are not offered.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from looptool.backends.errors import ExportError

QUANTIZED = ("int8", "int4")
BITS = {"int8": 8, "int4": 4}
BLOCK_SIZE = 32  # onnxruntime-genai's default block size (weights.block_size)
ACCURACY_LEVEL = 1  # float32 activations: a row's answer does not depend on the batch
FAST_ACCURACY_LEVEL = 4  # genai's CPU default: int8 activations, faster, answers depend on the batch
ACCURACY_LEVELS = (ACCURACY_LEVEL, FAST_ACCURACY_LEVEL)
ACTIVATIONS = {  # what each level means for a served request, as the export says it
    ACCURACY_LEVEL: "float activations (accuracy level 1: each answer independent of its batch)",
    FAST_ACCURACY_LEVEL: "int8 activations (accuracy level 4: faster, each answer depends on its batch)",
}
MS_DOMAIN = "com.microsoft"


def check_quantize(quantize: str | None) -> str | None:
    """``None`` (float weights) or one of :data:`QUANTIZED`; one sentence for anything else."""
    if quantize is not None and quantize not in QUANTIZED:
        raise ExportError(
            f"weight quantization {quantize!r} is not supported; choose 'int8' or 'int4' (or None for float weights).",
            parameter="quantize",
        )
    return quantize


def check_accuracy_level(level: int) -> int:
    """One of :data:`ACCURACY_LEVELS`; one sentence for anything else."""
    if level not in ACCURACY_LEVELS:
        raise ExportError(
            f"accuracy level {level!r} is not supported; choose {ACCURACY_LEVEL} (float activations: each "
            f"request's answer independent of its batch, the default) or {FAST_ACCURACY_LEVEL} (int8 activations: "
            "faster, answers depend on the batch).",
            parameter="accuracy_level",
        )
    return level


def check_activations(quantize: str | None, accuracy_level: int) -> None:
    """Refuse, in one sentence, an accuracy level that is not supported or that has no
    quantized weights to apply to (``quantize`` None: float weights)."""
    check_accuracy_level(accuracy_level)
    if quantize is None and accuracy_level != ACCURACY_LEVEL:
        raise ExportError(
            f"accuracy level {accuracy_level} applies to int8/int4 weights (MatMulNBits); drop it or pick "
            "precision int8 or int4.",
            parameter="accuracy_level",
        )


def quantizer_for(quantize: str | None, accuracy_level: int = ACCURACY_LEVEL) -> Quantizer | None:
    """The export's :class:`Quantizer` for ``quantize`` (None: float weights, no quantizer) at
    ``accuracy_level``, both checked."""
    check_activations(check_quantize(quantize), accuracy_level)
    return None if quantize is None else Quantizer(quantize, accuracy_level=accuracy_level)


def batch_dependent(quantization: dict | None) -> bool:
    """Whether an engine whose manifest records ``quantization`` (:meth:`Quantizer.describe`)
    quantizes activations too (:data:`FAST_ACCURACY_LEVEL`), so that a row's answer depends on
    the batch it runs in."""
    return bool(quantization) and quantization.get("accuracy_level") == FAST_ACCURACY_LEVEL


@dataclass
class QuantizedWeight:
    """One weight ``[N, K]`` as blocks (``[N, n_blocks, blob]`` uint8) and scales (``[N, n_blocks]``);
    ``digest``: sha256 of the float weight (a tied embedding has the same bytes)."""

    name: str
    blocks: np.ndarray
    scales: np.ndarray
    n: int
    k: int
    bits: int
    digest: str

    @property
    def blocks_name(self) -> str:
        return f"{self.name}.q{self.bits}"

    @property
    def scales_name(self) -> str:
        return f"{self.name}.scales"

    @property
    def gather_name(self) -> str:
        """The blocks under a second name, shaped ``[N, K / 2]`` for ``GatherBlockQuantized``."""
        return f"{self.name}.q{self.bits}.rows"


@dataclass
class Quantizer:
    """Quantizes weights once per export and rewrites each graph to read them (``MatMulNBits``
    at ``accuracy_level``: :data:`ACCURACY_LEVEL` float activations, :data:`FAST_ACCURACY_LEVEL`
    int8 ones; see the module docstring)."""

    precision: str
    block_size: int = BLOCK_SIZE
    accuracy_level: int = ACCURACY_LEVEL
    weights: dict[str, QuantizedWeight] = field(default_factory=dict)
    tensors: dict[str, str] = field(default_factory=dict)  # sha256 of every tensor it made, by name

    @property
    def bits(self) -> int:
        return BITS[self.precision]

    def quantize(self, name: str, weight: np.ndarray) -> QuantizedWeight:
        """``weight [out, in]`` quantized with onnxruntime's blockwise quantizer (cached by name)."""
        done = self.weights.get(name)
        if done is not None:
            return done
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            DefaultWeightOnlyQuantizer,
        )

        config = DefaultWeightOnlyQuantConfig(
            block_size=self.block_size, is_symmetric=True, accuracy_level=self.accuracy_level, bits=self.bits
        )
        n, k = weight.shape
        blocks, scales, _ = DefaultWeightOnlyQuantizer(config).qbits_block_quant(np.ascontiguousarray(weight.T))
        digest = hashlib.sha256(np.ascontiguousarray(weight).tobytes()).hexdigest()
        q = QuantizedWeight(name, np.ascontiguousarray(blocks), np.ascontiguousarray(scales), n, k, self.bits, digest)
        blocks_digest = hashlib.sha256(q.blocks.tobytes()).hexdigest()
        self.tensors.update(
            {
                q.blocks_name: blocks_digest,
                q.gather_name: blocks_digest,  # the same bytes
                q.scales_name: hashlib.sha256(q.scales.tobytes()).hexdigest(),
            }
        )
        self.weights[name] = q
        return q

    def describe(self) -> dict:
        """What the manifest records: the scheme and which weights it quantized."""
        return {
            "precision": self.precision,
            "bits": self.bits,
            "block_size": self.block_size,
            "symmetric": True,
            "accuracy_level": self.accuracy_level,
            "op": f"{MS_DOMAIN}.MatMulNBits",
            "quantizer": "onnxruntime.quantization.matmul_nbits_quantizer.DefaultWeightOnlyQuantizer",
            "weights": sorted(self.weights),
        }

    # ------------------------------------------------------------------ rewriting
    def rewrite(self, model) -> dict[str, int]:
        """Inline ``model``'s functions (an ``onnx_ir.Model``) and replace every linear on a 2-D
        float weight with ``MatMulNBits`` (and, at 4 bits, a gather of a quantized weight with
        ``GatherBlockQuantized``); returns the count of each rewrite."""
        import onnx_ir as ir
        from onnx_ir.passes.common import InlinePass, NameFixPass, RemoveUnusedNodesPass, RemoveUnusedOpsetsPass

        InlinePass()(model)
        NameFixPass()(model)  # bodies inlined into several Loop bodies reuse value names: one name each
        graph = model.graph
        counts = {"MatMulNBits": 0, "GatherBlockQuantized": 0}
        gathers = []
        for node in list(graph.all_nodes()):  # a looped graph's linears sit in Loop bodies
            if node.domain == "" and node.op_type == "Gather":
                gathers.append(node)
                continue
            weight = self._linear_weight(node)
            if weight is None:
                continue
            init = _source_initializer(node.inputs[1])
            array = init.const_value.numpy()
            q = self.quantize(init.name, array)
            blocks, scales = self._value(graph, q.blocks_name, q.blocks), self._value(graph, q.scales_name, q.scales)
            new = ir.node(
                "MatMulNBits",
                inputs=[node.inputs[0], blocks, scales],
                attributes={
                    "K": q.k,
                    "N": q.n,
                    "bits": self.bits,
                    "block_size": self.block_size,
                    "accuracy_level": self.accuracy_level,
                },
                domain=MS_DOMAIN,
                name=(node.name or "linear") + f"_Q{self.bits}",
            )
            _replace(node.graph, node, new)
            counts["MatMulNBits"] += 1
        if self.bits == 4:
            for node in gathers:
                counts["GatherBlockQuantized"] += self._gather(graph, node)
        RemoveUnusedNodesPass()(model)
        if counts["MatMulNBits"] or counts["GatherBlockQuantized"]:
            model.opset_imports[MS_DOMAIN] = 1
        RemoveUnusedOpsetsPass()(model)
        return counts

    def _value(self, graph, name: str, array: np.ndarray):
        """The graph's initializer ``name`` holding ``array`` (added on first use)."""
        import onnx_ir as ir

        value = graph.initializers.get(name)
        if value is None:
            value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
            value.shape = ir.Shape(array.shape)
            value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
            graph.register_initializer(value)
        return value

    def _linear_weight(self, node):
        """The ``[out, in]`` weight of a linear (``Gemm(x, W, transB=1)`` without bias, or
        ``FusedMatMul(x, W, transB=1)``), else None."""
        attrs = {k: a.value for k, a in node.attributes.items()}
        if node.domain == "" and node.op_type == "Gemm":
            if len(node.inputs) > 2 and node.inputs[2] is not None:
                return None
            if attrs.get("transA", 0) or not attrs.get("transB", 0) or attrs.get("alpha", 1.0) != 1.0:
                return None
        elif node.domain == MS_DOMAIN and node.op_type == "FusedMatMul":
            if attrs.get("transA", 0) or not attrs.get("transB", 0) or attrs.get("alpha", 1.0) != 1.0:
                return None
            if attrs.get("transBatchA", 0) or attrs.get("transBatchB", 0):
                return None
        else:
            return None
        init = _source_initializer(node.inputs[1])
        if init is None or init.const_value is None:
            return None
        array = init.const_value.numpy()
        if array.ndim != 2 or array.dtype not in (np.float32, np.float16):
            return None
        return init

    def _gather(self, graph, node) -> int:
        """``Gather(E, ids)`` on a weight that is also a quantized LM head (same bytes, the tied
        embedding) → ``GatherBlockQuantized`` over its int4 blocks; 1 if rewritten."""
        import onnx_ir as ir

        init = _source_initializer(node.inputs[0])
        attrs = {k: a.value for k, a in node.attributes.items()}
        if init is None or init.const_value is None or attrs.get("axis", 0) != 0:
            return 0
        array = init.const_value.numpy()
        if array.ndim != 2:
            return 0
        digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
        q = next((w for w in self.weights.values() if w.k % self.block_size == 0 and w.digest == digest), None)
        if q is None or q.blocks.shape[0] != array.shape[0]:
            return 0
        rows = q.blocks.reshape(q.n, -1)
        new = ir.node(
            "GatherBlockQuantized",
            inputs=[
                self._value(graph, q.gather_name, rows),
                node.inputs[1],
                self._value(graph, q.scales_name, q.scales),
            ],
            attributes={"bits": 4, "block_size": self.block_size, "gather_axis": 0, "quantize_axis": 1},
            domain=MS_DOMAIN,
            name=(node.name or "embedding") + "_Q4",
        )
        _replace(node.graph, node, new)
        return 1


def _replace(graph, node, new) -> None:
    """Put ``new`` where ``node`` is: its output takes the old output's name, shape and type and
    every use of it (graph outputs included), and ``node`` leaves the graph."""
    import onnx_ir as ir

    new.outputs[0].name = node.outputs[0].name
    new.outputs[0].shape, new.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
    graph.insert_before(node, new)
    out = node.outputs[0]
    ir.convenience.replace_all_uses_with(out, new.outputs[0])
    if out in graph.outputs:
        graph.outputs[graph.outputs.index(out)] = new.outputs[0]
    graph.remove(node, safe=True)


def _source_initializer(value):
    """The graph initializer ``value`` is (through ``Identity`` nodes), else None."""
    while value is not None:
        if value.is_initializer():
            return value
        producer = value.producer()
        if producer is None or producer.op_type != "Identity" or producer.domain != "":
            return None
        value = producer.inputs[0]
    return None
