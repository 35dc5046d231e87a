"""Jobs: the lifecycle state machine, the Redis store, and the operations the API, CLI and `kc
train` share.
"""
