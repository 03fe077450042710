"""A model server's log: found, followed, decoded and read for step markers.

find.py finds a server's log from its process alone, files.py follows a log file like
`tail -F`, journal.py follows a systemd unit's journal, decode.py turns a file's bytes (plain
text or a container runtime's records) into timed lines and markers.py turns lines into step
events, by the rows each server module fills in (exporter/servers/logformat.py). The source that
drives them per target is exporter/sources/logs.py; which log a target follows, from when and
with whose rights is the runtime's (exporter/runtime/logfollow.py).
"""
