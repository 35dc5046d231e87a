"""Observability: the metric catalogue, JSON logs, Prometheus scrape targets."""
