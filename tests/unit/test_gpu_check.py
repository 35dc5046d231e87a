"""bench/gpu_check.py, the parts that run without a GPU: its refusal, its peak table, its comparison.

The checks themselves need CUDA and run on a GPU machine (`python bench/gpu_check.py`).
"""

from __future__ import annotations

import pytest
import torch

from bench import gpu_check
from kuangchao.platform.cluster.hardware import CATALOG


def test_gpu_check_exits_2_with_a_message_when_no_cuda_device(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--quick"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "no CUDA device" in err and "CUDA build of torch" in err


def test_gpu_check_reads_the_catalogue_as_the_package_defines_it():
    # The GPU machine has no kuangchao install, so the script parses hardware.py; a CATALOG the
    # parser misreads would price the MFU check against the wrong peak.
    parsed = gpu_check.catalogue()
    assert set(parsed) == set(CATALOG)
    for key, acc in CATALOG.items():
        assert parsed[key]["peak_flops"] == acc.peak_flops, key
        assert parsed[key].get("mfu_ceiling", acc.mfu_ceiling) == acc.mfu_ceiling, key


@pytest.mark.parametrize("device,peak,source", [
    ("NVIDIA H200", 989e12, "catalogue h200-141gb"),
    ("NVIDIA H100 80GB HBM3", 989e12, "catalogue h100-80gb"),
    ("NVIDIA A100-SXM4-40GB", 312e12, "catalogue a100-40gb"),
    ("NVIDIA H100 PCIe", 756e12, "data sheet (h100 pcie)"),   # not the SXM part's 989
    ("NVIDIA H200 NVL", 835e12, "data sheet (h200 nvl)"),
    ("NVIDIA B200", 2.25e15, "data sheet (b200)"),
    ("NVIDIA GB200", 2.5e15, "data sheet (gb200)"),
])
def test_gpu_check_peak_for_prefers_the_variant_over_the_catalogue_family(device, peak, source):
    entry, where = gpu_check.peak_for(device, gpu_check.catalogue())
    assert (entry["peak_flops"], where) == (peak, source)


def test_gpu_check_peak_for_names_an_unknown_device():
    entry, why = gpu_check.peak_for("Tesla V100-SXM2-16GB", gpu_check.catalogue())
    assert entry == {} and "Tesla V100-SXM2-16GB" in why


def test_gpu_check_mismatches_names_each_tensor_that_differs():
    want = {"model": {"w": torch.ones(2), "b": torch.zeros(1)}, "optim": {"lr": 1e-3}}
    got = {"model": {"w": torch.tensor([1.0, 2.0]), "b": torch.zeros(1)}, "optim": {"lr": 1e-3}}
    assert gpu_check._mismatches(want, got) == [".model.w"]
    assert gpu_check._mismatches(want, want) == []
