"""The link probe (workers/trainer/links.py) on 3 real gloo ranks over 2 named nodes, each
node's lowest rank writing to a real Redis under a key prefix of its own.

A slowed link needs network shaping (tests/integration/test_netns.py); here every rank
runs the probe itself: one rate per node reaches every rank, the node leaders set the
gauge, equal rates write no event. A node made slow by delaying its leader's measured
write (its real write to Redis, then a sleep counted into its time) is named once in a
`straggler` event, and not again while it stays slow.
"""

from __future__ import annotations

import json
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.integration.conftest import redis_prefix

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]
NODES = ["node-a", "node-a", "node-b"]
JOB = "links-probe"
# Seconds added to a node's measured write, per case: None measures as it is.
# Padded well past a loaded machine's noise: a write of 8 MiB on loopback takes
# milliseconds, but a second when two cores run a cluster besides.
CASES = [None, {"node-a": 1.0, "node-b": 1.0}, {"node-a": 0.05, "node-b": 2.0},
         {"node-a": 0.05, "node-b": 2.0}]


class _Sink:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def emit(self, message: str, level: str = "INFO", **_fields) -> None:
        self.lines.append((level, message))


def _rank(rank: int, world: int, url: str, prefix: str, rendezvous: str, out: str) -> None:
    from kuangchao.platform.jobs.store import JobStore
    from kuangchao.platform.observability import metrics as m
    from kuangchao.platform.security.tokens import Claims, Scope
    from kuangchao.workers.collectives import set_token
    from kuangchao.workers.runtime.context import TrainContext
    from kuangchao.workers.runtime.telemetry import WorkerTelemetry
    from kuangchao.workers.trainer import links

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        now = time.time()
        set_token(Claims(module="test", job=JOB, role="rank", scope=Scope(groups=("world",)),
                         interfaces=frozenset({"all_reduce", "all_gather"}),
                         issued_at=now, expires_at=now + 3600))
        store = JobStore.from_url(url, prefix)
        tel = WorkerTelemetry(JOB, rank, NODES[rank])
        sink = _Sink()
        ctx = TrainContext(job_id=JOB, rank=rank, world_size=world, local_rank=0, spec=None,
                           device=torch.device("cpu"), checkpoint=None, sink=sink, store=store,
                           telemetry=tel, node=NODES[rank])
        real, pad = links.timed_write, {}

        def delayed(store, job_id, node, payload, timeout_s):
            took, finished = real(store, job_id, node, payload, timeout_s)
            time.sleep(pad.get(node, 0.0))
            return took + pad.get(node, 0.0), finished

        links.timed_write = delayed
        record = []
        for case in CASES:
            pad = case or {}
            result = links.probe(ctx)
            record.append({"result": result, "links": tel.links,
                           "gauge": tel.values.get(m.WORKER_LINK_GBPS.name),
                           "events": store.events(JOB) if rank == 0 else None})
        record.append({"collectives": tel.clock.count, "log": sink.lines})
        Path(f"{out}.{rank}").write_text(json.dumps(record))
    except Exception:
        Path(f"{out}.{rank}.error").write_text(traceback.format_exc())
    finally:
        dist.destroy_process_group()


