"""Parallel wiring on a DeviceMesh: the step engine and its data-parallel half, layout,
pipelines, tensor parallelism, communication hooks and the clock they report to,
mixed precision.
"""
