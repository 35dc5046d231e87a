"""Wire formats shared by the control plane and the training processes: the heartbeat
beat, the process-group generation, the checkpoint manifest and its verification.

Both sides import these, so nothing here imports torch, Ray or Redis
(`tests/unit/test_architecture.py` checks): the controller, the API and the
CLI read the formats without loading a training stack.
"""
