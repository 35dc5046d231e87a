"""`parallel: auto`: the planner's layout written into the spec, and the rules around it."""

from __future__ import annotations

import dataclasses

import pytest

from kuangchao.platform.cluster.registry import nodes_from_ray
from kuangchao.platform.cluster.topology import ClusterTopology, NodeInfo
from kuangchao.platform.errors import SpecError
from kuangchao.platform.planning import autoplan
from kuangchao.platform.planning.planner import plan
from kuangchao.platform.planning.shapes import ClusterShape, ModelShape, Plan
from kuangchao.platform.spec.jobspec import validate_spec

CONTRACT = ["dp", "tp", "pp", "micro_batch", "zero_stage", "recompute", "schedule",
            "memory_gb_per_gpu", "predicted_step_s", "predicted_tflops_per_gpu", "gpu", "gpus"]
TINY = {"type": "gpt", "n_layers": 1, "n_heads": 2, "d_model": 32, "seq_len": 32}
# 32 layers of a 6.7B model: pipelines win on two H100s at a global batch of 64.
BIG = {"type": "gpt", "n_layers": 32, "n_heads": 32, "d_model": 4096, "seq_len": 1024,
       "vocab_size": 50257}


def cluster(*gpus: int, accelerator: str | None = None, dead: tuple[int, ...] = ()) -> ClusterTopology:
    return ClusterTopology("t", tuple(
        NodeInfo(f"node-{i}", g, (tuple(range(g)),), "leaf-0", alive=i not in dead,
                 accelerator=accelerator) for i, g in enumerate(gpus)))


C4X8 = cluster(8, 8, 8, 8)


def auto_doc(model=None, **parallel) -> dict:
    return {"model": dict(model or TINY), "parallel": {"auto": True, **parallel}}


def layout(doc: dict) -> tuple[int, ...]:
    p = doc["parallel"]
    return (p["data_parallel_size"], p["tensor_parallel_size"], p["pipeline_parallel_size"],
            p["micro_batch_size"], p["gradient_accumulation_steps"], p["zero_stage"])


def test_a_fitting_plan_becomes_a_concrete_spec_and_a_plan_record():
    doc = auto_doc(gpus=2, micro_batch_size=4, precision="bf16")
    out, rec = autoplan.resolve(doc, C4X8)
    spec = validate_spec(out)
    p = spec.parallel
    assert not p.auto and p.gpus is None and p.gpu is None and p.global_batch is None
    assert p.world_size == 2 and p.precision == "bf16"  # the user's other fields stay
    assert set(CONTRACT) <= set(rec) and rec["dp"] * rec["tp"] * rec["pp"] == 2
    assert rec["gpu"] == "cpu" and rec["gpus"] == 2 and rec["global_batch"] == 8
    assert rec["rank"] == 1 and rec["candidates"] >= 1 and rec["predicted_step_s"] > 0
    # The planner's first choice, written field by field.
    best = plan(ModelShape.from_spec_model({**TINY, "vocab_size": 256}), ClusterShape(2, 8),
                autoplan.CATALOG["cpu"], 8)[0]
    assert layout(out) == (best.dp, best.tp, best.pp, best.micro_batch, best.num_microbatches,
                           best.zero_stage)
    assert p.schedule == "1f1b" and rec["schedule"] == "none"  # pp == 1
    assert doc["parallel"]["auto"] is True  # the input is left alone


def test_the_string_shorthand_and_a_dumped_spec_resolve_alike():
    short, _ = autoplan.resolve({"model": TINY, "parallel": "auto"}, cluster(2))
    dumped = validate_spec({"model": TINY, "parallel": "auto"}).model_dump(mode="json")
    full, _ = autoplan.resolve(dumped, cluster(2))
    assert layout(short) == layout(full)
    assert validate_spec(short) == validate_spec(full)


