# Included by every kernel module: the size of its parallel regions' teams (pc_common.h's pc_cap):
# the cap parconv._config sets while other processes keep cores busy, and the measured cost of
# starting a region, which keeps calls too small to pay for it on fewer threads.


def _set_team_limit(int n):
    """Start at most ``n`` threads in this module's parallel regions (0: no cap).

    The work split, and so every result, still follows the thread count each call is given."""
    pc_set_team_limit(n)


def _get_team_limit():
    """The cap :func:`_set_team_limit` set (0: none)."""
    return pc_get_team_limit()


def _set_region_ns(double ns):
    """Tell this module what starting a parallel region costs here (ns; 0: unknown, full teams).

    A call then starts a thread for each ``PC_REGION_PAYBACK`` region starts of its estimated
    one-thread work (at least one); the split, and so every result, still follows its thread count."""
    if not 0 <= ns < float("inf"):
        raise ValueError(f"ns must be a finite number >= 0, got {ns!r}")
    pc_set_region_ns(ns)


def _get_region_ns():
    """The region cost :func:`_set_region_ns` set (0: none)."""
    return pc_get_region_ns()


def _team_for(Py_ssize_t n, double work_ns):
    """The team a region asking for ``n`` threads starts in a call of ``work_ns`` estimated ns (tests)."""
    pc_work(work_ns)
    try:
        return pc_cap(n)
    finally:
        pc_work(0)
