"""Security: capability tokens and their authority, API keys, per-job Redis users, the audit trail.
"""