def test_defaults_gpus_are_one_largest_alive_node_over_gpus_per_rank():
    _, rec = autoplan.resolve(auto_doc(), cluster(4, 8, 6, dead=(1,)))
    assert rec["gpus"] == 6 and rec["gpus_per_node"] == 6
    _, rec = autoplan.resolve(auto_doc(gpus_per_rank=2), cluster(4, 8, 6, dead=(1,)))
    assert rec["gpus"] == 3


def test_defaults_global_batch_is_micro_batch_times_accumulation_times_gpus():
    _, rec = autoplan.resolve(auto_doc(gpus=2), C4X8)
    assert rec["global_batch"] == 8 * 1 * 2
    _, rec = autoplan.resolve(auto_doc(gpus=4, micro_batch_size=2, gradient_accumulation_steps=3),
                              C4X8)
    assert rec["global_batch"] == 2 * 3 * 4
    out, rec = autoplan.resolve(auto_doc(gpus=2, global_batch=32), C4X8)
    spec = validate_spec(out)
    assert rec["global_batch"] == 32 == spec.elastic_range.global_batch


@pytest.mark.parametrize("detected, gpu, expect", [
    (None, None, "cpu"), ("H100", None, "h100-80gb"), ("A100", None, "a100-40gb"),
    ("A100-80G", None, "a100-80gb"), ("H200", None, "h200-141gb"), ("T4", None, "cpu"),
    ("H100", "a100-80gb", "a100-80gb"), (None, "H100-80GB", "h100-80gb")])
def test_defaults_accelerator_is_the_spec_then_the_detected_type_then_cpu(detected, gpu, expect):
    extra = {"gpu": gpu} if gpu else {}
    _, rec = autoplan.resolve(auto_doc(gpus=2, **extra), cluster(8, accelerator=detected))
    assert rec["gpu"] == expect


def test_an_unknown_gpu_names_parallel_gpu():
    with pytest.raises(SpecError) as info:
        autoplan.resolve(auto_doc(gpus=2, gpu="tpu-v9"), C4X8)
    assert info.value.errors[0][0] == "parallel.gpu" and "h100-80gb" in info.value.errors[0][1]


def test_ranks_must_fill_whole_nodes_and_need_a_known_node_by_default():
    with pytest.raises(SpecError) as info:
        autoplan.resolve(auto_doc(gpus=12), C4X8)
    assert info.value.errors == [("parallel.gpus", "12 ranks do not fill whole nodes of 8; use "
                                                   "at most 8 or a multiple of it")]
    with pytest.raises(SpecError) as info:
        autoplan.resolve(auto_doc(), None)
    assert info.value.errors[0][0] == "parallel.gpus"
    out, rec = autoplan.resolve(auto_doc(gpus=4), None)  # the catalogue's cpu node: 2 ranks
    assert rec["gpus_per_node"] == 2 and validate_spec(out).world_size == 4


def test_a_pipeline_gets_send_and_recv_and_enough_micro_batches():
    out, rec = autoplan.resolve(auto_doc(BIG, gpus=2, gpu="h100-80gb", global_batch=64,
                                         micro_batch_size=1), C4X8)
    spec = validate_spec(out)
    assert rec["pp"] > 1 and spec.parallel.pipeline_parallel_size == rec["pp"]
    assert {"send", "recv"} <= set(spec.permission.collectives)
    assert spec.parallel.gradient_accumulation_steps >= rec["pp"]
    assert spec.parallel.virtual_stages == rec["virtual_stages"]


def test_a_users_own_collectives_list_rules_out_what_it_does_not_allow():
    doc = auto_doc(BIG, gpus=2, gpu="h100-80gb", global_batch=64, micro_batch_size=1)
    doc["permission"] = {"collectives": ["all_gather", "all_reduce", "broadcast", "reduce_scatter"]}
    out, rec = autoplan.resolve(doc, C4X8)
    assert rec["pp"] == 1 and rec["rank"] > 1
    assert "send" not in validate_spec(out).permission.collectives


