"""Scheduling: the cycle over a snapshot, admission policies, queues and quotas, the placement
solver and its score, orphaned jobs.
"""
