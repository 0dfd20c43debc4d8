"""Lowerers from budget paths to deployable artifacts (installed as ``looptool.backends``).

Each lowerer takes budget paths of a :class:`looptool.LoopedModel`, writes an engine
directory referencing one shared weight store, and validates it against the PyTorch path.
One subpackage per backend, and the modules they share at the top:

* :mod:`looptool.backends.onnx` — ONNX engines (:func:`looptool.backends.onnx.export.export_onnx`):
  one graph per budget, fused ops as ``looptool``-domain functions, one ``weights.bin``;
* :mod:`looptool.backends.ort` — onnxruntime: the ``Runtime`` (sessions per budget over one
  memory-mapped copy of the weights), its IOBinding and its step engine;
* :mod:`looptool.backends.tensorrt` — TensorRT: the graph variants and engine builds, the
  plugins and their AOT kernels, the ``Runtime`` and its step engine;
* shared: :mod:`~looptool.backends.interface` (the backend-neutral decode interface),
  :mod:`~looptool.backends.manifest` (an engine directory's ``manifest.json``, typed),
  :mod:`~looptool.backends.errors` and :mod:`~looptool.backends.engines` (export and open
  by backend name).

A backend subpackage imports another's public names only; what two backends share lives here.
"""

__all__: list[str] = []
