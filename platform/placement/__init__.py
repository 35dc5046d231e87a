"""Placement: where a job's ranks go. The solver (`solver.py`) packs tensor-parallel
groups into NVLink islands and replicas under leaf switches, on the GPU types a job
accepts; `pools.py` groups nodes by type and picks a one-type job's pool; `score.py`
rates a plan. Pure: the scheduler's plugins and `kc plan` call it."""
