"""The operator's commands: `serve` (the exporter), `wait`, `status`, `prewarm`, `history` and
`mcp`, and what the client commands share (exporter/commands/client.py asks a running
exporter, terminal.py prints for a person, exits.py holds the exit codes and usage errors).

The cli imports one of them, lazily: `serve` loads neither the client side nor `rich`.
"""