def test_only_layouts_the_worker_runs_fp16_rules_out_fsdp():
    # The planner's first choice for 6.7B on 8 H100s shards with FSDP2 (its reduce-scatter
    # moves half an all-reduce's bytes); fp16 loss scaling does not run under FSDP2 (nor
    # in a pipeline), so a later layout with ZeRO 0 or 1 is taken instead.
    doc = auto_doc(BIG, gpus=8, gpu="h100-80gb", global_batch=64)
    assert autoplan.resolve(doc, C4X8)[1]["zero_stage"] >= 2
    out, rec = autoplan.resolve(auto_doc(BIG, gpus=8, gpu="h100-80gb", global_batch=64,
                                         precision="fp16"), C4X8)
    p = validate_spec(out).parallel
    assert rec["rank"] > 1 and p.zero_stage <= 1 and p.pipeline_parallel_size == 1


def _plan(**kw) -> Plan:
    base = dict(dp=1, tp=1, pp=1, micro_batch=8, zero_stage=0, recompute=False, schedule="none",
                memory_gb_per_gpu=1.0, predicted_step_s=0.01, predicted_tflops_per_gpu=1.0)
    return Plan(**{**base, **kw})


@pytest.mark.parametrize("bad, field", [
    (_plan(pp=2, dp=1, schedule="1f1b", micro_batch=8, num_microbatches=1),
     "parallel.gradient_accumulation_steps"),
    (_plan(pp=2, schedule="gpipe", micro_batch=8, num_microbatches=1),
     "parallel.gradient_accumulation_steps"),
    (_plan(pp=2, schedule="interleaved_1f1b", virtual_stages=2, micro_batch=2, num_microbatches=4),
     "parallel.virtual_stages"),  # 2 x 2 chunks do not divide 2 layers
    (_plan(tp=4, micro_batch=8), "parallel.tensor_parallel_size"),  # 4 does not divide 2 heads
    (_plan(dp=2, tp=2, zero_stage=1, micro_batch=4), "parallel.zero_stage"),
])
def test_an_unrunnable_first_choice_gives_way_to_the_best_runnable(monkeypatch, bad, field):
    model = {**TINY, "n_layers": 2}
    spec = validate_spec(auto_doc(model, gpus=2))
    assert field in {f for f, _ in autoplan.layout_errors(spec, bad)}
    good = _plan(dp=2, micro_batch=4, predicted_step_s=0.02)
    monkeypatch.setattr(autoplan, "plan", lambda *a, **k: [bad, good])
    out, rec = autoplan.resolve(auto_doc(model, gpus=2), C4X8)
    assert rec["rank"] == 2 and rec["candidates"] == 2 and rec["dp"] == 2
    assert layout(out) == (2, 1, 1, 4, 1, 0)


def test_interleaved_needs_micro_batches_a_multiple_of_pp():
    spec = validate_spec(auto_doc({**TINY, "n_layers": 4}, gpus=2))
    bad = _plan(pp=2, schedule="interleaved_1f1b", virtual_stages=2, micro_batch=1,
                num_microbatches=3)
    assert "parallel.gradient_accumulation_steps" in {f for f, _ in autoplan.layout_errors(spec, bad)}
    ok = dataclasses.replace(bad, num_microbatches=4)
    assert autoplan.layout_errors(spec, ok) == []


def test_no_runnable_layout_is_an_error_on_parallel_auto(monkeypatch):
    bad = _plan(pp=2, schedule="1f1b", num_microbatches=1)
    monkeypatch.setattr(autoplan, "plan", lambda *a, **k: [bad])
    with pytest.raises(SpecError) as info:
        autoplan.resolve(auto_doc({**TINY, "n_layers": 2}, gpus=2), C4X8)
    [(field, msg)] = info.value.errors
    assert field == "parallel.auto" and "none this spec can run" in msg
    assert "cannot fill 2 stages" in msg and "parallel.global_batch" in msg


def test_a_model_that_fits_nowhere_says_what_to_change():
    huge = {"n_layers": 96, "n_heads": 96, "d_model": 12288, "seq_len": 2048, "vocab_size": 50257}
    with pytest.raises(SpecError) as info:
        autoplan.resolve(auto_doc(huge, gpus=1, gpu="a100-40gb"), C4X8)
    [(field, msg)] = info.value.errors
    assert field == "parallel.auto" and "fits 1 x a100-40gb" in msg
    for hint in ("parallel.gpus", "parallel.gpu", "parallel.micro_batch_size", "model.n_layers"):
        assert hint in msg


