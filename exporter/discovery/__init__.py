"""Finding model servers on this host with no configuration: scanning /proc (scan.py), reading a
server's own command line, config file and environment (serverargs.py), seeing its files as it
sees them (view.py), where to probe it (probehost.py), which weights it loads (weights.py), what
a found server is as a target (found.py), and counting what was refused (refusals.py).
"""
