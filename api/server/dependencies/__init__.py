"""What the routes depend on: the caller (`auth.py`: API keys, permissions, the audit
trail) and the job store (`store.py`). Below the routers, so that the app that mounts
the routers and the routers themselves both import it."""
