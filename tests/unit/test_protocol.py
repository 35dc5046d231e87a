"""The torch-free wire formats (platform/protocol/): generations round-trip through
their JSON, and a job's checkpoints are listed and verified without a CheckpointManager."""

import json
from contextlib import contextmanager
from pathlib import Path

from kuangchao.platform.protocol import checkpoint
from kuangchao.platform.protocol.generation import Generation
from kuangchao.platform.protocol.heartbeat import Beat


def test_a_generation_survives_its_json_as_redis_stores_it():
    gen = Generation(gen=3, world_size=4, replicas=2, accum=2, host="10.0.0.1", port=29500,
                     ranks={0: 0, 2: 1}, joining=(2, 3), cause="resize")
    assert Generation.from_json(json.loads(json.dumps(gen.to_json()))) == gen
    assert gen.ready_key(1) == "gen3/ready/1"
    # With the job's keeper plan (peer memory); one published before it had none.
    plan = {"keepers": {"n2": "kc-keeper-j-n2"}, "node_of": {"0": "n0", "1": "n2"},
            "namespace": "kc"}
    with_plan = Generation(**{**gen.__dict__, "keepers": plan})
    assert Generation.from_json(json.loads(json.dumps(with_plan.to_json()))) == with_plan
    old = {k: v for k, v in gen.to_json().items() if k != "keepers"}
    assert Generation.from_json(old).keepers is None


def test_a_beat_with_the_separator_in_its_phase_still_decodes():
    beat = Beat(rank=1, step=7, phase="fwd|bwd", pid=42, node="n1", ts=10.0, progress_ts=9.0, seq=3)
    assert Beat.decode(1, beat.encode().encode()) == beat._replace(phase="fwd_bwd")


def _commit(folder: Path, step: int, payload: bytes) -> Path:
    """A checkpoint folder as the manager leaves it: one file and a manifest listing it."""
    path = folder / checkpoint.step_dir_name(step)
    path.mkdir(parents=True)
    (path / "rank_0.pt").write_bytes(payload)
    digest = checkpoint.checksum_file(path / "rank_0.pt")
    (path / checkpoint.MANIFEST).write_text(json.dumps({
        "format": checkpoint.FORMAT_VERSION, "step": step, "checksum": checkpoint.CHECKSUM,
        "files": {"rank_0.pt": {"bytes": len(payload), checkpoint.CHECKSUM: digest}}}))
    return path


def test_a_jobs_verified_checkpoints_come_newest_first_and_skip_broken_ones(tmp_path):
    folder = checkpoint.job_dir(tmp_path, "job-1")
    for step in (1, 2, 3):
        _commit(folder, step, b"state %d" % step)
    (folder / checkpoint.step_dir_name(3) / "rank_0.pt").write_bytes(b"torn")  # truncated
    (folder / ".step_00000004.tmp").mkdir()  # a write in progress: no manifest, not listed
    assert [p.name for p in checkpoint.committed(folder)] == ["step_00000001", "step_00000002",
                                                              "step_00000003"]
    assert [m["step"] for _, m in checkpoint.verified(folder)] == [2, 1]
    path, manifest = checkpoint.latest_verified(folder)
    assert (checkpoint.step_of(path), manifest["step"]) == (2, 2)


def test_the_hold_is_entered_around_each_verification(tmp_path):
    folder = checkpoint.job_dir(tmp_path, "job-1")
    for step in (1, 2):
        _commit(folder, step, b"x")
    held = []

    @contextmanager
    def hold(path):
        held.append(path.name)
        yield

    assert checkpoint.latest_verified(folder, hold=hold)[1]["step"] == 2
    assert held == ["step_00000002"]  # the newest verified, so nothing older was read


def test_a_job_without_checkpoints_has_no_latest(tmp_path):
    assert checkpoint.latest_verified(checkpoint.job_dir(tmp_path, "none")) is None
