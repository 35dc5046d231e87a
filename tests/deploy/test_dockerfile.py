"""deploy/Dockerfile, read as text (no Docker daemon or base images here), and
the image's entrypoint script, run for real with stand-ins for `kc` and Ray.

The Dockerfile's torch-index logic is executed, not pattern-matched: the RUN
that installs torch is run by sh with `pip` replaced by a recorder.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
ENTRYPOINT = ROOT / "deploy" / "compose" / "kc-entrypoint.sh"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SECRET_NAME = re.compile(r"pass|secret|token|credential|private|api_?key|auth", re.I)
SECRET_VALUE = re.compile(r"://[^/\s:@]+:[^/\s@]+@|kc_[0-9a-f]{16}_|-----BEGIN|[A-Za-z0-9+/_-]{40,}")


@dataclass
class Stage:
    base: str
    name: str | None
    lines: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, args)

    def all(self, op: str) -> list[str]:
        return [args for ins, args in self.lines if ins == op]


def parse(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with continuation lines joined and
    comments dropped (as Docker does, also inside a continued instruction)."""
    logical, buf = [], ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        buf += raw
        if buf.strip():
            logical.append(buf.strip())
        buf = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        ins, _, args = line.partition(" ")
        ins, args = ins.upper(), args.strip()
        if ins == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.I)
            assert m, f"cannot read FROM {args}"
            stages.append(Stage(m.group(1), m.group(2)))
        elif not stages:
            assert ins == "ARG", f"{ins} before the first FROM"
            k, _, v = args.partition("=")
            global_args[k] = v
        else:
            stages[-1].lines.append((ins, args))
    return global_args, stages


GLOBAL_ARGS, STAGES = parse(DOCKERFILE)
BY_NAME = {s.name: s for s in STAGES if s.name}
FINAL = STAGES[-1]


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), text)


def arg_default(stage: Stage, name: str) -> str | None:
    for a in stage.all("ARG"):
        k, eq, v = a.partition("=")
        if k == name and eq:
            return v
    return None


def env_pairs(stage: Stage) -> dict[str, str]:
    out = {}
    for e in stage.all("ENV"):
        for tok in shlex.split(e):
            k, _, v = tok.partition("=")
            out[k] = v
    return out


def copy_sources(args: str) -> tuple[list[str], list[str]]:
    """(flags, sources) of a COPY/ADD, shell or JSON form."""
    words = json.loads(args) if args.startswith("[") else shlex.split(args)
    flags = [w for w in words if w.startswith("--")]
    paths = [w for w in words if not w.startswith("--")]
    return flags, paths[:-1]


