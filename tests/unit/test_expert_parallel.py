"""Expert parallelism's bookkeeping without processes: which ranks form the expert-parallel
and expert-data-parallel groups, how received rows regroup by expert, which parameters
reduce where, and the tensor-parallel plan of the experts a rank holds.
tests/layouts/test_moe_layouts.py runs it on gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from kuangchao.platform.spec.parallel import ParallelSection
from kuangchao.workers.models.config import ModelConfig
from kuangchao.workers.models.factory import build_model
from kuangchao.workers.parallel.expert_parallel import ExpertComm, _expert_major, expert_plan
from kuangchao.workers.parallel.expert_wiring import is_expert
from kuangchao.workers.parallel.layout import Layout
from kuangchao.workers.parallel.tensor_parallel import block_plan


def test_expert_parallel_groups_are_consecutive_data_parallel_ranks():
    lay = Layout.of(ParallelSection(data_parallel_size=4, tensor_parallel_size=2,
                                    expert_parallel_size=2), 8)
    # dp index d sits at rank 2d + t: EP groups {d0, d1} and {d2, d3} per tp index.
    assert lay.ep_group(0) == [0, 2] and lay.ep_group(5) == [5, 7]
    assert lay.expert_dp_group(0) == [0, 4] and lay.expert_dp_group(3) == [3, 7]
    with pytest.raises(ValueError, match="do not divide 3 data-parallel ranks"):
        Layout(dp=3, ep=2)


def test_rows_received_source_by_source_regroup_expert_by_expert():
    # From source 0: 1 row for local expert 0, 2 for expert 1; from source 1: 3 and 0.
    perm = _expert_major(torch.tensor([[1, 2], [3, 0]]))
    assert perm.tolist() == [0, 3, 4, 5, 1, 2]
    assert _expert_major(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


def test_one_process_runs_every_expert_on_its_own_rows():
    comm = ExpertComm.single()
    assert comm.dp_size == 1 and comm.ep_size == 1
    table, me = comm.gather(torch.ones(4))
    assert table.shape == (1, 4) and me == 0


def test_expert_parameters_are_told_apart_by_name_and_split_like_a_swiglu_mlp():
    model = build_model(ModelConfig("moe", 1, 2, 16, 8, 32, n_experts=4, top_k=2))
    names = [n for n, _ in model.named_parameters()]
    experts = [n for n in names if is_expert(n)]
    assert len(experts) == 4 * 3 and all(".moe.experts." in n for n in experts)
    assert "blocks.0.moe.router.weight" in names and not is_expert("blocks.0.moe.router.weight")
    block = model.blocks[0]
    del block.moe.experts["0"], block.moe.experts["1"]  # EP rank 1 of 2 keeps experts 2 and 3
    plan = block_plan(block)
    assert {k for k in plan if k.startswith("moe.")} == {
        f"moe.experts.{e}.{p}" for e in (2, 3) for p in ("gate_proj", "up_proj", "down_proj")}
    assert isinstance(plan["moe.experts.2.down_proj"], RowwiseParallel)
    assert isinstance(plan["moe.experts.3.gate_proj"], ColwiseParallel)
    assert "attn.q_proj" in plan and not any(k.startswith("mlp.") for k in plan)
    assert expert_plan(block.moe).keys() <= plan.keys()
