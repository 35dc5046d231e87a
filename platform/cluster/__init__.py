"""The hardware layer: topology (nodes, GPUs, NVLink islands, leaves), the node registry,
accelerator data sheets, node join, the topology probe and node quarantine.
"""
