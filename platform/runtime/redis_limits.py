"""The embedded Valkey of `kc up`, sized for the cluster YAML
(platform/jobs/redis_sizing.py): its config lines, and the open-file limit
it starts under.

Valkey needs maxclients + 32 file descriptors. It raises its own soft limit up
to the hard one, and where the hard limit is too low it lowers maxclients and
says so only in its log. `kc up` raises the soft limit before Valkey starts and,
where the hard limit stops it, says so on its own output, with the fix.
"""

from __future__ import annotations

import resource
from collections.abc import Callable

from kuangchao.platform.jobs.redis_sizing import REDIS_RESERVED_FDS, RedisSizing


def config_text(sizing: RedisSizing) -> str:
    """The lines for valkey.conf (noeviction: a write past maxmemory fails with OOM,
    which its writer sees, instead of evicting job records)."""
    return "".join(f"{line}\n" for line in sizing.config_lines())


def nofile_target(want: int, limits: tuple[int, int] | None = None) -> tuple[int, int]:
    """The (soft, hard) RLIMIT_NOFILE to start Valkey under: the soft limit raised to
    `want`, but never past the hard limit, which only root may raise."""
    soft, hard = limits if limits is not None else resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = want if hard == resource.RLIM_INFINITY else min(want, hard)
    return max(soft, cap) if soft != resource.RLIM_INFINITY else soft, hard


def raise_nofile(want: int) -> Callable[[], None]:
    """A `preexec_fn` that raises the child's soft open-file limit towards `want`."""
    def preexec() -> None:
        soft, hard = nofile_target(want)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        except (ValueError, OSError):
            pass  # Valkey then lowers maxclients itself; `shortfall` already said so
    return preexec


def shortfall(sizing: RedisSizing, limits: tuple[int, int] | None = None) -> str | None:
    """What to tell the operator when the hard open-file limit leaves Valkey fewer
    clients than the cluster needs (`sizing.needed`); None when it is enough. Short
    of `sizing.nofile` but above that, Valkey trims maxclients from Redis's default
    of 10,000 to what it can hold, which costs this cluster nothing."""
    _, hard = limits if limits is not None else resource.getrlimit(resource.RLIMIT_NOFILE)
    kept = max(hard - REDIS_RESERVED_FDS, 0)
    if hard == resource.RLIM_INFINITY or kept >= sizing.needed:
        return None
    return (f"the open-file hard limit here is {hard}, below the {sizing.nofile} Valkey needs "
            f"for maxclients {sizing.maxclients}: it will accept about {kept} clients, and "
            f"{sizing.size.slots} rank slots need {sizing.needed}. Raise the hard limit "
            f"(`ulimit -Hn {sizing.nofile}` as root, `nofile` in /etc/security/limits.conf, "
            f"or LimitNOFILE= for a systemd service) and run `kc down && kc up` again")
