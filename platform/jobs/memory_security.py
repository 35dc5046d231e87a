"""The in-memory store's credentials, debug requests, heartbeats and fences
(memory.py has the rest), as credentials.py, debug_requests.py, beats.py and
fences.py keep them in Redis. Pure. There is no access control here: a job's "Redis user" is only a
name and a password kept for the authority to hand out."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from kuangchao.platform.jobs.debugreq import ANSWER_TTL_S, DebugRequest, new_request, parse_answers
from kuangchao.platform.jobs.encoding import AUDIT_CAP
from kuangchao.platform.jobs.memory_more import Expiring
from kuangchao.platform.protocol.heartbeat import Beat
from kuangchao.platform.protocol.node_beat import NodeRecord, decode_node_record


class MemorySecurity:
    """Mixed into `MemoryStore`; shares its lock."""

    _lock: threading.RLock

    def __init__(self) -> None:
        self._api_keys: dict[str, str] = {}
        self._revoked = Expiring()  # token id -> reason
        self._issued: dict[str, dict[str, float]] = {}
        self._holding: set[str] = set()
        self._passwords: dict[str, str] = {}
        self._users: set[str] = set()  # jobs whose user "Redis" has now
        self._audit: list[tuple[int, str]] = []  # (ms written, record), oldest first
        self._debug_asks = Expiring()  # job -> request JSON
        self._debug_replies = Expiring()  # (job, request id) -> {rank: answer JSON}
        self._beats = Expiring()  # (job, rank) -> encoded beat
        self._fenced: dict[str, set[str]] = {}  # job -> fenced processes (pid@node)
        self._control: str | None = None

    # -- API keys -------------------------------------------------------------------
    def api_key(self, key_id: str) -> str | None:
        with self._lock:
            return self._api_keys.get(key_id)

    def put_api_key(self, key_id: str, record: str) -> None:
        with self._lock:
            self._api_keys[key_id] = record

    def api_key_records(self) -> list[str]:
        with self._lock:
            return list(self._api_keys.values())

    # -- tokens -----------------------------------------------------------------------
    def revoke_token(self, token_id: str, reason: str, ttl_s: int) -> None:
        self._revoked.put(token_id, reason, ttl_s)

    def token_revoked(self, token_id: str) -> bool:
        return self._revoked.get(token_id) is not None

    def record_token(self, job_id: str, token_id: str, expires_at: float) -> None:
        with self._lock:
            self._issued.setdefault(job_id, {})[token_id] = float(str(expires_at))

    def issued_tokens(self, job_id: str) -> dict[str, float]:
        with self._lock:
            return dict(self._issued.get(job_id, {}))

    def forget_tokens(self, job_id: str) -> None:
        self._issued.pop(job_id, None)  # one dict operation: atomic under the GIL

    def mark_job_revoked(self, job_id: str, reason: str, ttl_s: int) -> None:
        self._revoked.put(("job", job_id), reason, ttl_s)

    def job_revoked(self, job_id: str) -> bool:
        return self._revoked.get(("job", job_id)) is not None

    def control_secret(self) -> str | None:
        with self._lock:
            return self._control

    def offer_control_secret(self, secret: str) -> str:
        with self._lock:
            self._control = self._control or secret
            return self._control

    def hold_credentials(self, job_id: str) -> None:
        with self._lock:
            self._holding.add(job_id)

    def release_credentials(self, job_id: str) -> None:
        self._holding.discard(job_id)  # one set operation: atomic under the GIL

    def credential_jobs(self) -> set[str]:
        return set(self._holding)

    # -- job users ----------------------------------------------------------------------
    def job_user_password(self, job_id: str) -> str | None:
        with self._lock:
            return self._passwords.get(job_id)

    def grant_job_user(self, job_id: str, password: str | None = None) -> str:
        import secrets

        with self._lock:
            self._passwords[job_id] = password = password or secrets.token_urlsafe(32)
            self._users.add(job_id)
        return password

    def has_job_user(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._users

    def revoke_job_user(self, job_id: str) -> None:
        with self._lock:
            self._users.discard(job_id)

    def forget_job_user(self, job_id: str) -> None:
        with self._lock:
            self._passwords.pop(job_id, None)

    # -- audit ------------------------------------------------------------------------
    def append_audit(self, line: str) -> None:
        with self._lock:
            self._audit.append((int(time.time() * 1000), line))
            del self._audit[:-AUDIT_CAP]

    def audit_lines(self, since: float | None = None) -> Iterator[str]:
        start = int(since * 1000) if since is not None else -1
        with self._lock:
            kept = [line for ms, line in self._audit if ms >= start]
        return reversed(kept)

    # -- debug requests -----------------------------------------------------------
    def post_debug(self, job_id: str, kind: str, step: int | None = None,
                   steps: int = 1) -> DebugRequest:
        req = new_request(kind, step, steps)
        self._debug_asks.put(job_id, req.to_json(), ANSWER_TTL_S)
        return req

    def debug_request(self, job_id: str) -> DebugRequest | None:
        return DebugRequest.from_json(self._debug_asks.get(job_id))

    def retire_debug(self, job_id: str, request_id: str) -> None:
        with self._lock:
            current = self.debug_request(job_id)
            if current is not None and current.id == request_id:
                self._debug_asks.pop(job_id)

    def answer_debug(self, job_id: str, request_id: str, rank: int, body: dict[str, Any]) -> None:
        with self._lock:  # the answers' TTL starts again with each one, as the hash's does
            answers = dict(self._debug_replies.get((job_id, request_id)) or {})
            answers[str(rank)] = json.dumps(body, default=str)
            self._debug_replies.put((job_id, request_id), answers, ANSWER_TTL_S)

    def debug_answers(self, job_id: str, request_id: str) -> dict[int, dict]:
        return parse_answers(dict(self._debug_replies.get((job_id, request_id)) or {}))

    # -- heartbeats -------------------------------------------------------------------
    def put_beat(self, job_id: str, rank: int, text: str, ttl_s: float) -> None:
        self._beats.put((job_id, rank), text, ttl_s)

    def drop_beat(self, job_id: str, rank: int) -> None:
        self._beats.pop((job_id, rank))

    def beats(self, job_id: str, ranks: Iterable[int],
              cache: dict[int, tuple[str, Beat | None]] | None = None) -> dict[int, Beat | None]:
        """Each rank's current beat; the cache (a read-time saving in Redis) is not needed here."""
        found = {rank: self._beats.get((job_id, rank)) for rank in ranks}
        return {rank: Beat.decode(rank, raw) if raw is not None else None
                for rank, raw in found.items()}

    def put_node_record(self, job_id: str, node: str, record: bytes, ttl_s: float) -> None:
        self._beats.put((job_id, f"node:{node}"), record, ttl_s)

    def relayed_raw(self, job_id: str, nodes: list[str], ranks: list[int], rank_cache: dict
                    ) -> tuple[list[bytes | None], dict[int, Beat | None]]:
        """The node agents' records as stored and the named ranks' own beats."""
        return ([self._beats.get((job_id, f"node:{n}")) for n in nodes],
                self.beats(job_id, ranks))

    def relayed_beats(self, job_id: str, nodes: list[str], ranks: list[int]
                      ) -> tuple[dict[str, NodeRecord | None], dict[int, Beat | None]]:
        """The node agents' records, decoded, and the named ranks' own beats."""
        raws, direct = self.relayed_raw(job_id, nodes, ranks, {})
        return ({n: decode_node_record(v) if v is not None else None
                 for n, v in zip(nodes, raws, strict=True)}, direct)

    # -- fences (Redis gives the set a TTL; this store lives as long as its process) --
    def fence(self, job_id: str, members: Iterable[str]) -> None:
        with self._lock:
            self._fenced.setdefault(job_id, set()).update(members)

    def fenced(self, job_id: str) -> set[str]:
        with self._lock:
            return set(self._fenced.get(job_id, ()))
