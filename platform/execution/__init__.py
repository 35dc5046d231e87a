"""Execution: the per-job controller, its worker placement groups and grants, heartbeat watch,
recovery and live resize.
"""
