"""Graph passes (installed as ``looptool.passes``).

A pass is a pure function ``(LayerGraph, config: dict) -> LayerGraph`` registered by name.
:class:`PassManager` runs a list of ``(name, config)`` steps, verifies the graph and the
role annotations after each one (naming the pass that broke them), and records the steps
in ``LayerGraph.recipe`` so a saved model can replay them on load. Ordering between passes
is declared where each pass is registered (``requires``, ``before``, ``after``) and checked
by the manager against its steps and the passes already applied (``LayerGraph.applied``).
"""

from looptool.passes import ablate as _ablate  # noqa: F401  (registers)
from looptool.passes import adaptive_depth as _adaptive_depth  # noqa: F401  (registers)
from looptool.passes import checkpoint as _checkpoint  # noqa: F401  (registers)
from looptool.passes import decode_interface as _decode_interface  # noqa: F401  (registers)
from looptool.passes import exit_gate as _exit_gate  # noqa: F401  (registers)
from looptool.passes import fuse as _fuse  # noqa: F401  (registers)
from looptool.passes import grouped_attention as _grouped_attention  # noqa: F401  (registers)
from looptool.passes import kv_cache as _kv_cache  # noqa: F401  (registers)
from looptool.passes import last_position as _last_position  # noqa: F401  (registers)
from looptool.passes import prefix_loop as _prefix_loop  # noqa: F401  (registers)
from looptool.passes import recurrent_loop as _recurrent_loop  # noqa: F401  (registers)
from looptool.passes import retarget_device as _retarget_device  # noqa: F401  (registers)
from looptool.passes import router_outputs as _router_outputs  # noqa: F401  (registers)
from looptool.passes import rowwise_budget as _rowwise_budget  # noqa: F401  (registers)
from looptool.passes import skip_exited as _skip_exited  # noqa: F401  (registers)
from looptool.passes import unflatten_crossings as _unflatten_crossings  # noqa: F401  (registers)
from looptool.passes.manager import (
    PassManager,
    check_order,
    get_pass,
    must_precede,
    register_pass,
    registered_passes,
    unregister_pass,
)

__all__ = [
    "PassManager",
    "check_order",
    "get_pass",
    "must_precede",
    "register_pass",
    "registered_passes",
    "unregister_pass",
]
