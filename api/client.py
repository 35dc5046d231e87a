"""A small Python client for the kuangchao REST API."""

from __future__ import annotations

from typing import Any

import httpx


class ApiError(Exception):
    """The API answered with an error, or could not be reached.

    Attributes:
        status: HTTP status, or 0 when the server could not be reached.
        detail: The server's `detail` (a string, or a list of field errors).
    """

    def __init__(self, status: int, detail: Any) -> None:
        self.status, self.detail = status, detail
        super().__init__(self.describe())

    def __reduce__(self):
        return (self.__class__, (self.status, self.detail))

    def describe(self) -> str:
        if isinstance(self.detail, list):
            return "\n".join(f"{d.get('field') or '.'.join(map(str, d.get('loc', [])))}: {d['msg']}"
                             for d in self.detail)
        return str(self.detail)

    @property
    def is_user_error(self) -> bool:
        return self.status == 0 or 400 <= self.status < 500 or self.status == 503


class Client:
    """Talks to the API at `base_url` (e.g. http://127.0.0.1:8000) with API key `key`."""

    def __init__(self, base_url: str, key: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.base_url = base_url
        self._http = httpx.Client(base_url=base_url, timeout=timeout, headers=headers)

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

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/jobs", json=spec)

    def submit_yaml(self, text: str) -> dict[str, Any]:
        return self._call("POST", "/v1/jobs", content=text,
                          headers={"Content-Type": "application/yaml"})

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def jobs(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/jobs")["jobs"]

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def scale(self, job_id: str, replicas: int) -> dict[str, Any]:
        return self._call("PATCH", f"/v1/jobs/{job_id}", json={"replicas": replicas})

    def samples(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/samples")

    def events(self, job_id: str, start: int = 0) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/events", params={"start": start})

    def logs(self, job_id: str, start: int = 0, rank: int | None = None,
             module: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"start": start}
        if rank is not None:
            params["rank"] = rank
        if module is not None:
            params["module"] = module
        return self._call("GET", f"/v1/jobs/{job_id}/logs", params=params)

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
              action: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        params = {k: v for k, v in {"job": job, "since": since, "action": action,
                                    "limit": limit}.items() if v is not None}
        return self._call("GET", "/v1/audit", params=params)["records"]
