"""The storage layer: object-store URLs (s3:// and other fsspec URLs) for checkpoints,
profiles and data, their filesystems and credentials, and the node-local mirror
through which the POSIX checkpoint code reads and writes them.
"""
