"""Moved to `kuangchao.platform.protocol.checkpoint`, the torch-free wire formats.

Kept only for api/cli/checkpoint.py (another engineer's folder), which imports
these four names from here; remove this file once it imports the protocol module.
"""

from kuangchao.platform.protocol.checkpoint import MANIFEST, read_manifest, step_of, verify

__all__ = ["MANIFEST", "read_manifest", "step_of", "verify"]
