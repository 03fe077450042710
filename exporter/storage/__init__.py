"""What stands under a target's weights, and what can be measured there.

mounts.py places a path on its mount, backing.py follows a mount down to its block devices (or
names why it has none), below.py finds the real file under an overlay or a FUSE passthrough,
description.py says per target what residency and reads mean on that storage, watched.py keeps
the host-wide sources' weight paths placed. weighttree.py walks a target's weight files and
pagecache.py measures their page-cache residency (cachestat, mincore).
"""
