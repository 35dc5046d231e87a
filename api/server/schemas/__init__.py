"""The REST API's response models: what each route returns, as pydantic models,
so that /openapi.json documents every answer and FastAPI checks it on the way out.

One module per resource family: `jobs` (jobs, events, logs, the loss curve),
`cluster` (nodes, queues, scrape targets, health), `access` (keys, whoami,
audit) and `debug` (debug reports and profiles); `common` holds the bases.
"""
