"""The Python SDK: a typed client for the REST API."""
