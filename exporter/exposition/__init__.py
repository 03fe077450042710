"""What the exporter shows: the metric families (collector.py, the only module that knows
metric names), the /api/v1 documents (api.py, built by api_build.py), the kubelet's probes
(liveness.py) and the HTTP server that serves them all (http/).
"""
