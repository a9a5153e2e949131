"""Every op of the table (parconv.optable) on every backend against the NumPy reference.

The same entries drive ``parconv selftest`` and the docs' list of ops; here
hypothesis draws the random cases' seeds, and each table entry's fixed cases
run once per backend.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from parconv.backends.base import Backend
from parconv.backends.numpy_ref import NumpyBackend
from parconv.optable import OPS, get_op, ops_markdown_table
from parconv.selftest import Checker

REF = NumpyBackend()


def _failures(ck) -> dict:
    return {name: r.notes for name, r in ck.results.items() if not r.ok}


@pytest.mark.parametrize("spec", OPS, ids=lambda s: s.name)
def test_fixed_cases(backend, spec):
    ck = Checker(backend)
    rng = np.random.default_rng(0)
    for case in spec.fixed:
        spec.check(ck, REF, rng, case)
    assert ck.results, f"{spec.name}: the check recorded nothing"
    assert not _failures(ck)


@pytest.mark.parametrize("spec", [s for s in OPS if s.random_case is not None], ids=lambda s: s.name)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_cases(backend, spec, seed):
    ck = Checker(backend)
    rng = np.random.default_rng(seed)
    spec.check(ck, REF, rng, spec.random_case(rng))
    assert ck.results, f"{spec.name}: the check recorded nothing"
    assert not _failures(ck), f"{spec.name} seed {seed}: {_failures(ck)}"


def test_table_covers_every_op_of_the_backend_protocol():
    """A protocol method no entry checks would reach users untested on a new device."""
    plumbing = {"asarray", "to_numpy", "is_array", "empty", "zeros", "reshape", "copy", "copy_into", "synchronize"}
    helpers = {"sgd_update_many", "adam_update_many", "rmsprop_update_many", "scale_many"}
    protocol = {name for name, _ in inspect.getmembers(Backend, inspect.isfunction) if not name.startswith("_")}
    covered = {m for spec in OPS for m in spec.methods}
    missing = sorted(protocol - covered - plumbing - helpers)
    assert not missing, f"Backend methods no op-table entry checks: {missing}"


def test_names_lookup_and_docs_table():
    assert get_op("batch_norm").name == "batch_norm"
    with pytest.raises(KeyError, match="no op 'nope'"):
        get_op("nope")
    table = ops_markdown_table()
    assert all(f"`{spec.name}`" in table for spec in OPS)
    assert len(table.splitlines()) == len(OPS) + 2
