"""What an ONNX export reports: per graph (:class:`BudgetExport`) and for the engine
(:class:`ExportReport`), returned by :func:`looptool.backends.onnx.export.export_onnx`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class BudgetExport:
    """What exporting one budget's graph under one KV policy produced (``budget``
    :data:`~looptool.core.graph.ROWWISE` for the row-wise-budget graph; a verify graph, in
    :attr:`ExportReport.verify`, is under the budget it verifies; an adaptive-depth graph, in
    :attr:`ExportReport.adaptive`, under ``"adaptive.<exit rule>"``)."""

    budget: int | str
    kv: str
    file: str
    bytes: int
    seconds: float
    fused: dict[str, int]
    composed: bool = False  # built from layer functions (else traced flat)
    ort_ops: dict[str, int] = field(default_factory=dict)  # onnxruntime fused ops in the graph, by rule
    layer_calls: dict[str, int] = field(default_factory=dict)
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    form: str = "unrolled"  # "loop": the window as ONNX Loop nodes (one graph for every budget)


@dataclass
class ExportReport:
    """Summary of an engine export (sizes in bytes; ``graph_bytes`` is every file but
    weights.bin: graphs, manifest and tokenizer)."""

    directory: str
    budgets: list[BudgetExport]
    weights_bytes: int
    graph_bytes: int
    parameter_bytes: int
    seconds: float
    layer_functions: int = 0  # distinct layer bodies exported
    layer_seconds: float = 0.0  # time spent exporting them
    validation_seconds: float = 0.0
    fusions: dict[str, dict[str, int]] = field(default_factory=dict)  # onnxruntime fusions per body
    rowwise: list[BudgetExport] = field(default_factory=list)  # the row-wise graphs, one per policy
    verify: list[BudgetExport] = field(default_factory=list)  # speculative decoding's verify graphs
    adaptive: list[BudgetExport] = field(default_factory=list)  # the adaptive-depth graphs (budget="auto")

    @property
    def total_bytes(self) -> int:
        """Everything on disk: weights.bin, the graphs and the manifest."""
        return self.weights_bytes + self.graph_bytes

    @property
    def disk_ratio(self) -> float:
        """Disk bytes ÷ the model's parameter bytes (≤ 1.02 is the target)."""
        return self.total_bytes / self.parameter_bytes

    @property
    def max_abs_diff(self) -> float:
        """Worst ORT-vs-PyTorch difference over every graph and input."""
        graphs = [*self.budgets, *self.rowwise, *self.verify, *self.adaptive]
        return max((d for b in graphs for d in b.max_abs_diff.values()), default=float("nan"))

    def as_dict(self) -> dict:
        """JSON-ready summary."""
        out = asdict(self)
        out.update(total_bytes=self.total_bytes, disk_ratio=self.disk_ratio, max_abs_diff=self.max_abs_diff)
        return out
