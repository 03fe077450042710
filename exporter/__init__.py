"""model-load-exporter: what a large-model inference server is doing while it loads."""

__version__ = "0.1.0"
