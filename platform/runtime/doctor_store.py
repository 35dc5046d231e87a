"""`kc doctor --checkpoint-path s3://bucket/prefix`: the object store, checked from
this machine with the operator's credentials and from every Ray node with keys
scoped to a doctor-only prefix, as a job's ranks get them.

From here: the probe (scheme known, bucket exists, credentials accepted), then a
small object under `<prefix>/.kc-doctor/<random>/probe` written, read back and
compared, listed and deleted, ROUNDS times; each operation's median is reported
in ms. From the nodes: the CLI mints credentials for `<prefix>/.kc-doctor/<random>`
(`ObjectCredentialVendor`, as the token authority does for a job), runs one Ray
task pinned to each alive node with them (`node_check`), and releases the grant.
The operator's keys reach no node, except with KC_OBJECT_STORE_CREDENTIALS=shared,
where every job's ranks get them anyway: the check then runs with them too, so
that it tests what jobs will do, and its finding says so.

Every network step runs under a deadline (`bounded`): a store, STS or node that
stops answering is a `fail` finding within seconds, never a hang. The judgements
(facts to findings) are pure; Ray is imported only to reach the nodes.
"""

from __future__ import annotations

import functools
import re
import secrets
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kuangchao.platform.cluster.topology import LABEL_NODE, LABEL_ROLE
from kuangchao.platform.errors import StorageError
from kuangchao.platform.runtime.doctor import STORE_OPS, Finding, here_findings, nodes_findings
from kuangchao.platform.security.object_credentials import MIN_DURATION_S, ObjectCredentialVendor
from kuangchao.platform.storage import objects
from kuangchao.platform.storage.objects import StoreCredentials
from kuangchao.platform.storage.urls import LOCAL_SCHEMES, ObjectUrl, is_url, parse

DOCTOR_DIR = ".kc-doctor"
ROUNDS = 3
HERE_DEADLINE_S = 30.0  # each stage from here: the probe, then the round trips
NODE_DEADLINE_S = 30.0  # the round trips on a node, inside its task
NODE_GRACE_S = 30.0  # on top of that: a worker to start on the node, its answer to come back
GRANT_DEADLINE_S = 90.0  # STS/IAM: a new role may take 30 s to become assumable
JOB_PREFIX = "kc-doctor-"
# `s3:/bucket`, `s3:bucket`: a scheme of two letters or more (not a drive) without `//`.
_SCHEME_ONLY = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)(/?)")


# -- what --checkpoint-path names (pure) --------------------------------------------------

def checkpoint_target(text: str) -> ObjectUrl | Path:
    """`--checkpoint-path` as an object-store URL (parsed) or a local folder
    (`file:///x` is the folder /x).

    Raises:
        ValueError: A malformed URL or one of an unknown scheme; the message says
            what to write instead.
    """
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() in LOCAL_SCHEMES:
        return Path(rest or "/")
    if not is_url(text):
        m = _SCHEME_ONLY.match(text)
        if m and (m.group(2) or _known(m.group(1).lower())):
            raise ValueError(f"{text!r} looks like a URL without '//'; write "
                             f"{m.group(1).lower()}://bucket/prefix, or ./{text} for a local folder")
        return Path(text)
    url = parse(text)
    if not _known(url.scheme):
        raise ValueError(objects.unknown_scheme(url.scheme))
    return url


def _known(scheme: str) -> bool:
    """Whether fsspec knows `scheme` (its package may still be missing: a finding then)."""
    import fsspec

    return scheme in objects.S3_SCHEMES or scheme in fsspec.available_protocols()


# -- running under a deadline -------------------------------------------------------------

