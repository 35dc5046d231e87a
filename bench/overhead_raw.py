"""The limit no orchestrator can beat: `bench.harness.bench_loop` under bare torchrun.

`bench/overhead.py` starts it as

    torchrun --standalone --nnodes 1 --nproc-per-node 2 bench/overhead_raw.py SPEC.json OUT

No Ray, no platform: torchrun's elastic agent forks the ranks on this machine,
each joins a gloo process group through torchrun's rendezvous (env://), runs the
same loop as kuangchao's and Ray Train's ranks, and writes its own timing
(`harness.rank_file(OUT, rank)`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` when run as a script

import torch.distributed as dist  # noqa: E402

from bench.harness import _write_json, bench_loop, rank_file  # noqa: E402
from kuangchao.platform.spec.jobspec import validate_spec  # noqa: E402


def main() -> None:
    spec_path, out = sys.argv[1], sys.argv[2]
    spec = validate_spec(json.loads(Path(spec_path).read_text()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    try:
        timing = bench_loop(spec, rank, world)
    finally:
        dist.destroy_process_group()
    _write_json(str(rank_file(out, rank)), timing)


if __name__ == "__main__":
    main()
