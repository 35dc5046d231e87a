"""Redis sized for the cluster: the sizing function, the compose stack's numbers
against it, `kc up`'s Valkey limits, and `kc doctor`'s redis-clients and
redis-memory findings (pure: the probes run in tests/integration/test_doctor.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kuangchao.platform.cluster.topology import load_topology
from kuangchao.platform.jobs import redis_sizing as rs
from kuangchao.platform.jobs.redis_sizing import (
    MIB,
    ClusterSize,
    node_slots,
    parse_memory,
    size_of,
    sizing,
)
from kuangchao.platform.runtime import redis_limits
from kuangchao.platform.runtime.doctor import healthy
from kuangchao.platform.runtime.doctor_capacity import capacity_findings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# compose/gpu-workers.yml's GPU host (`count: all`, no --gpus): Redis is sized for one
# of up to 8 GPUs, as that file and compose/redis.conf say.
COMPOSE_GPU_HOST = (8, 8)


def test_the_per_component_counts_add_up():
    assert rs.RANK_CONNECTIONS == 5 and rs.CONTROLLER_CONNECTIONS == 3
    assert rs.NODE_AGENT_CONNECTIONS == 1 and rs.SLOT_CONNECTIONS == 9
    # The capped lists (platform/jobs/encoding.py) at their average sizes: about 15 MiB a job.
    assert 14 * MIB < rs.JOB_BYTES < 16 * MIB


def test_rank_slots_count_gpus_or_a_cpu_nodes_cpus():
    assert node_slots(8, 96) == 8  # a GPU node: a rank per GPU, its CPUs feed them
    assert node_slots(0, 16) == 16  # a CPU-only node: a rank per whole CPU
    assert node_slots(0, 3.5) == 3 and node_slots(0, 0) == 0
    assert size_of([(4, 4), (4, 4), (0, 8)]) == ClusterSize(nodes=3, slots=16, api_processes=1)


def test_a_small_cluster_gets_the_floors_and_a_large_one_grows_with_its_slots():
    small = sizing(ClusterSize(nodes=2, slots=8))
    assert small.clients == 8 * 9 + 6 + 42 and small.needed == 2 * small.clients + 64
    assert (small.maxclients, small.nofile, small.maxmemory_text()) == (10000, 10128, "2048mb")
    assert small.config_lines() == ["maxclients 10000", "maxmemory 2048mb",
                                    "maxmemory-policy noeviction"]
    big = sizing(ClusterSize(nodes=128, slots=1024, api_processes=2))
    assert big.clients == 1024 * 9 + 6 + 2 * 42 == 9306
    assert big.maxclients == big.needed == 18676 and big.nofile == 18676 + 32 + 96
    assert big.maxmemory == 25600 * MIB and big.maxmemory % rs.MAXMEMORY_STEP == 0
    bigger = sizing(ClusterSize(nodes=256, slots=2048, api_processes=2))
    assert bigger.maxclients > big.maxclients and bigger.maxmemory > big.maxmemory
    with pytest.raises(ValueError, match="negative"):
        sizing(ClusterSize(nodes=1, slots=-1))


def test_redis_memory_values_parse():
    assert parse_memory("2gb") == 2 << 30 == parse_memory("2048mb")
    assert parse_memory("1048576") == MIB and parse_memory("1k") == 1000
    with pytest.raises(ValueError, match="not a Redis memory value"):
        parse_memory("2 GiB")


def _compose_nodes() -> list[tuple[int, int]]:
    """The logical-GPU workers docker-compose.yml declares (their --gpus and --cpus),
    and gpu-workers.yml's host."""
    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    nodes = []
    for svc in services.values():
        cmd = svc.get("command") or []
        if cmd[:3] == ["kc", "node", "join"]:
            flag = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
            nodes.append((int(flag["--gpus"]), int(flag["--cpus"])))
    gpu = yaml.safe_load((DEPLOY / "compose" / "gpu-workers.yml").read_text())["services"]
    assert [n for n, s in gpu.items() if "command" in s] == ["ray-gpu-0"]
    return [*nodes, COMPOSE_GPU_HOST]


def test_the_compose_stacks_redis_is_sized_as_the_function_says():
    nodes = _compose_nodes()
    assert nodes == [(4, 4), (4, 4), (8, 8)]
    want = sizing(size_of(nodes))  # one API server
    conf = dict(line.split(None, 1) for line in (DEPLOY / "compose" / "redis.conf").read_text()
                .splitlines() if line.strip() and not line.startswith("#"))
    assert int(conf["maxclients"]) == want.maxclients
    assert parse_memory(conf["maxmemory"]) == want.maxmemory
    assert conf["maxmemory-policy"] == "noeviction"
    redis = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["redis"]
    assert redis["ulimits"]["nofile"] == {"soft": want.nofile, "hard": want.nofile}
    # The comment restates the size and the numbers it gave.
    text = (DEPLOY / "compose" / "redis.conf").read_text()
    assert f"{want.size.nodes} nodes, {want.size.slots} rank slots" in text
    assert f"{want.clients}\n# connections" in text and f"{want.needed} with headroom" in text
    assert "up to 8 GPUs" in (DEPLOY / "compose" / "gpu-workers.yml").read_text()


