"""The start-up before the weights: an interpreter reading its libraries.

A real Python server (vLLM, SGLang) spends its first 20-60 s importing: the interpreter reads
~500 MB of modules with plain `read()` and maps its extension modules' `.so` files, then sets up
NCCL, all before it opens a weight file. The simulator does the same with generated files: it
reads `--import-bytes` of them with `read()` and maps a few like shared libraries, spread over
`--startup-seconds`, and touches no weight file meanwhile.

The files live in `.sim-imports/` beside the weights directory (in its parent), not inside it:
a server's weights directory holds only its checkpoint, and no weights `include` pattern
matches their `.pyc` and `.so` names. They are generated once and shared by every simulated
server whose weights directory has that parent.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from exporter.sim.shards import PAGE_SIZE, write_random_file
from exporter.sim.stopper import Stopper
from exporter.units import MiB

IMPORTS_DIR = ".sim-imports"
MODULE_SIZE = 1 * MiB
LIBRARY_SIZE = 1 * MiB
LIBRARIES = 2


@dataclass(frozen=True)
class Imports:
    """The files one start-up reads (`read_bytes` of `modules`, with `read()`) and maps."""

    modules: tuple[Path, ...]
    libraries: tuple[Path, ...]
    read_bytes: int


def imports_dir(weights: Path) -> Path:
    return weights.parent / IMPORTS_DIR


def prepare_imports(
    directory: Path, read_bytes: int, check: Callable[[], None] = lambda: None
) -> Imports:
    """Create the module and library files that `read_bytes` of imports need, if missing."""
    if read_bytes == 0:
        return Imports((), (), 0)
    count = -(-read_bytes // MODULE_SIZE)
    modules = tuple(directory / f"module-{index:05d}.pyc" for index in range(count))
    libraries = tuple(directory / f"libsim-{index}.so" for index in range(LIBRARIES))
    directory.mkdir(parents=True, exist_ok=True)
    for paths, size in ((modules, MODULE_SIZE), (libraries, LIBRARY_SIZE)):
        for path in paths:
            if not (path.is_file() and path.stat().st_size == size):
                write_random_file(path, size, check=check)
    return Imports(modules, libraries, read_bytes)


def _map_library(path: Path) -> mmap.mmap:
    """Map a library and fault its pages in, as running its code does."""
    with path.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ)
    for offset in range(0, len(mapped), PAGE_SIZE):
        mapped[offset]
    return mapped


@contextmanager
def imported(imports: Imports, seconds: float, stopper: Stopper) -> Iterator[None]:
    """Run the import phase over `seconds`; the libraries stay mapped until the context ends."""
    with ExitStack() as mapped:
        for path in imports.libraries:
            mapped.enter_context(_map_library(path))
        began = time.monotonic()
        done = 0
        buffer = memoryview(bytearray(MODULE_SIZE))
        for path in imports.modules:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                length = min(MODULE_SIZE, imports.read_bytes - done)
                while length > 0 and (count := os.readv(fd, [buffer[:length]])):
                    done += count
                    length -= count
            finally:
                os.close(fd)
            stopper.sleep(began + seconds * done / imports.read_bytes - time.monotonic())
        stopper.sleep(began + seconds - time.monotonic())
        yield
