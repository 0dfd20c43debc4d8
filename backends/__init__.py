"""Lowerers from budget paths to deployable artifacts (installed as ``looptool.backends``).

ONNX, onnxruntime and TensorRT lowerers land here; each takes one budget path of a
:class:`looptool.LoopedModel`, writes an artifact referencing one shared weight store, and
validates it against the PyTorch path.
"""

__all__: list[str] = []
