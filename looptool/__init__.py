"""looptool: loop existing pretrained decoders for elastic-depth inference.

Python API::

    model = looptool.convert(hf_model, looptool.PrefixLoop(window=(6, 18), budgets=(0, 3, 6, 9, 12)))
    out = model(input_ids, budget=6)          # .logits, .loss with labels=
    model.save_pretrained("looped"); model = looptool.load("looped")
    fp16 = looptool.cast(model, torch.float16)   # or looptool.load("looped", dtype=torch.float16)
    engine = looptool.open_engine("looped")      # or an exported engine directory
    out = engine.generate(ids, budget=[0, 12], max_new_tokens=32)   # the core looptool serve runs

Beneath it, the pass API: :func:`looptool.capture.capture` a model into a
:class:`~looptool.core.graph.LayerGraph`, run named passes with
:class:`looptool.passes.PassManager`, inspect node roles, build a :class:`LoopedModel`.
"""

from looptool.capture import capture
from looptool.core.errors import LooptoolError
from looptool.core.graph import LayerGraph
from looptool.core.plan import PrefixLoop, RecurrentLoop
from looptool.core.version import __version__
from looptool.engine import open_engine
from looptool.runtime.convert import cast, convert, load
from looptool.runtime.model import LoopedModel

__all__ = [
    "LayerGraph",
    "LoopedModel",
    "LooptoolError",
    "PrefixLoop",
    "RecurrentLoop",
    "capture",
    "cast",
    "convert",
    "load",
    "open_engine",
    "__version__",
]
