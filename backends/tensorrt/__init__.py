"""The TensorRT backend: TensorRT variants of an ONNX engine's graphs, their engines, and
running them on a CUDA GPU.

:mod:`~looptool.backends.tensorrt.export` (``export_tensorrt``, ``build_engines``),
:mod:`~looptool.backends.tensorrt.plugins` (the ``looptool`` plugins) with their AOT Triton
kernels (:mod:`~looptool.backends.tensorrt.kernels`), :mod:`~looptool.backends.tensorrt.runtime`
(``Runtime``) and :mod:`~looptool.backends.tensorrt.engine` (the step engine, and the
``tensorrt`` runtime of :func:`looptool.engine.open_engine`).
"""
