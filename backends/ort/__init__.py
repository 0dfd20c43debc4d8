"""The onnxruntime backend: running ONNX engine directories.

:mod:`~looptool.backends.ort.runtime` (``Runtime``: sessions per budget over one memory-mapped
``weights.bin``, ``generate``), :mod:`~looptool.backends.ort.binding` (one generate call's
IOBinding) and :mod:`~looptool.backends.ort.engine` (the step engine a server drives, and the
``onnxruntime`` runtime of :func:`looptool.engine.open_engine`).
"""
