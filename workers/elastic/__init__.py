"""Live resize inside a training process: generations of the process group, rejoin and state
handover.
"""