def dockerignored(rel: str) -> bool:
    """Docker's .dockerignore rule: the last pattern that matches the path or one of
    its parent folders decides; `!` re-includes."""
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.strip().startswith("#")]

    def rx(p: str) -> re.Pattern:
        out, i = "", 0
        while i < len(p):
            if p.startswith("**", i):
                out, i = out + ".*", i + 2
            elif p[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif p[i] == "?":
                out, i = out + "[^/]", i + 1
            elif p[i] == "[":
                j = p.index("]", i)
                out, i = out + p[i:j + 1], j + 1
            else:
                out, i = out + re.escape(p[i]), i + 1
        return re.compile(out)

    parts = rel.strip("/").split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for p in patterns:
        neg = p.startswith("!")
        pat = rx(p.lstrip("!").strip("/"))
        if any(pat.fullmatch(c) for c in candidates):
            excluded = not neg
    return excluded


def test_dockerignore_matcher_is_not_vacuous():
    assert dockerignored("deploy/secrets/redis-password")
    assert dockerignored(".venv/bin/python") and dockerignored(".git/HEAD")
    assert dockerignored("platform/__pycache__/spec.cpython-311.pyc")
    assert not dockerignored("platform/spec/jobspec.py") and not dockerignored("pyproject.toml")


def test_every_copy_source_exists_and_reaches_the_builder():
    seen = 0
    for stage in STAGES:
        for ins, args in stage.lines:
            if ins not in ("COPY", "ADD"):
                continue
            flags, sources = copy_sources(args)
            if any(f.startswith("--from") for f in flags):
                continue
            for src in sources:
                seen += 1
                assert not re.match(r"https?://", src), f"{ins} {src}: no downloads into the image"
                assert (ROOT / src).exists(), f"{ins} {src}: not in the repository"
                assert not dockerignored(src), f"{ins} {src}: .dockerignore keeps it from the builder"
                assert not src.startswith("deploy/secrets"), f"{ins} {src}: a secret in a layer"
    assert seen >= 5


def test_variant_build_arg_switches_the_base_image():
    assert GLOBAL_ARGS.get("VARIANT") == "cpu"
    cpu = expand(BY_NAME["base-cpu"].base, GLOBAL_ARGS)
    cuda = expand(BY_NAME["base-cuda"].base, GLOBAL_ARGS)
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", cpu), cpu
    assert re.fullmatch(r"nvidia/cuda:12\.\d+(\.\d+)?-cudnn-runtime-ubuntu22\.04", cuda), cuda
    # The CUDA base brings no Python 3.11 of its own; the CPU one is python:3.11.
    assert "python3.11" in " ".join(BY_NAME["base-cuda"].all("RUN"))
    assert env_pairs(BY_NAME["base-cuda"])["KC_PYTHON"] == "/usr/bin/python3.11"
    assert env_pairs(BY_NAME["base-cpu"])["KC_PYTHON"] == "/usr/local/bin/python3.11"
    # Both the build and the final stage descend from the variant's base.
    assert BY_NAME["base"].base == "base-${VARIANT}"
    assert BY_NAME["build"].base == "base" and FINAL.base == "base"


def torch_run() -> str:
    runs = [r for r in BY_NAME["build"].all("RUN") if "torch==" in r and "pip install" in r]
    assert len(runs) == 1, "one RUN installs torch"
    return runs[0]


def run_torch_install(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The Dockerfile's torch RUN under sh, with pip and python recording their args."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for tool in ("pip", "python"):
        (bindir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "$RECORD"\n')
        (bindir / tool).chmod(0o755)
    record = tmp_path / "record"
    record.unlink(missing_ok=True)
    base = {"PATH": f"{bindir}:/usr/bin:/bin", "RECORD": str(record),
            "TORCH_VERSION": arg_default(BY_NAME["build"], "TORCH_VERSION") or "", "TORCH_INDEX_URL": ""}
    proc = subprocess.run(["sh", "-c", torch_run()], env={**base, **env}, capture_output=True,
                          text=True, timeout=30)
    proc.stdout = record.read_text() if record.exists() else ""
    return proc


def pip_index(out: str) -> str:
    m = re.search(r"^pip install --index-url (\S+) torch==(\S+)$", out, re.M)
    assert m, out
    return m.group(1)


def test_variant_build_arg_switches_the_torch_index(tmp_path):
    cpu = run_torch_install(tmp_path, VARIANT="cpu")
    assert cpu.returncode == 0, cpu.stderr
    assert pip_index(cpu.stdout) == "https://download.pytorch.org/whl/cpu"
    cuda = run_torch_install(tmp_path, VARIANT="cuda")
    assert cuda.returncode == 0, cuda.stderr
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu12\d", pip_index(cuda.stdout))
    # The CUDA wheel's cuXYZ matches the CUDA base image's release.
    cu = re.search(r"cu(\d+)(\d)$", pip_index(cuda.stdout)).groups()
    assert f"nvidia/cuda:{cu[0]}.{cu[1]}" in expand(BY_NAME["base-cuda"].base, GLOBAL_ARGS)
    mirror = run_torch_install(tmp_path, VARIANT="cuda", TORCH_INDEX_URL="https://mirror.example/whl")
    assert pip_index(mirror.stdout) == "https://mirror.example/whl"
    bad = run_torch_install(tmp_path, VARIANT="rocm")
    assert bad.returncode != 0 and "VARIANT must be cpu or cuda" in bad.stderr
    assert "pip install" not in bad.stdout


def test_torch_pin_is_the_makefiles():
    pins = set(re.findall(r"torch==([0-9][^\"'\s]*)", (ROOT / "Makefile").read_text()))
    assert len(pins) == 1, f"the Makefile pins one torch, found {pins}"
    for stage in (BY_NAME["build"], FINAL):
        assert {arg_default(stage, "TORCH_VERSION")} == pins, f"stage {stage.name}"
    assert '"torch==${TORCH_VERSION}"' in torch_run()


def test_package_installs_non_editable_from_what_is_copied():
    build = BY_NAME["build"]
    setuptools = PYPROJECT["tool"]["setuptools"]
    needed = {"pyproject.toml", "constraints.txt", PYPROJECT["project"]["readme"],
              *setuptools["package-dir"].values()}
    copied: set[str] = set()
    workdir, project_installs = None, 0
    for ins, args in build.lines:
        if ins == "WORKDIR":
            workdir = args
        elif ins == "COPY":
            copied |= {s.rstrip("/") for s in copy_sources(args)[1]}
        elif ins == "RUN":
            for segment in re.findall(r"pip install([^&;|]*)", args):
                words = segment.split()
                assert "-e" not in words and "--editable" not in words, "no editable install"
                if "." not in words:
                    continue
                project_installs += 1
                assert "-c" in words, "the image installs at the lock's versions (pip -c)"
                assert workdir == "/src"
                missing = needed - copied
                assert not missing, f"pyproject needs {missing} copied before `pip install .`"
    assert project_installs == 1, "the build stage runs `pip install .` once"
    # Every package folder of pyproject really is there (and has no __init__.py,
    # as the design requires), so copying these three is the whole package.
    for folder in setuptools["package-dir"].values():
        assert (ROOT / folder).is_dir() and not (ROOT / folder / "__init__.py").exists()
    # The final stage takes the built venv, not the sources.
    final_copies = [copy_sources(a) for a in FINAL.all("COPY")]
    assert (["--from=build"], ["/opt/venv"]) in final_copies
    assert not any(src.rstrip("/") in needed for _, srcs in final_copies for src in srcs)


def test_final_stage_runs_as_kc_with_the_contracts_layout():
    users = FINAL.all("USER")
    assert users and users[-1] == "kc", "the final stage must end as user kc"
    run = " ".join(FINAL.all("RUN"))
    assert re.search(r"useradd [^;&]*--uid 1000\b", run) and "--home-dir /home/kc" in run
    assert re.search(r"install -d -o kc -g kc [^;&]*/var/lib/kuangchao\b", run)
    env = env_pairs(FINAL)
    assert env["KC_HOME"] == "/var/lib/kuangchao" and env["HOME"] == "/home/kc"
    assert env["PATH"].startswith("/opt/venv/bin:")
    exposed = {p for e in FINAL.all("EXPOSE") for p in e.split()}
    assert {"6379", "8265", "8080", "8000"} <= exposed
    entry = json.loads(FINAL.all("ENTRYPOINT")[-1])
    assert entry[0] == "tini" and entry[-1] == "kc-entrypoint"
    assert "COPY --chmod=0755 deploy/compose/kc-entrypoint.sh /usr/local/bin/kc-entrypoint" in \
        [f"COPY {a}" for a in FINAL.all("COPY")]
    labels = " ".join(FINAL.all("LABEL"))
    for key in ("title", "description", "version", "licenses", "revision"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert arg_default(FINAL, "KC_VERSION") == PYPROJECT["project"]["version"]


def test_no_arg_or_env_carries_a_secret():
    for stage in [Stage("", None, [("ARG", f"{k}={v}") for k, v in GLOBAL_ARGS.items()]), *STAGES]:
        for ins, args in stage.lines:
            if ins == "ARG":
                pairs = dict([args.partition("=")[::2]])
            elif ins == "ENV":
                pairs = env_pairs(Stage("", None, [(ins, args)]))
            else:
                continue
            for k, v in pairs.items():
                assert not SECRET_NAME.search(k), f"{ins} {k}: secrets come from mounted files"
                assert not SECRET_VALUE.search(v), f"{ins} {k}={v} looks like a credential"


# --- the entrypoint --------------------------------------------------------------


def entry(args: list[str], env: dict[str, str], **kw) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run(["bash", str(ENTRYPOINT), *args], env={**base, **env},
                          capture_output=True, text=True, timeout=60, **kw)


def test_entrypoint_is_executable_bash():
    assert ENTRYPOINT.stat().st_mode & stat.S_IXUSR
    assert subprocess.run(["bash", "-n", str(ENTRYPOINT)]).returncode == 0


def test_entrypoint_builds_the_redis_url_from_the_password_file(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("0123abcd\n")
    out = entry(["env"], {"KC_REDIS_PASSWORD_FILE": str(pw)})
    assert out.returncode == 0, out.stderr
    assert "KC_REDIS_URL=redis://kc-admin:0123abcd@redis:6379/0" in out.stdout.splitlines()
    out = entry(["env"], {"KC_REDIS_PASSWORD_FILE": str(pw), "KC_REDIS_HOST": "r.example",
                          "KC_REDIS_USER": "admin2", "KC_REDIS_DB": "3"})
    assert "KC_REDIS_URL=redis://admin2:0123abcd@r.example:6379/3" in out.stdout.splitlines()
    # An explicit URL wins; the file is not even read.
    out = entry(["env"], {"KC_REDIS_PASSWORD_FILE": str(tmp_path / "absent"),
                          "KC_REDIS_URL": "redis://x@h:1/0"})
    assert out.returncode == 0 and "KC_REDIS_URL=redis://x@h:1/0" in out.stdout
    # What would need percent-encoding, or no file at all, stops the container.
    pw.write_text("p@ss/word\n")
    out = entry(["env"], {"KC_REDIS_PASSWORD_FILE": str(pw)})
    assert out.returncode == 2 and "[A-Za-z0-9._~-]" in out.stderr and "p@ss" not in out.stderr
    out = entry(["env"], {"KC_REDIS_PASSWORD_FILE": str(tmp_path / "absent")})
    assert out.returncode == 2 and "KC_REDIS_PASSWORD_FILE" in out.stderr


@pytest.fixture
def fake_gcs():
    """A port that accepts connections, standing in for the head's GCS."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def fake_kc(tmp_path: Path, fail_first: bool, fail_always: bool = False) -> Path:
    """`kc` that logs each start, fails the first one (or all) if asked, else runs until TERM."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fails = "true" if fail_always else f"[ ! -e {tmp_path / 'failed'} ]" if fail_first else "false"
    # The trap first: its start line is what the tests wait for before a SIGTERM.
    (bindir / "kc").write_text(f"""#!/bin/bash
trap 'echo TERM >> {tmp_path}/kc.log; exit 0' TERM
echo "start $* url=${{KC_REDIS_URL:-}}" >> {tmp_path}/kc.log
if {fails}; then
  touch {tmp_path}/failed; exit 7
fi
while :; do sleep 0.1; done
""")
    (bindir / "kc").chmod(0o755)
    return bindir


def test_entrypoint_restarts_the_control_plane_and_ends_with_the_head(tmp_path, fake_gcs):
    bindir = fake_kc(tmp_path, fail_first=True)
    (tmp_path / "pw").write_text("feed\n")
    out = entry(["bash", "-c", "sleep 3; exit 3"],
                {"PATH": f"{bindir}:{os.environ['PATH']}", "KC_REDIS_PASSWORD_FILE": str(tmp_path / "pw"),
                 "KC_CONTROL_PLANE_ARGS": f"--address {fake_gcs} --watch 30",
                 "KC_CONTROL_PLANE_RETRY_S": "1"})
    log = (tmp_path / "kc.log").read_text().splitlines()
    assert out.returncode == 3, out.stderr
    starts = [line for line in log if line.startswith("start ")]
    assert len(starts) == 2, log  # the first failed (exit 7) and was started again
    assert starts[0] == (f"start control-plane start --address {fake_gcs} --watch 30 "
                         "url=redis://kc-admin:feed@redis:6379/0")
    assert log[-1] == "TERM", "the control plane is stopped when the head ends"
    assert "exited (7)" in out.stderr


def test_the_head_runs_without_the_secrets_and_drivers_get_the_url_from_a_file(tmp_path, fake_gcs):
    """The raylet's environment is every worker's and driver's on the head: it
    holds no secret, only the path of the URL file drivers read."""
    bindir = fake_kc(tmp_path, fail_first=False)
    (tmp_path / "pw").write_text("feed\n")
    url_file = tmp_path / "run" / "redis-url"
    head = f"env > {tmp_path / 'head.env'}; sleep 2"
    out = entry(["bash", "-c", head],
                {"PATH": f"{bindir}:{os.environ['PATH']}", "KC_REDIS_PASSWORD_FILE": str(tmp_path / "pw"),
                 "KC_SIGNING_KEY_FILE": "/run/kc-secrets/signing-key.pem",
                 "KC_ADMIN_KEY_FILE": "/run/kc-secrets/admin-api-key",
                 "KC_REDIS_URL_FILE": str(url_file),
                 "KC_CONTROL_PLANE_ARGS": f"--address {fake_gcs} --watch 30"})
    assert out.returncode == 0, out.stderr
    names = {line.partition("=")[0] for line in (tmp_path / "head.env").read_text().splitlines()}
    assert not names & {"KC_REDIS_URL", "KC_REDIS_PASSWORD_FILE", "KC_SIGNING_KEY_FILE",
                        "KC_ADMIN_KEY_FILE"}, names
    assert "KC_REDIS_URL_FILE" in names and "feed" not in (tmp_path / "head.env").read_text()
    assert url_file.read_text() == "redis://kc-admin:feed@redis:6379/0\n"
    assert url_file.stat().st_mode & 0o777 == 0o600
    # The control plane still gets the URL (and the key files) it needs.
    assert "url=redis://kc-admin:feed@redis:6379/0" in (tmp_path / "kc.log").read_text()


def test_entrypoint_ends_with_the_head_while_the_control_plane_keeps_failing(tmp_path, fake_gcs):
    bindir = fake_kc(tmp_path, fail_first=False, fail_always=True)
    out = entry(["bash", "-c", "sleep 2.5; exit 4"],
                {"PATH": f"{bindir}:{os.environ['PATH']}", "KC_CONTROL_PLANE_RETRY_S": "1",
                 "KC_CONTROL_PLANE_ARGS": f"--address {fake_gcs}"})
    assert out.returncode == 4, out.stderr
    starts = (tmp_path / "kc.log").read_text().count("\nstart ") + 1
    assert 2 <= starts <= 3, "retried with back-off (1 s, 2 s) while the head ran"


def test_entrypoint_waits_for_the_head_before_the_control_plane(tmp_path):
    bindir = fake_kc(tmp_path, fail_first=False)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    out = entry(["bash", "-c", "sleep 2; exit 5"],
                {"PATH": f"{bindir}:{os.environ['PATH']}",
                 "KC_CONTROL_PLANE_ARGS": f"--address={closed} --watch 30"})
    assert out.returncode == 5
    assert not (tmp_path / "kc.log").exists(), "no control plane before Ray answers"


def test_entrypoint_stops_both_on_sigterm(tmp_path, fake_gcs):
    bindir = fake_kc(tmp_path, fail_first=False)
    # The head says when its trap is set: a SIGTERM before that (a slow machine) would
    # end it without the trap, which is not what the entrypoint is tested for.
    head = ("trap 'echo TERM > " + str(tmp_path / "head.log") + "; exit 143' TERM; "
            "echo ready > " + str(tmp_path / "head.ready") + "; while :; do sleep 0.1; done")
    proc = subprocess.Popen(["bash", str(ENTRYPOINT), "bash", "-c", head], start_new_session=True,
                            env={"PATH": f"{bindir}:{os.environ['PATH']}",
                                 "KC_CONTROL_PLANE_ARGS": f"--address {fake_gcs}"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if (tmp_path / "kc.log").exists() and (tmp_path / "head.ready").exists():
                break
            subprocess.run(["sleep", "0.1"])
        # tini -g signals the whole group, as here.
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 143
    assert (tmp_path / "head.log").read_text().strip() == "TERM"
    log = (tmp_path / "kc.log").read_text().splitlines()
    assert log[-1] == "TERM"
    assert sum(line.startswith("start ") for line in log) == 1, "not restarted while stopping"


def test_entrypoint_without_control_plane_execs_the_command():
    # exec: the command takes over the script's process (tini's direct child).
    proc = subprocess.Popen(["bash", str(ENTRYPOINT), sys.executable, "-c", "import os; print(os.getpid())"],
                            stdout=subprocess.PIPE, text=True, env={"PATH": os.environ["PATH"]})
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and int(out) == proc.pid
    assert entry(["bash", "-c", "exit 9"], {}).returncode == 9


def test_entrypoint_reads_the_object_store_keys_from_files(tmp_path):
    (tmp_path / "id").write_text("AKIAEXAMPLE0001\n")
    (tmp_path / "secret").write_text("wJalr/XUtnF+EMI\n")
    files = {"AWS_ACCESS_KEY_ID_FILE": str(tmp_path / "id"),
             "AWS_SECRET_ACCESS_KEY_FILE": str(tmp_path / "secret")}
    out = entry(["env"], files)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "AWS_ACCESS_KEY_ID=AKIAEXAMPLE0001" in lines and "AWS_SECRET_ACCESS_KEY=wJalr/XUtnF+EMI" in lines
    assert not any(line.startswith("AWS_SESSION_TOKEN=") for line in lines)  # no file, no variable
    # A value already given wins; the file is not even read.
    out = entry(["env"], {**files, "AWS_ACCESS_KEY_ID": "AKIAGIVEN",
                          "AWS_ACCESS_KEY_ID_FILE": str(tmp_path / "absent")})
    assert out.returncode == 0 and "AWS_ACCESS_KEY_ID=AKIAGIVEN" in out.stdout.splitlines()
    # A missing file, or one that is not one word, stops the container without showing it.
    out = entry(["env"], {**files, "AWS_SECRET_ACCESS_KEY_FILE": str(tmp_path / "absent")})
    assert out.returncode == 2 and "AWS_SECRET_ACCESS_KEY_FILE" in out.stderr
    (tmp_path / "secret").write_text("two words\n")
    out = entry(["env"], files)
    assert out.returncode == 2 and "two words" not in out.stderr and "one line" in out.stderr


def test_the_head_runs_without_the_object_store_keys(tmp_path, fake_gcs):
    """compose/object-store.yml: the control plane gets the operator's keys, the
    head's raylet (every worker and driver on the head) does not."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "kc").write_text(f"""#!/bin/bash
env > {tmp_path}/kc.env
trap 'exit 0' TERM
while :; do sleep 0.1; done
""")
    (bindir / "kc").chmod(0o755)
    (tmp_path / "id").write_text("AKIAEXAMPLE0001\n")
    (tmp_path / "secret").write_text("secret0001\n")
    (tmp_path / "token").write_text("session0001\n")
    out = entry(["bash", "-c", f"sleep 3; env > {tmp_path / 'head.env'}"],
                {"PATH": f"{bindir}:{os.environ['PATH']}",
                 "AWS_ACCESS_KEY_ID_FILE": str(tmp_path / "id"),
                 "AWS_SECRET_ACCESS_KEY_FILE": str(tmp_path / "secret"),
                 "AWS_SESSION_TOKEN_FILE": str(tmp_path / "token"),
                 "KC_CHECKPOINT_URLS": "s3://b/p", "AWS_ENDPOINT_URL": "http://minio:9000",
                 "KC_CONTROL_PLANE_ARGS": f"--address {fake_gcs} --watch 30"})
    assert out.returncode == 0, out.stderr
    head = (tmp_path / "head.env").read_text()
    names = {line.partition("=")[0] for line in head.splitlines()}
    assert not names & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                        "AWS_ACCESS_KEY_ID_FILE", "AWS_SECRET_ACCESS_KEY_FILE", "AWS_SESSION_TOKEN_FILE"}
    assert "secret0001" not in head and "session0001" not in head
    # Not secret: which prefixes jobs may name, and where the store is.
    assert {"KC_CHECKPOINT_URLS", "AWS_ENDPOINT_URL"} <= names
    cp = (tmp_path / "kc.env").read_text().splitlines()
    assert {"AWS_ACCESS_KEY_ID=AKIAEXAMPLE0001", "AWS_SECRET_ACCESS_KEY=secret0001",
            "AWS_SESSION_TOKEN=session0001"} <= set(cp)
