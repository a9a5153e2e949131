"""The compiled OpenMP kernels.

Importing this package sets the OpenMP wait policy before the first kernel
module loads libgomp, which reads ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT``
once, when it is loaded. Left alone, libgomp's idle threads spin for a while
after every parallel region; on a machine whose cores are shared (CI
runners, notebooks on shared servers, co-tenants) those spinning threads take
the time the working ones need, so parconv asks for passive waiting unless
the user chose a policy. See docs/performance-internals.md.
"""

import os as _os

#: how the OpenMP wait policy was decided (``parconv info`` prints it)
WAIT_POLICY = {"policy": "", "source": ""}


def _gomp_loaded() -> bool:
    """Whether some libgomp is already mapped (then its wait policy is settled)."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:
        return False


def _choose_wait_policy() -> None:
    user = {k: _os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in _os.environ}
    if user:
        WAIT_POLICY["policy"] = ", ".join(f"{k}={v}" for k, v in user.items())
        WAIT_POLICY["source"] = "set by the user"
        return
    if _gomp_loaded():
        # torch (or another library) loaded the shared libgomp first: its default stands
        WAIT_POLICY["policy"] = "OpenMP runtime default (threads spin after each region)"
        WAIT_POLICY["source"] = ("libgomp was loaded before parconv (by torch?); import parconv first or set "
                                 "OMP_WAIT_POLICY=PASSIVE in the environment")
        return
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        from . import _threads  # noqa: F401  loads libgomp, which reads the policy now
    except ImportError:
        pass
    finally:
        # only this process's runtime: child processes and other programs keep their own default
        del _os.environ["OMP_WAIT_POLICY"]
    WAIT_POLICY["policy"] = "PASSIVE"
    WAIT_POLICY["source"] = "parconv's default; OMP_WAIT_POLICY=ACTIVE makes idle threads spin"


_choose_wait_policy()
