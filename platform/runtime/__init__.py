"""Runtime: the Ray actors that host the control plane, and what starts it (`kc up`, `kc control-
plane start`, `kc train`, `kc doctor`).
"""
