"""Forward passes, every gradient and three SGD steps pinned bit for bit (see golden_cases.py).

The pinned values hold for the machine they were made on (kernel ISA, CPU
model, NumPy version): there the check is exact. Elsewhere the same cases are
held to a tight relative tolerance, since another CPU's BLAS or vector width
may round differently.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import parconv as pc

from golden_cases import CONFIGS, cases, fingerprint, golden_path

if not os.path.exists(golden_path()):
    pytest.skip(f"no pinned values for this build ({golden_path()})", allow_module_level=True)

GOLDEN = np.load(golden_path())
EXACT = str(GOLDEN["__fingerprint__"]) == fingerprint()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("name", sorted(cases()))
def test_golden(name, config):
    if config[0] not in pc.available_backends():
        pytest.skip(f"backend {config[0]} unavailable")
    backend, threads = config
    with pc.num_threads(threads):
        got = cases()[name](backend)
    prefix = f"{name}/{backend}-{threads}/"
    expected = {k[len(prefix):]: GOLDEN[k] for k in GOLDEN.files if k.startswith(prefix)}
    assert sorted(got) == sorted(expected)
    for key, value in got.items():
        if EXACT:
            np.testing.assert_array_equal(np.asarray(value), expected[key], err_msg=f"{prefix}{key}")
        else:
            np.testing.assert_allclose(np.asarray(value), expected[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{prefix}{key}")
