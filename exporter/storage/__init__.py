"""What stands under a target's weights, and what can be measured there.

mounts.py places a path on its mount, backing.py follows a mount down to its block devices (or
names why it has none), below.py finds the real file under an overlay or a FUSE passthrough,
watched.py keeps the host-wide sources' weight paths placed. weighttree.py walks a target's
weight files, pagecache.py measures their page-cache residency (cachestat, mincore), cachectl.py
puts them into the page cache or takes them out, and ownedfiles.py opens them with their owner's
rights for `prewarm`. What residency and reads mean on a target's storage is a per-target source
of its own (exporter/sources/storage.py).
"""
