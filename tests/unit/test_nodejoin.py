"""`kc node join`: topology from nvidia-smi or flags, and the ray start arguments."""

import json

import pytest

from kuangchao.platform.cluster.nodejoin import (
    JoinOptions,
    islands_from_topo_matrix,
    node_for,
    ray_start_args,
)
from kuangchao.platform.errors import TopologyError

TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tSYS\tSYS\tPXB\t0-31\t0
GPU1\tNV12\t X \tSYS\tSYS\tPXB\t0-31\t0
GPU2\tSYS\tSYS\t X \tNV12\tSYS\t32-63\t1
GPU3\tSYS\tSYS\tNV12\t X \tSYS\t32-63\t1
NIC0\tPXB\tPXB\tSYS\tSYS\t X

Legend:
  X    = Self
"""


def test_islands_are_the_nvlink_connected_gpu_groups():
    assert islands_from_topo_matrix(TOPO) == ((0, 1), (2, 3))


def test_flags_describe_the_node_when_there_is_no_nvidia_smi(monkeypatch):
    monkeypatch.setattr("kuangchao.platform.cluster.nodejoin.shutil.which", lambda _: None)
    opts = JoinOptions(address="h:6379", name="gpu-1", leaf="leaf-3", spine="s0", gpus=4,
                       nvlink="0.1_2.3", cpus=16)
    node = node_for(opts)
    assert node.islands == ((0, 1), (2, 3))
    args = ray_start_args(opts, node)
    assert "--num-gpus=4" in args and "--num-cpus=16" in args
    assert ("--labels=kc.io/node=gpu-1,kc.io/leaf=leaf-3,kc.io/nvlink=0.1_2.3,kc.io/spine=s0"
            in args)
    resources = json.loads(next(a for a in args if a.startswith("--resources="))[12:])
    assert resources == {"kc_gpu_0": 1, "kc_gpu_1": 1, "kc_gpu_2": 1, "kc_gpu_3": 1}


def test_detected_gpus_win_and_a_contradicting_flag_is_refused(monkeypatch):
    monkeypatch.setattr("kuangchao.platform.cluster.nodejoin.detect_gpus", lambda: (4, ((0, 1), (2, 3))))
    assert node_for(JoinOptions(address="h:1", name="n", leaf="l")).gpus == 4
    with pytest.raises(TopologyError, match="nvidia-smi shows 4 GPUs"):
        node_for(JoinOptions(address="h:1", name="n", leaf="l", gpus=8))
