"""The Python SDK: a typed client for the kuangchao REST API (docs/sdk.md)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kuangchao.api.sdk.errors import ApiError
from kuangchao.api.sdk.types import EventPage, Job, LogPage, MetricsPage

__all__ = ["ApiError", "Client", "Job", "load_file"]

# The most jobs the server sends in one page (`GET /v1/jobs?limit=`).
LIST_PAGE_MAX = 10_000


def load_file(path: Path, sets: list[str]) -> dict[str, Any]:
    """A job YAML as the server should get it: `extends:` and `sets` applied, and
    a relative `data.path` made absolute from here. Raises `SpecError`."""
    from kuangchao.platform.spec.jobspec import load_spec_document

    doc = load_spec_document(path, sets)
    data = doc.get("data")
    if isinstance(data, dict) and isinstance(data.get("path"), str) and data["path"]:
        data["path"] = str(Path(data["path"]).expanduser().absolute())
    return doc


class Client:
    """The kuangchao REST API from Python; `kc` uses it too.

    ```python
    from kuangchao.api.sdk.client import Client
    c = Client("http://127.0.0.1:8000", key)       # or Client.from_env()
    job = c.submit("examples/tiny-gpt.yaml", wait=True)
    print(job.state, job.progress.loss)
    ```

    Every method raises `ApiError` when the API refuses (`status` 4xx, with
    `detail` naming the field or setting to change) or cannot be reached
    (`status` 0). Results are typed views of the JSON (`sdk/types.py`).
    """

    def __init__(self, url: str, key: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.base_url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)

    @classmethod
    def from_env(cls) -> Client:
        """The API and key `kc` would use: KC_API_URL and KC_API_KEY, else what
        `kc up` recorded and the credentials file."""
        from kuangchao.platform.settings import Settings

        s = Settings.from_env()
        return cls(s.api_url, s.api_key)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _call(self, method: str, path: str, raw: bool = False, **kw: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach the kuangchao API at {self.base_url} ({exc}); "
                              "start it with `kc up`, or set KC_API_URL") from None
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            raise ApiError(resp.status_code, detail)
        return resp.content if raw else resp.json()

    # -- jobs ------------------------------------------------------------------
    def submit(self, spec: dict[str, Any] | str | os.PathLike, wait: bool = False,
               sets: list[str] | None = None, timeout: float | None = None,
               on_update: Callable[[Job], None] | None = None) -> Job:
        """Submit a job and return it (QUEUED), or with `wait`, follow it to its end.

        Args:
            spec: The spec as a dict, or the path of a job YAML. A file's
                `extends:` chain and `sets` ("training.steps=100") are applied
                here, and a relative `data.path` is taken from where you run.
            wait: Poll until the job ends (see `wait`); check `job.state`.
            timeout, on_update: As for `wait`.

        Raises:
            ApiError: 422 with one `{field, msg}` per problem for a bad spec.
            SpecError: (`kuangchao.platform.errors`) a file that is missing, not
                YAML, or whose `extends:` chain is broken.
        """
        doc = spec if isinstance(spec, dict) else load_file(Path(spec), sets or [])
        job = Job(self._call("POST", "/v1/jobs", json=doc))
        return self.wait(job.id, timeout=timeout, on_update=on_update) if wait else job

    def submit_yaml(self, text: str) -> Job:
        """Submit a job YAML as text; the server parses it (no `extends:`)."""
        return Job(self._call("POST", "/v1/jobs", content=text,
                              headers={"Content-Type": "application/yaml"}))

    def validate(self, spec: dict[str, Any] | str) -> dict[str, Any]:
        """Check a spec (a dict, or YAML text) without submitting it: `{valid, spec,
        plan}`, with the planner's layout for `parallel: auto`. Raises `ApiError` (422)."""
        if isinstance(spec, dict):
            return self._call("POST", "/v1/jobs", params={"dry_run": "true"}, json=spec)
        return self._call("POST", "/v1/jobs", params={"dry_run": "true"}, content=spec,
                          headers={"Content-Type": "application/yaml"})

    def get(self, job_id: str) -> Job:
        return Job(self._call("GET", f"/v1/jobs/{job_id}"))

    def list(self, state: str | None = None, queue: str | None = None,
             limit: int = 200) -> list[Job]:
        """The newest `limit` jobs your key's tenant may see, oldest first; filtered
        here by state/queue. Pages are followed by their `next_cursor`."""
        pages: list[list[dict[str, Any]]] = []
        cursor, count = None, 0
        while count < limit:
            params: dict[str, Any] = {"limit": min(limit - count, LIST_PAGE_MAX)}
            if cursor:
                params["cursor"] = cursor
            doc = self._call("GET", "/v1/jobs", params=params)
            pages.append(doc["jobs"])
            count += len(doc["jobs"])
            cursor = doc.get("next_cursor")
            if not cursor:
                break
        jobs = [Job(j) for page in reversed(pages) for j in page]  # each page back in time
        return [j for j in jobs if (state is None or j.state == state)
                and (queue is None or j.queue == queue)]

    def wait(self, job_id: str, timeout: float | None = None, poll_s: float = 1.0,
             on_update: Callable[[Job], None] | None = None) -> Job:
        """Poll until the job is SUCCEEDED, FAILED or CANCELLED, and return it.

        `on_update(job)` sees every poll (for a progress bar). Raises `TimeoutError`
        after `timeout` seconds; the job goes on running.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if on_update is not None:
                on_update(job)
            if job.is_terminal:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job.state} after {timeout}s")
            time.sleep(poll_s)

    def cancel(self, job_id: str) -> Job:
        return Job(self._call("POST", f"/v1/jobs/{job_id}/cancel"))

    def scale(self, job_id: str, replicas: int) -> Job:
        """Ask an elastic job to run at `replicas` data-parallel replicas."""
        return Job(self._call("PATCH", f"/v1/jobs/{job_id}", json={"replicas": replicas}))

    def events(self, job_id: str, start: int = 0) -> EventPage:
        """The job's timeline from `start`: `.entries`, and `.next` for the following call."""
        return EventPage(self._call("GET", f"/v1/jobs/{job_id}/events", params={"start": start}))

    def logs(self, job_id: str, start: int = 0, rank: int | None = None,
             module: str | None = None) -> LogPage:
        """Log lines from `start` (every rank, or one `rank` / `module`)."""
        params: dict[str, Any] = {"start": start}
        if rank is not None:
            params["rank"] = rank
        if module is not None:
            params["module"] = module
        return LogPage(self._call("GET", f"/v1/jobs/{job_id}/logs", params=params))

    def metrics(self, job_id: str, start: int = 0) -> MetricsPage:
        """The loss curve: one point per logged step, from `start`."""
        return MetricsPage(self._call("GET", f"/v1/jobs/{job_id}/metrics",
                                      params={"start": start}))

    # -- the rest of the API, as plain JSON --------------------------------------
    def samples(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/samples")

    def debug(self, job_id: str, kind: str, step: int | None = None,
              timeout_s: float = 30.0) -> dict[str, Any]:
        """Ask every rank of a running job: `comm`, `memory` or `gradient`."""
        body: dict[str, Any] = {"timeout_s": timeout_s}
        if step is not None:
            body["step"] = step
        return self._call("POST", f"/v1/jobs/{job_id}/debug/{kind}", json=body,
                          timeout=timeout_s + 30)

    def start_profile(self, job_id: str, steps: int) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/profiles", json={"steps": steps})

    def profile(self, job_id: str, profile_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/profiles/{profile_id}")

    def profile_file(self, job_id: str, profile_id: str, name: str) -> bytes:
        """One rank's trace, gzip-compressed Chrome-trace JSON."""
        return self._call("GET", f"/v1/jobs/{job_id}/profiles/{profile_id}/{name}", raw=True)

    def nodes(self) -> dict[str, Any]:
        return self._call("GET", "/v1/nodes")

    def release_node(self, name: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/nodes/{name}/release")

    def set_node(self, name: str, **fields: Any) -> dict[str, Any]:
        """Override a node's `gpu_type` and/or `emulated_speed` (None clears the override)."""
        return self._call("PATCH", f"/v1/nodes/{name}", json=fields)

    def queues(self) -> dict[str, Any]:
        return self._call("GET", "/v1/queues")

    def put_queues(self, doc: dict[str, Any]) -> dict[str, Any]:
        return self._call("PUT", "/v1/queues", json=doc)

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz")

    def whoami(self) -> dict[str, Any]:
        return self._call("GET", "/v1/whoami")

    def create_key(self, name: str, tenant: str, role: str,
                   ttl_s: float | None = None) -> dict[str, Any]:
        return self._call("POST", "/v1/admin/keys", json={"name": name, "tenant": tenant,
                                                          "role": role, "ttl_s": ttl_s})

    def keys(self, include_revoked: bool = False) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/admin/keys",
                          params={"include_revoked": include_revoked})["keys"]

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/admin/keys/{key_id}")

    def audit(self, job: str | None = None, since: float | None = None,
              action: str | None = None, limit: int = 1000,
              task: str | None = None) -> list[dict[str, Any]]:
        """Audit records, oldest first (operators and admins): about one `job`, or
        every job of a `task` name the key may see (ApiError 404 when none), from
        `since` (unix seconds); `action` is allow, deny, an action or its family."""
        params = {k: v for k, v in {"job": job, "task": task, "since": since, "action": action,
                                    "limit": limit}.items() if v is not None}
        return self._call("GET", "/v1/audit", params=params)["records"]
