"""Parallel wiring on a DeviceMesh: the step engine, layout, pipelines, tensor parallelism,
communication hooks, mixed precision.
"""