def bounded(fn: Callable[[], Any], deadline_s: float, what: str) -> Any:
    """`fn()`, or TimeoutError after `deadline_s`. `fn` runs on a daemon thread, which
    a hung store keeps busy after the deadline; it never keeps the process alive."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller as it is
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"kc-doctor-{what}", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {deadline_s:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def roundtrip(fs: Any, probe: ObjectUrl, rounds: int = ROUNDS,
              progress: dict[str, str] | None = None) -> dict[str, Any]:
    """Write `probe`, read it back, list its folder, delete it, `rounds` times.
    {"ms": {op: median ms}, "rounds"} or {"stage": op, "error": why}; never raises.
    `progress["stage"]` names the operation under way (for a caller that gave up)."""
    progress = progress if progress is not None else {}
    times: dict[str, list[float]] = {op: [] for op in STORE_OPS}
    folder = probe.path.rsplit("/", 1)[0]
    written = False

    def timed(op: str, call: Callable[[], Any]) -> Any:
        progress["stage"] = op
        start = time.perf_counter()
        out = call()
        times[op].append((time.perf_counter() - start) * 1000)
        return out

    try:
        for _ in range(rounds):
            payload = secrets.token_bytes(64)
            timed("write", functools.partial(fs.pipe_file, probe.path, payload))
            written = True
            back = timed("read", lambda: fs.cat_file(probe.path))
            if back != payload:
                return _left({"stage": "read", "error": f"read back {len(back)} bytes that differ "
                              f"from the {len(payload)} written; make sure nothing between here "
                              "and the store (a proxy, a cache) alters objects"}, fs, probe)
            names = timed("list", lambda: fs.ls(folder, detail=False))
            if not any(str(n).rstrip("/").endswith(probe.path) for n in names):
                return _left({"stage": "list", "error": f"listing {folder} does not show the "
                              "object just written; check that the store's listings are "
                              "consistent (no listing cache in front of it)"}, fs, probe)
            timed("delete", lambda: fs.rm_file(probe.path))
            written = False
    except Exception as exc:  # botocore, aiohttp and fsspec raise many kinds
        out = {"stage": progress.get("stage", "write"), "error": objects.describe_failure(exc, probe)}
        return _left(out, fs, probe) if written else out
    return {"ms": {op: statistics.median(v) for op, v in times.items()}, "rounds": rounds}


def _left(out: dict[str, Any], fs: Any, probe: ObjectUrl) -> dict[str, Any]:
    """`out`, noting the probe object when it could not be deleted after a failure."""
    try:
        fs.rm_file(probe.path)
    except Exception:  # as in roundtrip: any kind, reported as a leftover
        out["left"] = str(probe)
    return out


# -- from here ----------------------------------------------------------------------------

def here_facts(url: ObjectUrl, deadline_s: float = HERE_DEADLINE_S,
               token: str | None = None) -> dict[str, Any]:
    """The probe and the round trips from this machine, with the operator's credentials."""
    facts: dict[str, Any] = {"url": str(url)}
    try:
        problem = bounded(lambda: objects.probe(str(url)), deadline_s, "probe")
    except TimeoutError:
        return {**facts, "stage": "probe",
                "error": unanswered(f"probe of {url}", deadline_s, objects.endpoint_from_env())}
    if problem:
        return {**facts, "stage": "probe", "error": problem}
    probe = url.join(DOCTOR_DIR, token or secrets.token_hex(4), "probe")
    facts["probe"] = str(probe)
    progress = {"stage": "write"}
    try:
        return {**facts, **bounded(lambda: roundtrip(objects.filesystem(url.scheme), probe,
                                                     progress=progress), deadline_s, "round trip")}
    except TimeoutError:
        return {**facts, "stage": progress["stage"], "error": unanswered(
            f"{progress['stage']} of {probe}", deadline_s, objects.endpoint_from_env())}
    except StorageError as exc:
        return {**facts, "stage": "write", "error": exc.message}


def unanswered(what: str, deadline_s: float, endpoint: str | None) -> str:
    at = f" at {endpoint}" if endpoint else ""
    return (f"the object store{at} did not answer within {deadline_s:.0f} s ({what}); check that "
            "it is up and reachable (AWS_ENDPOINT_URL, the network)")


# -- from every node ----------------------------------------------------------------------

def node_check(base: str, creds_json: str, deadline_s: float = NODE_DEADLINE_S) -> dict[str, Any]:
    """Run on a node (a Ray task): the round trips under `base` with the granted
    credentials only, never the node's environment. Returns facts; never raises."""
    probe = parse(base).join("probe")
    progress = {"stage": "write"}
    out: dict[str, Any]
    creds: StoreCredentials | None = None
    try:
        creds = StoreCredentials.from_json(creds_json)
        out = bounded(lambda: roundtrip(objects.filesystem(probe.scheme, creds), probe,
                                        progress=progress), deadline_s, "round trip")
    except TimeoutError:
        out = {"stage": progress["stage"], "error": unanswered(
            progress["stage"], deadline_s, creds.endpoint_url if creds else None)}
    except StorageError as exc:
        out = {"stage": "write", "error": exc.message}
    except Exception as exc:  # the credentials did not decode, or the store's own kinds
        out = {"stage": progress["stage"], "error": objects.describe_failure(exc, probe)}
    return {"host": socket.gethostname(), "probe": str(probe), **out}


def node_name(node: dict[str, Any]) -> str:
    """A node of `ray.nodes()` as `kc doctor` names it elsewhere: its label, else its address."""
    labels = node.get("Labels") or {}
    return str(labels.get(LABEL_NODE) or labels.get(LABEL_ROLE) or node.get("NodeManagerAddress")
               or str(node.get("NodeID", "?"))[:12])


def node_outcome(name: str, outcome: Any, waited_s: float) -> dict[str, Any]:
    """What one node's task came to: its facts, an error Ray raised instead (the node
    died, the worker crashed), or None for no answer within `waited_s`."""
    if outcome is None:
        return {"node": name, "stage": "answer", "error": f"did not answer within {waited_s:.0f} s"}
    if isinstance(outcome, BaseException):
        return {"node": name, "stage": "run",
                "error": f"the check could not run there: {objects.short(str(outcome))}"}
    return {**outcome, "node": name}


