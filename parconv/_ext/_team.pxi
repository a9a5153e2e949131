# Included by every kernel module: the cap on its parallel regions' teams (pc_common.h's pc_cap),
# which parconv._config sets on each chosen module while other processes keep cores busy.


def _set_team_limit(int n):
    """Start at most ``n`` threads in this module's parallel regions (0: no cap).

    The work split, and so every result, still follows the thread count each call is given."""
    pc_set_team_limit(n)


def _get_team_limit():
    """The cap :func:`_set_team_limit` set (0: none)."""
    return pc_get_team_limit()