@pytest.mark.parametrize("path", sorted([*ROOT.glob("examples/cluster-*.yaml"),
                                         *ROOT.glob("tests/integration/cluster-*.yaml")]),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_kc_up_sizes_every_declared_cluster_within_the_floors(path):
    topo = load_topology(path)
    want = sizing(size_of((n.gpus, n.cpus) for n in topo.nodes))
    assert want.size.slots == sum(node_slots(n.gpus, n.cpus) for n in topo.nodes) > 0
    # The repository's clusters are small: Redis's defaults and 2 GB hold them.
    assert (want.maxclients, want.maxmemory) == (10000, 2048 * MIB)
    assert want.needed < 1000
    assert redis_limits.config_text(want) == ("maxclients 10000\nmaxmemory 2048mb\n"
                                              "maxmemory-policy noeviction\n")


def test_valkey_starts_with_its_soft_open_file_limit_raised_but_never_past_the_hard_one():
    inf = redis_limits.resource.RLIM_INFINITY
    assert redis_limits.nofile_target(10128, (1024, 1048576)) == (10128, 1048576)
    assert redis_limits.nofile_target(10128, (1024, 4096)) == (4096, 4096)
    assert redis_limits.nofile_target(10128, (65536, 1048576)) == (65536, 1048576)  # never lowered
    assert redis_limits.nofile_target(10128, (1024, inf)) == (10128, inf)
    small, big = sizing(ClusterSize(2, 8)), sizing(ClusterSize(128, 1024, 2))
    # 4096 holds a small cluster's 372 clients: Valkey trims maxclients quietly.
    assert redis_limits.shortfall(small, (1024, 4096)) is None
    assert redis_limits.shortfall(big, (1024, inf)) is None
    why = redis_limits.shortfall(big, (1024, 4096))
    assert why and "about 4064 clients" in why and "1024 rank slots need 18676" in why
    assert "ulimit -Hn 18804" in why and "LimitNOFILE" in why


# -- kc doctor ------------------------------------------------------------------------------

SIZE = ClusterSize(nodes=4, slots=32)  # 304 connections at the most, 672 with headroom
GOOD = {"url": "redis://h:6379/0", "version": "7.4.0", "user": "kc-admin", "maxclients": "10000",
        "maxmemory": str(2 << 30), "maxmemory_policy": "noeviction", "connected_clients": 40,
        "used_memory": 300 * MIB, "rejected_connections": 0}


def by_check(findings):
    return {f.check: f for f in findings}


def test_a_redis_sized_for_the_cluster_is_ok():
    f = by_check(capacity_findings(GOOD, SIZE))
    assert f["redis-clients"].status == "ok" and f["redis-memory"].status == "ok"
    assert "maxclients 10000, 40 connected, enough for 32 rank slot(s) on 4 node(s)" == \
        f["redis-clients"].message
    assert healthy(list(f.values()))
    assert capacity_findings({"url": "u", "error": "refused"}, SIZE) == []  # `redis` says it


def test_too_few_clients_fail_with_the_config_line_and_the_open_file_limit():
    f = by_check(capacity_findings({**GOOD, "maxclients": "200"}, SIZE))["redis-clients"]
    assert f.status == "fail" and "open up to 336 connections" in f.message
    assert "`maxclients 10000`" in f.fix and "open-file limit" in f.fix and "10128" in f.fix
    # Enough for the cluster, but without headroom: a warning.
    w = by_check(capacity_findings({**GOOD, "maxclients": "500"}, SIZE))["redis-clients"]
    assert w.status == "warn" and "without the headroom" in w.message
    # Busy, or refusing connections already.
    busy = by_check(capacity_findings({**GOOD, "connected_clients": 9000}, SIZE))["redis-clients"]
    assert busy.status == "warn" and "90% of the limit" in busy.message and "20000" in busy.fix
    refused = by_check(capacity_findings({**GOOD, "rejected_connections": 3}, None))
    assert refused["redis-clients"].status == "fail" and "refused 3" in refused["redis-clients"].message


def test_memory_without_a_limit_an_evicting_policy_or_near_full_is_named():
    f = by_check(capacity_findings({**GOOD, "maxmemory": "0"}, SIZE))["redis-memory"]
    assert f.status == "warn" and "no limit" in f.message
    assert "`maxmemory 2048mb` and `maxmemory-policy noeviction`" in f.fix
    lru = capacity_findings({**GOOD, "maxmemory_policy": "allkeys-lru"}, SIZE)
    assert [x.status for x in lru if x.check == "redis-memory"] == ["fail"]
    full = by_check(capacity_findings({**GOOD, "used_memory": 1900 * MIB}, SIZE))["redis-memory"]
    assert full.status == "warn" and "93%" in full.message and "maxmemory 4096mb" in full.fix
    small = by_check(capacity_findings({**GOOD, "maxmemory": str(512 * MIB)}, SIZE))["redis-memory"]
    assert small.status == "warn" and "less than the 2048mb" in small.message


def test_a_refused_config_get_says_what_to_grant():
    f = capacity_findings({**GOOD, "config_error": "NOPERM this user has no permissions"}, SIZE)
    assert [x.check for x in f] == ["redis-clients"] and f[0].status == "warn"
    assert "ACL SETUSER kc-admin +config|get +info" in f[0].fix
    assert "maxclients >= 10000 and maxmemory >= 2048mb" in f[0].fix


def test_without_the_clusters_size_only_the_use_is_judged():
    f = by_check(capacity_findings(GOOD, None))
    assert f["redis-clients"].status == "ok" and "enough for" not in f["redis-clients"].message
    assert f["redis-memory"].status == "ok"


def test_the_fixes_name_real_config_lines():
    for facts in ({**GOOD, "maxclients": "200"}, {**GOOD, "maxmemory": "0"}):
        for finding in capacity_findings(facts, SIZE):
            for line in re.findall(r"`(max[a-z-]+ [^`]+)`", finding.fix):
                name, value = line.split(" ", 1)
                assert name in ("maxclients", "maxmemory", "maxmemory-policy")
                if name == "maxmemory":
                    parse_memory(value)
