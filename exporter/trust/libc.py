"""The C library of this process, for the system calls Python's `os` module lacks.

`ctypes.CDLL(None)` opens the process's own symbol table, which holds libc's functions: no
`ctypes.util.find_library("c")`, which runs `ldconfig -p` in a child process at each call. Three
modules did so at import, so every process importing them (the simulator's server too) showed
short-lived children that a look at its tree could take for its ranks or workers.
"""

from __future__ import annotations

import ctypes

LIBC = ctypes.CDLL(None, use_errno=True)
