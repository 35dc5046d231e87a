"""Live resize inside a training process, below the trainer: joining a generation of the
process group, leaving the old one, and handing the state over by broadcast. The
trainer's own side of a resize is workers/trainer/live_resize.py.
"""
