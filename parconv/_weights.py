"""A count of the parameter and buffer changes parconv itself makes.

Caches derived from the weights (the eval-mode BatchNorm folds of
``parconv._fusion``) remember the count they were built at and rebuild when it
moved. It moves on every write parconv makes: assigning ``Parameter.data``,
``load_state_dict`` (and what loads through it), an optimizer step, a mode
change (``train()``/``eval()``) and ``Backend.copy_into`` (the trainer's
restore of the last finite weights, the distributed broadcasts). Writing into
a parameter's array in place from outside parconv does not move it: call
:func:`weights_changed` (``parconv.weights_changed``) or ``model.eval()``
again afterwards.
"""

from __future__ import annotations

__all__ = ["weights_changed", "weights_epoch"]

_EPOCH = [0]


def weights_changed() -> None:
    """Tell parconv that parameters or buffers changed outside its own setters (for example written in
    place through ``param.data[...] = ...``), so that caches derived from them are rebuilt."""
    _EPOCH[0] += 1


def weights_epoch() -> int:
    """The count :func:`weights_changed` moves."""
    return _EPOCH[0]
