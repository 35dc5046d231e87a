"""The REST API: the FastAPI app, its routers and auth, `/metrics`, the web console's static files.
"""
