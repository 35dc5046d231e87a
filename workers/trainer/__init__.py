"""The built-in trainer: its loop, its checkpoints, its side of a live resize, resume and
rollback, numeric-fault guards, debug capture."""
