"""The built-in trainer: its loop, resume and rollback, numeric-fault guards, debug capture."""