def ray_dispatch(base: str, creds_json: str, deadline_s: float = NODE_DEADLINE_S) -> list[dict]:
    """`node_check` on every alive node of the connected Ray cluster, in parallel:
    one task per node, pinned to it (soft=False), asking for no CPU so that it runs
    on a busy node, not retried; a node that does not answer in time is a result."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(num_cpus=0, max_retries=0)(node_check)
    refs = [task.options(name="kc-doctor-store", scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(f"{base}/{n['NodeID'][:12]}", creds_json, deadline_s)
        for n in alive]
    waited_s = deadline_s + NODE_GRACE_S
    done = ray.wait(refs, num_returns=len(refs), timeout=waited_s)[0] if refs else []
    ready = {r.hex() for r in done}
    out = []
    for node, ref in zip(alive, refs, strict=True):
        outcome: Any = None
        if ref.hex() in ready:
            try:
                outcome = ray.get(ref, timeout=10)
            except Exception as exc:  # Ray's: the node died, the worker crashed
                outcome = exc
        else:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # already gone with its node: nothing to stop
                pass
        out.append(node_outcome(node_name(node), outcome, waited_s))
    return out


def nodes_facts(url: ObjectUrl, dispatch: Callable[[str, str, float], list[dict]],
                vendor: Any = None, deadline_s: float = NODE_DEADLINE_S,
                token: str | None = None) -> dict[str, Any]:
    """Grant credentials for `<url>/.kc-doctor/<token>`, `dispatch` the check with them
    (`ray_dispatch`, or a stand-in), release the grant and remove what is left there."""
    token = token or secrets.token_hex(4)
    job, base = JOB_PREFIX + token, url.join(DOCTOR_DIR, token)
    # Keys for the shortest session STS gives: the role is deleted at release, but a
    # session of KC_OBJECT_STORE_ROLE_ARN lives until it expires.
    vendor = vendor if vendor is not None else ObjectCredentialVendor(duration_s=MIN_DURATION_S)
    facts: dict[str, Any] = {"url": str(url), "base": str(base), "mode": vendor.mode}
    try:
        creds = bounded(lambda: vendor.grant(job, str(base)), GRANT_DEADLINE_S, "grant")
    except StorageError as exc:
        return {**facts, "grant_error": exc.message}
    except TimeoutError:
        return {**facts, "grant_error": f"STS/IAM did not answer within {GRANT_DEADLINE_S:.0f} s; "
                                  "check AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_STS) and the network"}
    facts.update(scope=creds.scope, endpoint=creds.endpoint_url)
    try:
        facts["nodes"] = dispatch(str(base), creds.to_json(), deadline_s)
    except Exception as exc:  # Ray's own: the connection was lost, the cluster refused the tasks
        facts["dispatch_error"] = f"could not run the check on the nodes: {objects.short(str(exc))}"
    finally:
        try:
            bounded(lambda: vendor.release(job), GRANT_DEADLINE_S, "release")
        except Exception as exc:  # StorageError saying what IAM refused, TimeoutError, boto's
            facts["release_error"] = getattr(exc, "message", None) or str(exc)
        try:  # a node that failed midway leaves its probe: gone with the operator's keys
            bounded(lambda: _remove(objects.filesystem(base.scheme), base), HERE_DEADLINE_S, "cleanup")
        except Exception:  # best effort: the prefix holds a few bytes under .kc-doctor/
            pass
    return facts


def _remove(fs: Any, base: ObjectUrl) -> None:
    if fs.ls(base.path, detail=False):
        fs.rm(base.path, recursive=True)


# -- the whole check ------------------------------------------------------------------------

def examine_store(url: ObjectUrl, cluster: dict[str, Any] | None) -> list[Finding]:
    """From here, then from every node when `cluster` (`ray_facts`' first result, with
    this process connected) is up; what `kc doctor` prints for an object-store URL."""
    here = here_facts(url)
    findings = here_findings(here)
    if here.get("error"):
        return findings + [Finding("checkpoint-nodes", "info",
                                   "not checked from the nodes: it fails from here already")]
    if cluster is None or cluster.get("error"):
        where = f" at {cluster['address']}" if cluster and cluster.get("address") else ""
        return findings + [Finding("checkpoint-nodes", "info", f"no Ray cluster is reachable{where}: "
                                   f"{url} was checked from this machine only")]
    return findings + nodes_findings(nodes_facts(url, ray_dispatch))


def check_nodes(url: str, address: str | None = None,
                deadline_s: float = NODE_DEADLINE_S) -> list[Finding]:
    """The per-node check alone (integration tests): connect to the Ray cluster at
    `address` as `kc doctor` does (unless this process is connected), grant, run
    `node_check` on every alive node, release. The operator's AWS_* must be set here."""
    import ray

    from kuangchao.platform.runtime.ray_connect import connect

    if not ray.is_initialized():
        connect(address)
    return nodes_findings(nodes_facts(parse(url), ray_dispatch, deadline_s=deadline_s))
