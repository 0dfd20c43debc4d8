"""The onnxruntime backend: running ONNX engine directories.

:mod:`~looptool.backends.ort.runtime` (``Runtime``: sessions per budget over one memory-mapped
``weights.bin``, ``generate`` through the engine core), :mod:`~looptool.backends.ort.engine`
(the step engine: the one place the graphs are bound) and :mod:`~looptool.backends.ort.directory`
(the ``onnxruntime`` runtime of :func:`looptool.engine.open_engine`).
"""
