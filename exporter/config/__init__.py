"""The exporter's configuration: the YAML file and the single-target flags, read into frozen
dataclasses with one-line errors.
"""
