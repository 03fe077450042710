"""Tools beside the product: a stand-in model server, its shard files and log writers, the demo.

Nothing under `exporter.sim` is imported by `serve`: the exporter on a GPU host loads none of it.
"""
