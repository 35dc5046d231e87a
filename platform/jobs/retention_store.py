"""Forgetting a finished job: its record, its place in the index and every key it left.

The scheduler's retention sweep (platform/scheduling/retention.py) decides which
jobs are old enough; this deletes one, in one script, so that the check and the
deletion cannot be split by a writer: a job that is not finished, or finished
at or after the cutoff, is left whole. A job's own keys are named here one by
one (keys.py), not found with SCAN: a SCAN walks the whole keyspace, once per
job. The keys this list leaves out all expire on their own (heartbeats, stack
dumps, debug answers, report answers, link probes).
"""

from __future__ import annotations

import json
from typing import Any

import redis

from kuangchao.platform.jobs import keys
from kuangchao.platform.jobs.encoding import KEPT, PURGED, STALE, is_job_id

# KEYS: record, jobs index, active set, then every other key of the job.
# ARGV: job id, cutoff (finished before it), the terminal states.
# Returns 1 (purged), 0 (kept: not finished, or not long enough ago), 2 (no
# record: a stale index entry and any keys left, removed).
PURGE_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local rec = cjson.decode(cur)
  local done = false
  for i = 3, #ARGV do
    if rec['state'] == ARGV[i] then done = true end
  end
  local fin = rec['finished_at']
  if not done or type(fin) ~= 'number' or fin >= tonumber(ARGV[2]) then return 0 end
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('UNLINK', KEYS[1], unpack(KEYS, 4))
if cur then return 1 end
return 2
"""

# A job's keys that do not expire on their own.
OWN_KEYS = (keys.events, keys.logs, keys.progress, keys.curve, keys.job_metrics,
            keys.checkpoints, keys.cancel, keys.preempt, keys.resize, keys.generation,
            keys.rejoin, keys.samples, keys.controller, keys.reports, keys.targets,
            keys.debug_request, keys.fenced, keys.issued, keys.job_user_secret)
_OUTCOME = {0: KEPT, 1: PURGED, 2: STALE}


class Retention:
    """The retention part of `JobStore`."""

    r: redis.Redis
    p: str
    _purge: Any  # PURGE_SCRIPT, registered by JobStore

    def purge_finished(self, job_id: str, finished_before: float,
                       terminal: tuple[str, ...]) -> str:
        """Delete the job if it finished (a state in `terminal`) before `finished_before`.

        Returns `purged`, `kept` (not finished, or finished too recently: nothing
        deleted) or `stale` (the index named a job with no record; the entry and
        whatever keys were left are gone)."""
        if not is_job_id(job_id):
            return KEPT
        names = [keys.job(self.p, job_id), keys.jobs(self.p), keys.active(self.p),
                 *(key(self.p, job_id) for key in OWN_KEYS)]
        out: Any = self._purge(names, [job_id, json.dumps(finished_before), *terminal])
        return _OUTCOME[int(out)]
