"""Sharded DCP checkpoints: the manager, async save, the on-disk format and its verification,
checksummed files, export.
"""