def test_a_batch_no_layout_can_split_says_so():
    with pytest.raises(SpecError) as info:
        autoplan.resolve(auto_doc(gpus=3, global_batch=4), cluster(4))
    [(field, msg)] = info.value.errors
    assert field == "parallel.auto" and "multiple of 3" in msg


def test_elastic_jobs_and_field_errors_are_refused_before_planning():
    doc = auto_doc(gpus=2, micro_batch_size=4, gradient_accumulation_steps=2)
    doc["elastic"] = {"min_replicas": 1, "max_replicas": 2}
    with pytest.raises(SpecError) as info:
        autoplan.resolve(doc, C4X8)
    assert info.value.errors[0][0] == "parallel.auto"
    with pytest.raises(SpecError) as info:
        autoplan.resolve(auto_doc(gpus=2, tensor_parallel_size=2), C4X8)
    assert info.value.errors[0][0] == "parallel.tensor_parallel_size"
    with pytest.raises(ValueError):
        autoplan.resolve({"model": TINY}, C4X8)


def test_the_registry_view_round_trips_and_carries_the_detected_accelerator():
    ray_nodes = [{"NodeID": "a" * 56, "Alive": True, "Labels": {"kc.io/node": "n0"},
                  "Resources": {"GPU": 8, "CPU": 16, "accelerator_type:H100": 1}},
                 {"NodeID": "b" * 56, "Alive": True, "Labels": {"kc.io/node": "n1"},
                  "Resources": {"GPU": 2, "CPU": 4}}]
    nodes = nodes_from_ray(ray_nodes)
    assert [n.accelerator for n in nodes] == ["H100", None]
    view = {"nodes": [n.to_json() for n in nodes]}
    topo = autoplan.topology_from_view(view)
    assert topo is not None and topo.nodes == nodes
    assert autoplan.topology_from_view(None) is None
    assert autoplan.topology_from_view({"nodes": []}) is None
    _, rec = autoplan.resolve(auto_doc(), topo)
    assert rec["gpu"] == "h100-80gb" and rec["gpus"] == 8


class _FakeStore:
    """What `jobs.resolve_auto`, `jobs.job_view` and `TrainContext.report` touch."""

    def __init__(self, nodes=None, progress=None):
        self._nodes, self._progress, self.reports = nodes, dict(progress or {}), []

    def info(self, name):
        return self._nodes if name == "nodes" else None

    def progress(self, job_id):
        return self._progress

    def checkpoints(self, job_id):
        return []

    def set_progress(self, job_id, progress):
        self.reports.append(dict(progress))

    def post_report(self, job_id, report):  # the first step's timings, for the controller
        self.posted = [*getattr(self, "posted", []), report]


def test_submission_resolves_on_the_registry_view_and_the_job_json_shows_plan_and_measured():
    from kuangchao.platform.control import operations as jobs
    from kuangchao.platform.jobs.state import JobRecord, JobState

    store = _FakeStore({"nodes": [n.to_json() for n in C4X8.nodes]}, {"step": 5, "step_s": 0.02})
    spec, rec = jobs.resolve_auto(store, validate_spec(auto_doc(gpus=2, micro_batch_size=4)))
    assert not spec.parallel.auto and spec.world_size == 2 and rec["gpus"] == 2
    same, none = jobs.resolve_auto(store, spec)
    assert same is spec and none is None  # a hand-written layout is left as it is
    job = JobRecord(id="j", name="j", spec=spec.model_dump(mode="json"), plan=rec,
                    state=JobState.RUNNING, started_at=1.0)
    view = jobs.job_view(store, job, [])
    assert view["plan"] == rec and view["measured_step_s"] == 0.02
    assert JobRecord.from_json(job.to_json()).plan == rec
    assert JobRecord.from_json({k: v for k, v in job.to_json().items() if k != "plan"}).plan is None