def test_the_probe_gathers_one_rate_per_node_and_names_only_a_slow_one(tmp_path):
    world = len(NODES)
    with redis_prefix("kctest-links") as (url, prefix):
        mp.start_processes(_rank, args=(world, url, prefix, str(tmp_path / "rdv"),
                                        str(tmp_path / "out")), nprocs=world,
                           start_method="spawn")
        import redis

        left = list(redis.Redis.from_url(url).scan_iter(match=f"{prefix}*linkprobe*"))
    errors = sorted(tmp_path.glob("out.*.error"))
    assert not errors, "\n".join(e.read_text() for e in errors)
    ranks = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(world)]
    assert left == []  # each probe key is deleted after its write

    for i, _ in enumerate(CASES):
        results = [ranks[r][i]["result"] for r in range(world)]
        # One rate per node, the same on every rank (each stamps its own time), each kept
        # for `kc debug comm`.
        assert all({**res, "at": 0} == {**results[0], "at": 0} for res in results)
        assert all(ranks[r][i]["links"] == results[r] for r in range(world))
        rates = results[0]["rates"]
        assert set(rates) == {"node-a", "node-b"} and all(v > 0 for v in rates.values())
        assert results[0]["best_gbps"] == max(rates.values())
        # The gauge is on each node's lowest rank (0 and 2), at its own node's rate.
        assert ranks[0][i]["gauge"] == rates["node-a"] and ranks[2][i]["gauge"] == rates["node-b"]
        assert ranks[1][i]["gauge"] is None

    measured, equal, slow, still = (ranks[0][i] for i in range(len(CASES)))

    def stragglers(case):
        return [e for e in case["events"] if e["type"] == "straggler"]

    assert len(stragglers(measured)) == len(measured["result"]["slow"])  # whatever loopback says
    assert equal["result"]["slow"] == [] and stragglers(equal) == stragglers(measured)
    assert slow["result"]["slow"] == ["node-b"]
    new = stragglers(slow)[len(stragglers(equal)):]
    assert len(new) == 1 and new[0]["node"] == "node-b"
    event = new[0]
    assert event["gbps"] == slow["result"]["rates"]["node-b"]
    assert event["best_gbps"] == slow["result"]["rates"]["node-a"]
    assert event["message"].startswith("node node-b's link measured ")
    assert event["message"].endswith("a slow link (straggler)")
    # Still slow at the next probe: named in the log, not in a second event.
    assert still["result"]["slow"] == ["node-b"] and stragglers(still) == stragglers(slow)
    log = ranks[0][-1]["log"]
    assert sum("node node-b's link measured" in message for _, message in log) >= 2
    # Every turn is a collective the ranks' clocks saw: the node exchange, then one per node
    # and round (a node that seems slow has every node measured a second time).
    # Equal delays take one round, or two where a loaded box's jitter made a node seem
    # slow at the first (measured again, by design); a slow node always takes two.
    assert equal["result"]["rounds"] in (1, 2)
    assert [c["result"]["rounds"] for c in (slow, still)] == [2, 2]
    turns = sum(1 + 2 * c["result"]["rounds"] for c in (measured, equal, slow, still))
    assert all(ranks[r][-1]["collectives"] == turns for r in range(world))


def test_a_timed_write_deletes_its_key_and_one_past_its_timeout_is_given_up():
    import os

    import redis

    from kuangchao.platform.jobs import keys
    from kuangchao.platform.jobs.link_probe import timed_write
    from kuangchao.platform.jobs.store import JobStore

    with redis_prefix("kctest-links-write") as (url, prefix):
        store = JobStore.from_url(url, prefix)
        payload = os.urandom(8 << 20)
        took, finished = timed_write(store, JOB, "node-a", payload, 30.0)
        assert finished and 0 < took < 30
        key = keys.link_probe(prefix, JOB, "node-a")
        assert not store.r.exists(key)
        took, finished = timed_write(store, JOB, "node-a", payload, 1e-4)
        assert not finished and took < 5  # what it reached: an upper bound on the rate
        with pytest.raises((redis.RedisError, OSError)):
            timed_write(JobStore(redis.Redis.from_url(url.rsplit(":", 1)[0] + ":1/0"), prefix),
                        JOB, "node-a", payload, 1.0)


# -- in the train loop ------------------------------------------------------------------

STEPS = 30


def _doc(ckpt: str) -> dict:
    return {"task": {"name": "links-loop"},
            "model": {"type": "gpt", "vocab_size": 256, "n_layers": 2, "n_heads": 2,
                      "d_model": 32, "seq_len": 32},
            "data": {"corpus": "stdlib", "max_bytes": 100_000, "prefetch": 1},
            "parallel": {"data_parallel_size": 2, "micro_batch_size": 2},
            "optimizer": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
            "training": {"steps": STEPS, "seed": 3, "log_interval": 5, "torch_threads": 1},
            "checkpoint": {"path": ckpt, "interval_steps": STEPS, "keep_last": 1}}


