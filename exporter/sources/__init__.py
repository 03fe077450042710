"""Data sources: each samples one thing in base units and knows nothing of Prometheus."""
