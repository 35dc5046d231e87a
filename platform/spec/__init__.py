"""The job spec: what a user writes (pydantic), its parallel layout, its text forms, and the
elastic range it allows.
"""
