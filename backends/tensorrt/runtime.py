"""Running TensorRT engines built by :mod:`looptool.backends.tensorrt.export`: one upload of
``weights.bin`` to the GPU, its device pointers bound into every budget's execution context,
and the shared decode loop on top (like the onnxruntime :class:`looptool.backends.ort.runtime.Runtime`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from looptool.backends.errors import EngineError
from looptool.backends.manifest import MANIFEST, WEIGHTS, BuiltOn, Manifest, TensorEntry, check_request
from looptool.backends.tensorrt.engine import TrtStepEngine
from looptool.backends.tensorrt.export import BUILD_SCRIPT, require_tensorrt
from looptool.core.dtypes import named
from looptool.core.graph import ROWWISE
from looptool.engine.sampling import GREEDY, SamplingParams

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- runtime
def check_built_for(built: BuiltOn, capability: tuple[int, int], gpu: str, directory: Path) -> None:
    """Engines run only on the GPU architecture they were built for: one sentence otherwise."""
    here = list(capability)
    if list(built.compute_capability) != here:
        raise EngineError(
            f"these engines were built for {built.gpu} (sm_{''.join(map(str, built.compute_capability))}), "
            f"this GPU is {gpu} (sm_{''.join(map(str, here))}); rebuild them here with "
            f"python {directory / BUILD_SCRIPT}."
        )


class Runtime:
    """Run TensorRT engines: ``rt.generate(input_ids, budget=k, kv=...)`` like the
    onnxruntime :class:`looptool.backends.ort.runtime.Runtime`.

    ``weights.bin`` is uploaded once into one device buffer; each weight is a view at its
    manifest offset and the same pointer is bound into every budget's execution context.
    The contexts use one shared activation buffer (user-managed device memory, sized for
    the largest engine): budgets run one at a time on one stream."""

    def __init__(self, engine_dir: str | os.PathLike, *, device: str = "cuda", verify: bool = True):
        self.directory = Path(engine_dir)
        self.manifest = Manifest.read(self.directory)
        section = self.manifest.tensorrt
        if section is None or not section.engines or section.built_on is None:
            raise EngineError(
                f"'{self.directory}' has no TensorRT engines; run python {self.directory / BUILD_SCRIPT} on this machine."
            )
        weights = self.directory / WEIGHTS
        if self.manifest.verify(self.directory, sha256=verify) is not None:
            raise EngineError(
                f"{weights} does not match the manifest (missing, resized or modified); export the engine again."
            )
        if not torch.cuda.is_available():
            raise EngineError("TensorRT engines need an NVIDIA GPU, and torch sees none here.")
        self.device = torch.device(device)
        built = section.built_on
        check_built_for(
            built,
            torch.cuda.get_device_capability(self.device),
            torch.cuda.get_device_name(self.device),
            self.directory,
        )
        trt = require_tensorrt("running TensorRT engines")
        self.budgets = tuple(sorted(b for b in section.engines if b != ROWWISE))  # the row-wise engine: no budget
        self.kv_policies = tuple(sorted({p for ps in section.engines.values() for p in ps}))
        self.vocab_size = self.manifest.vocab_size
        self.mask_dtype = named(self.manifest.mask_dtype).torch
        self.store = torch.from_numpy(np.fromfile(weights, dtype=np.uint8)).to(self.device)  # one upload
        self._weights = {name: self._view(t) for name, t in self.manifest.weights.tensors.items()}
        self._logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(self._logger)
        self.engines, self.contexts = {}, {}
        for budget, policies in section.engines.items():
            for policy, info in policies.items():
                path = self.directory / info.file
                if verify and self.manifest.verify(self.directory, info) is not None:
                    raise EngineError(f"{path} does not match the sha256 in {MANIFEST}; rebuild the engines.")
                engine = runtime.deserialize_cuda_engine(path.read_bytes())
                if engine is None:
                    raise EngineError(
                        f"TensorRT could not load {path} (built with TensorRT {built.tensorrt}); rebuild it here."
                    )
                self.engines[budget, policy] = engine
        self.activation_bytes = max(e.device_memory_size_v2 for e in self.engines.values())
        self._activations = torch.empty(self.activation_bytes, dtype=torch.uint8, device=self.device)
        for key, engine in self.engines.items():
            ctx = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            ctx.set_device_memory(self._activations.data_ptr(), self.activation_bytes)
            for name in section.graphs[key[0]][key[1]].weight_inputs:
                ctx.set_tensor_address(name, self._weights[name].data_ptr())
            self.contexts[key] = ctx
        self.stream = torch.cuda.Stream(self.device)
        self._engines: dict[str, TrtStepEngine] = {}  # step_engine()'s, per KV policy

    def _view(self, entry: TensorEntry) -> torch.Tensor:
        dtype = named(entry.dtype).torch
        return self.store[entry.offset : entry.offset + entry.length].view(dtype).view(entry.shape)

    def device_bytes(self) -> dict[str, int]:
        """Device memory the runtime holds: the weights (once) and the shared activations."""
        return {"weights": self.store.numel(), "activations": self.activation_bytes}

    def generate(
        self,
        input_ids,
        *,
        budget: int | None = None,
        max_new_tokens: int = 32,
        kv: str = "per-loop",
        attention_mask=None,
        capacity: int | None = None,
        sampling: SamplingParams = GREEDY,
        **options,
    ):
        """Cached generation, as :meth:`looptool.backends.ort.runtime.Runtime.generate` (the same
        request checks and decode loop; ``options``: ``eos_token_id``, ``pad_token_id``,
        ``on_step``, ``output_logits``)."""
        from looptool.engine.offline import generate_batch

        budget = self.budgets[-1] if budget is None else budget
        if (budget, kv) not in self.contexts:
            raise EngineError(f"no engine for budget {budget} ({kv}); this directory has {sorted(self.contexts)}.")
        ids, mask, capacity = check_request(self.manifest, input_ids, attention_mask, max_new_tokens, capacity)
        engine = self.step_engine(kv)
        return generate_batch(
            engine,
            ids,
            mask,
            [budget] * ids.shape[0],
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            capacity=capacity,
            device=self.device,
            **options,
        )

    def step_engine(self, kv: str = "per-loop") -> TrtStepEngine:
        """The step engine over these engines for ``kv``, made once: what :meth:`generate` and a
        server drive."""
        if kv not in self._engines:
            self._engines[kv] = TrtStepEngine(self, kv=kv)
        return self._engines[kv]
