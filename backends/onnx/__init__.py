"""The ONNX backend: engine directories of ONNX serving graphs over one ``weights.bin``.

:mod:`~looptool.backends.onnx.export` runs an export (``export_onnx``); beside it, one job
per module: graph file names and the manifest of an export (:mod:`~looptool.backends.onnx.format`),
the weight store (:mod:`~looptool.backends.onnx.store`), the ``looptool``-domain functions
(:mod:`~looptool.backends.onnx.functions`), composing graphs from layer functions
(:mod:`~looptool.backends.onnx.layers`, whose bodies :mod:`~looptool.backends.onnx.body_cache`
keeps), optimisation (:mod:`~looptool.backends.onnx.optimize`), outlining of fused ops
(:mod:`~looptool.backends.onnx.outline`) and validation with onnxruntime
(:mod:`~looptool.backends.onnx.validate`).
"""
