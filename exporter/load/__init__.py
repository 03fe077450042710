"""The load model, pure and clock-free: what one tick sees of a target in, phase, progress, ETA,
stall and finished-load records out.

Nothing here does I/O, starts a thread or reads a clock, and nothing here imports another package
of the exporter (scripts/module_graph.py --check holds that): a 15-minute load replays in
milliseconds in tests, and every other layer may read its records.
"""
