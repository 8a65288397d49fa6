"""Observability: a Prometheus endpoint served from the training process, and Zeus's push metrics."""