def _train_rank(rank: int, world: int, url: str, prefix: str, root: str) -> None:
    from kuangchao.platform.jobs.store import JobStore
    from kuangchao.platform.observability import metrics as m
    from kuangchao.platform.security.tokens import Claims, Scope
    from kuangchao.platform.spec.jobspec import validate_spec
    from kuangchao.workers.checkpoint.manager import CheckpointManager
    from kuangchao.workers.collectives import set_token
    from kuangchao.workers.runtime.context import TrainContext
    from kuangchao.workers.runtime.joblog import JobLogSink
    from kuangchao.workers.runtime.telemetry import WorkerTelemetry
    from kuangchao.workers.trainer.loop import train

    class Congested(WorkerTelemetry):
        """Past step 12, each step reads as 0.5 s of communication (as a slowed link would)."""

        inflate = False

        def end_step(self, step: int, samples: int, tokens: int) -> None:
            super().end_step(step, samples, tokens)
            if self.inflate and step > 12:
                self.values[m.WORKER_COMM_SECONDS.name] = 0.5

    from kuangchao.workers.trainer import links

    real_probe, probes = links.probe, []

    def counted(ctx, trigger=None):
        probes.append(ctx.telemetry.values.get(m.WORKER_STEP.name))
        return real_probe(ctx, trigger)

    links.probe = counted
    torch.set_num_threads(1)
    out = {}
    for i, inflate in enumerate((False, True)):
        probes.clear()
        dist.init_process_group("gloo", init_method=f"file://{root}/rdv-{i}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=120))
        try:
            now = time.time()
            set_token(Claims(module="test", job="links-loop", role="rank",
                             scope=Scope(groups=("world",)),
                             interfaces=frozenset({"all_reduce", "all_gather", "broadcast"}),
                             issued_at=now, expires_at=now + 3600))
            spec = validate_spec(_doc(f"{root}/ckpt-{i}"))
            job = f"links-loop-{i}"
            tel = Congested(job, rank, NODES[1:][rank])
            tel.inflate = inflate
            sink = JobLogSink(None, job, rank, interval_s=3600)
            ctx = TrainContext(job_id=job, rank=rank, world_size=world, local_rank=0, spec=spec,
                               device=torch.device("cpu"), sink=sink,
                               store=JobStore.from_url(url, prefix), dp_rank=rank, dp_size=world,
                               checkpoint=CheckpointManager(spec.checkpoint.path, job, rank,
                                                            world, spec.spec_hash(), 1),
                               telemetry=tel, node=NODES[1:][rank])
            result = train(ctx)
            sink.close()
            out[str(inflate)] = {"result": result, "links": tel.links, "probes": list(probes)}
        except Exception:
            out["error"] = traceback.format_exc()
        finally:
            dist.destroy_process_group()
    Path(f"{root}/train.{rank}").write_text(json.dumps(out))


def test_a_probe_in_the_train_loop_changes_nothing_the_run_computes(tmp_path):
    """Every run probes once at step 10, its baseline in; communication rising 25x past
    step 12 makes the loop probe again at step 20 (the first check with 5 recent steps
    over 3x the first 10 steps' level), on both ranks; the run ends with the parameters
    and loss of the same run with the first probe only."""
    with redis_prefix("kctest-links-loop") as (url, prefix):
        mp.start_processes(_train_rank, args=(2, url, prefix, str(tmp_path)), nprocs=2,
                           start_method="spawn")
    ranks = [json.loads((tmp_path / f"train.{r}").read_text()) for r in range(2)]
    assert not any("error" in r for r in ranks), [r.get("error") for r in ranks]
    for r in ranks:
        quiet, probed = r["False"], r["True"]
        assert quiet["probes"] == [10]  # no rise: the first probe only
        assert probed["probes"] == [10, 20]
        assert set(quiet["links"]["rates"]) == {"node-a", "node-b"}
        assert set(probed["links"]["rates"]) == {"node-a", "node-b"}
        assert probed["result"]["params_sha256"] == quiet["result"]["params_sha256"]
        assert probed["result"]["final_loss"] == quiet["result"]["final_loss"]
        assert probed["result"]["steps"] == STEPS
