"""Acting for other users safely: with a discovered process's own rights (asprocess.py), opening
only bounded regular files an untrusted path names (safeio.py), making their text fit to show
(untrusted.py), and the C library calls Python lacks (libc.py).

The lowest layer but the load model: discovery, sources, storage and logs all touch other users'
files through it.
"""
