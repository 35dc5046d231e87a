"""The job operations the API, the CLI and `kc train` share: submit, cancel, scale, views."""
