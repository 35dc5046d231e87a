"""A rank's token in use: checkpoint paths inside the token's prefix only, and
every refusal reported (pure: no Redis, no Ray)."""

from __future__ import annotations

import pytest
import torch

from kuangchao.platform.security.tokens import Minter, Scope, generate_key, public_pem
from kuangchao.workers import collectives
from kuangchao.workers.runtime.credentials import GuardedCheckpoints, TokenHolder


@pytest.fixture
def holder(tmp_path):
    key = generate_key()
    scope = Scope(devices=(0,), groups=("world",), checkpoint_prefix=str(tmp_path / "ckpt" / "job-1"))
    token, _ = Minter(key).mint("job-1/rank-0", "job-1", "trainer", scope,
                                {"checkpoint_read", "checkpoint_write", "all_reduce"}, 600)
    denied: list[tuple[str, str, str]] = []
    h = TokenHolder(token, public_pem(key), lambda _: False, lambda t: t,
                    lambda *a: denied.append(a))
    h.denied = denied
    try:
        yield h
    finally:
        h.stop()


def test_a_rank_saves_and_loads_inside_its_prefix(holder, tmp_path):
    ckpt = GuardedCheckpoints(tmp_path / "ckpt", "job-1", 0, 1, "hash", holder=holder)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    info = ckpt.save(1, model, opt, rank_state={"step": 1})
    assert ckpt.load(info.path, model, opt)["step"] == 1
    assert holder.denied == []


def test_traversal_and_paths_outside_the_prefix_are_refused(holder, tmp_path):
    with pytest.raises(PermissionError, match="outside"):
        GuardedCheckpoints(tmp_path / "elsewhere", "job-1", 0, 1, "hash", holder=holder)
    with pytest.raises(PermissionError, match="outside"):  # another job's folder, next door
        GuardedCheckpoints(tmp_path / "ckpt", "job-2", 0, 1, "hash", holder=holder)
    ckpt = GuardedCheckpoints(tmp_path / "ckpt", "job-1", 0, 1, "hash", holder=holder)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for path in (tmp_path / "ckpt" / "job-1" / ".." / "job-2" / "step_00000001",
                 tmp_path / "ckpt" / "job-2" / "step_00000001", "/etc"):
        with pytest.raises(PermissionError):
            ckpt.load(path, model, opt)
    reasons = [r for _, _, r in holder.denied]
    assert len(reasons) == 5 and any("contains '..'" in r for r in reasons)
    assert {i for i, _, _ in holder.denied} == {"checkpoint_read"}


def test_a_token_without_checkpoint_write_cannot_save(tmp_path):
    key = generate_key()
    scope = Scope(checkpoint_prefix=str(tmp_path / "job-1"))
    token, _ = Minter(key).mint("job-1/loader", "job-1", "data_loader", scope,
                                {"checkpoint_read"}, 600)
    h = TokenHolder(token, public_pem(key), lambda _: False, lambda t: t, lambda *a: None)
    try:
        ckpt = GuardedCheckpoints(tmp_path, "job-1", 0, 1, "hash", holder=h)
        model = torch.nn.Linear(2, 2)
        with pytest.raises(PermissionError, match="may not call checkpoint_write"):
            ckpt.save(1, model, torch.optim.SGD(model.parameters(), lr=0.1), rank_state={})
        # The same token grants no collective at all.
        with pytest.raises(PermissionError, match="may not call all_reduce"):
            collectives.permit("all_reduce")
    finally:
        h.stop()


def test_a_token_not_signed_by_the_authority_is_refused_at_once():
    key, other = generate_key(), generate_key()
    token, _ = Minter(other).mint("job-1/rank-0", "job-1", "trainer", Scope(), {"all_reduce"}, 600)
    told: list[tuple] = []
    with pytest.raises(PermissionError, match="tampered"):
        TokenHolder(token, public_pem(key), lambda _: False, lambda t: t, lambda *a: told.append(a))
    assert told and told[0][0] == "token" and told[0][2].startswith("tampered")
    for bad, reason in (("", "missing"), ("not.a.jwt", "malformed")):
        with pytest.raises(PermissionError, match=reason):
            TokenHolder(bad, public_pem(key), lambda _: False, lambda t: t, lambda *a: None)


def test_the_controller_accepts_only_a_final_checkpoint_in_the_jobs_folder():
    from kuangchao.platform.errors import KuangchaoError
    from kuangchao.platform.execution.grants import Credentials

    _, claims = Minter(generate_key()).mint("job-1/controller", "job-1", "controller",
                                            Scope(checkpoint_prefix="/ckpt/job-1"),
                                            {"checkpoint_read", "heartbeat"}, 600)
    ctl = Credentials("job-1")
    ctl.own_claims = claims
    assert str(ctl.within_job("/ckpt/job-1/step_00000010")) == "/ckpt/job-1/step_00000010"
    for elsewhere in ("/ckpt/job-2/step_00000010", "/ckpt/job-1/../job-2/step_00000010"):
        with pytest.raises(KuangchaoError, match="is not this job's"):
            ctl.within_job(elsewhere)