def test_status_shows_the_plan_with_predicted_and_measured_step_time(capsys):
    from kuangchao.api.cli.render import plan_line, print_job

    _, rec = autoplan.resolve(auto_doc(gpus=2, micro_batch_size=4), C4X8)
    line = plan_line(rec, 0.0151)
    assert line.startswith(f"dp={rec['dp']} tp={rec['tp']} pp=1 micro_batch=")
    assert line.endswith(f"predicted {rec['predicted_step_s']:.3g} s/step, measured 0.0151 s/step")
    assert "measured - s/step" in plan_line(rec, None)
    assert "hsdp" not in line and " zero=0 hsdp=8 recompute=" in plan_line(
        {**rec, "zero_stage": 0, "shard_group_size": 8}, None)
    job = {"id": "a", "name": "a", "state": "RUNNING", "world_size": 2, "restarts": 0,
           "progress": {"step": 3}, "plan": rec, "measured_step_s": 0.0151}
    print_job(job)
    assert "plan         dp=" in capsys.readouterr().out
    print_job({**job, "plan": None})
    assert "step time    measured 0.0151 s/step" in capsys.readouterr().out


def test_rank_zero_reports_the_median_seconds_per_step(monkeypatch):
    import types

    import torch

    from kuangchao.workers.runtime import context
    clock = iter([10.0, 10.5, 11.0, 14.0, 14.5, 100.0, 101.0])
    monkeypatch.setattr(context.time, "perf_counter", lambda: next(clock))
    store = _FakeStore()
    ckpt = types.SimpleNamespace(last_load_s=None, last_load_end=None, last_restored_step=None)
    ctx = context.TrainContext(job_id="j", rank=0, world_size=1, local_rank=0,
                               spec=validate_spec({"model": TINY}), device=torch.device("cpu"),
                               checkpoint=ckpt, sink=None, store=store)
    for step in (1, 2, 3, 4, 6):  # the last report spans two steps: 0.25 s each
        ctx.report(step)
    got = [r.get("step_s") for r in store.reports]
    assert got == [None, 0.5, 0.5, 0.5, 0.5]  # medians of [.5], [.5,.5], [.5,.5,3], [.5,.5,3,.25]
    ctx.expect_first_step()  # a restore: its time is no step
    ctx.report(7)
    assert store.reports[-1]["step_s"] == 0.5
    ctx.report(8, step_s=9.0)  # a train function's own figure wins
    assert store.reports[-1]["step_s"] == 9.0


def hf_folder(tmp_path, **config) -> str:
    """A model folder holding only a tiny Llama config.json (the planner reads nothing else)."""
    import json

    from tests.unit.test_planner import HF_LLAMA

    folder = tmp_path / "llama-tiny"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**HF_LLAMA, **config}))
    return str(folder)


def test_an_hf_folder_is_planned_from_its_config(tmp_path):
    import json

    folder = hf_folder(tmp_path)
    model = {"type": "hf", "path": folder, "seq_len": 128}
    out, rec = autoplan.resolve(auto_doc(model, gpus=8, micro_batch_size=1), cluster(8))
    spec = validate_spec(out)
    assert spec.model.hf_folder == folder and spec.world_size == 8
    shape = ModelShape.from_hf_config(json.loads((tmp_path / "llama-tiny/config.json").read_text()),
                                      128)
    ranked = plan(shape, ClusterShape(8, 8), autoplan.CATALOG["cpu"], 8)
    assert rec["candidates"] == len(ranked)
    assert rec == {**ranked[rec["rank"] - 1].to_json(), **{k: rec[k] for k in (
        "gpu", "gpus", "gpus_per_node", "global_batch", "candidates", "rank")}}
    assert {p.tp for p in ranked} <= {1, 2}  # 2 key/value heads
    # The design documents' form: type llama with a checkpoint folder.
    out2, rec2 = autoplan.resolve(auto_doc({"type": "llama", "checkpoint": folder, "seq_len": 128},
                                           gpus=8, micro_batch_size=1), cluster(8))
    assert layout(out2) == layout(out) and rec2["candidates"] == rec["candidates"]


