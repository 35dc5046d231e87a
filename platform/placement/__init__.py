"""Placement: where a job's ranks go. The solver (`solver.py`) packs tensor-parallel
groups into NVLink islands and replicas under leaf switches, on the GPU types a job
accepts; `pools.py` groups nodes by type and picks a one-type job's pool; `score.py`
rates a plan; `index.py` keeps free capacity by leaf so that the many placements
of one scheduling cycle do not rescan every node. Pure: the scheduler's plugins and `kc plan` call it."""
