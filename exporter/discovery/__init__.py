"""Finding model servers on this host with no configuration: scanning /proc (scan.py), reading a
server's own command line, config file and environment (serverargs.py), and counting what was
refused (refusals.py).
"""