def test_an_hf_folder_keeps_to_the_layouts_the_model_takes(tmp_path):
    spec = validate_spec(auto_doc({"type": "hf", "path": hf_folder(tmp_path)}, gpus=8))
    hf = autoplan.hf_shapes(spec)[1]

    def fields(p: Plan) -> set[str]:
        return {f for f, _ in autoplan.layout_errors(spec, p, hf)}

    assert fields(_plan(tp=4, dp=2)) == {"parallel.tensor_parallel_size"}  # 2 kv heads
    assert fields(_plan(tp=2, dp=4)) == set()  # no "custom model" refusal for a folder
    assert "parallel.pipeline_parallel_size" in fields(
        _plan(pp=8, schedule="1f1b", micro_batch=1, num_microbatches=8))  # 8 stages, 4 layers
    assert fields(_plan(pp=2, dp=4, schedule="1f1b", micro_batch=1, num_microbatches=2)) == set()
    assert autoplan.layout_errors(spec, _plan(tp=4, dp=2)) == autoplan.layout_errors(
        spec, _plan(tp=4, dp=2), hf)  # read from the folder when not given
    # A family kc cannot cut into pipeline stages.
    other = validate_spec(auto_doc({"type": "hf", "path": hf_folder(
        tmp_path, model_type="phi", architectures=["PhiForCausalLM"])}, gpus=8))
    assert "parallel.pipeline_parallel_size" in {f for f, _ in autoplan.layout_errors(
        other, _plan(pp=2, dp=4, schedule="1f1b", micro_batch=1, num_microbatches=2))}


def test_an_hf_layout_the_model_cannot_take_gives_way(tmp_path, monkeypatch):
    folder = hf_folder(tmp_path)
    bad = _plan(tp=8, micro_batch=8)  # 8 does not divide 2 key/value heads
    good = _plan(tp=2, dp=4, micro_batch=2, predicted_step_s=0.02)
    monkeypatch.setattr(autoplan, "plan", lambda *a, **k: [bad, good])
    out, rec = autoplan.resolve(auto_doc({"type": "hf", "path": folder}, gpus=8), cluster(8))
    assert rec["rank"] == 2 and layout(out)[:3] == (4, 2, 1)


def test_a_missing_hf_folder_is_the_folder_error(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(SpecError) as info:
        autoplan.resolve(auto_doc({"type": "hf", "path": missing}, gpus=2), C4X8)
    [(field, msg)] = info.value.errors
    assert field == "model.path" and "is not a folder" in msg
    with pytest.raises(SpecError) as info:
        autoplan.resolve(auto_doc({"type": "llama", "checkpoint": missing}, gpus=2), C4X8)
    assert info.value.errors[0][0] == "model.checkpoint"
    broken = hf_folder(tmp_path, num_attention_heads=None)
    with pytest.raises(SpecError) as info:
        autoplan.resolve(auto_doc({"type": "hf", "path": broken}, gpus=2), C4X8)
    [(field, msg)] = info.value.errors
    assert field == "model.path" and "num_attention_heads" in msg


def test_a_plan_that_shards_within_nodes_writes_shard_group_size():
    # 6.7B on four 8-GPU A100 nodes with 4 micro-batches per step: FSDP across all 32
    # would gather over the network every micro-batch; HSDP gathers over NVLink and
    # all-reduces the shards across nodes once per step.
    doc = auto_doc(BIG, gpus=32, gpu="a100-80gb", global_batch=1024)
    out, rec = autoplan.resolve(doc, C4X8)
    p = validate_spec(out).parallel
    assert rec["shard_group_size"] == 8 and p.shard_group_size == 8 and p.zero_stage >= 2
    assert "shard_group_size" not in doc["parallel"]
    flat = autoplan.resolve(auto_doc(TINY, gpus=2), C4X8)[0]
    assert flat["parallel"]["shard_group_size"] is None
    assert validate_spec(flat).parallel.shard_group_size is None
