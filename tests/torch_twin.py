"""The PyTorch twin of a parconv model for the tests: bench/twins.py's, which the ``nets`` benchmark uses.

Residual blocks become a module with ``body``/``shortcut`` children, so the
twin's state-dict keys are parconv's; ``twin(model)`` copies the weights over
with ``load_state_dict(strict=True)``, which is itself the key check.
"""

from __future__ import annotations

import os
import sys

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if _BENCH not in sys.path:
    sys.path.append(_BENCH)

from twins import module, twin  # noqa: E402


def to_pc_state(torch_model) -> dict:
    """A torch model's state dict as NumPy arrays (parconv's keys)."""
    return {k: v.detach().cpu().numpy() for k, v in torch_model.state_dict().items()}


def grads(torch_model) -> dict:
    """Every parameter's gradient as a NumPy array, by parameter name."""
    return {k: p.grad.detach().numpy() for k, p in torch_model.named_parameters() if p.grad is not None}


__all__ = ["module", "twin", "to_pc_state", "grads"]
