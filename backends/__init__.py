"""Lowerers from budget paths to deployable artifacts (installed as ``looptool.backends``).

Each lowerer takes budget paths of a :class:`looptool.LoopedModel`, writes an artifact
referencing one shared weight store, and validates it against the PyTorch path:

* :mod:`looptool.backends.onnx` — ONNX engines (``export_onnx``): one graph per budget,
  fused ops as ``looptool``-domain functions (:mod:`looptool.backends.onnx_functions`),
  one ``weights.bin``, ``manifest.json``; ``torch.onnx.export`` runs under
  :mod:`looptool.backends.onnx_exporter`'s speed-ups;
* :mod:`looptool.backends.ort` — ``Runtime``: onnxruntime sessions per budget over one
  memory-mapped copy of the weights.
"""

__all__: list[str] = []
