"""What every source's sample says of itself beside its numbers, apart from the keys in
`exporter/sources/__init__.py`: each source imports this and the keys name each source's sample
type, so with both in one module the package and its sources imported each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Health:
    """What a sample that was taken says of itself beside its numbers."""

    up: bool = True  # False: taken, but its number is unknowable (residency as `nobody`)
    reason: str | None = None  # why not up
    note: str | None = None  # what a status reader should know although it is up


FINE = Health()


class Sample:
    """The base of every source's sample (a frozen dataclass in base units): the sampler files
    a reading's `ok` and error from `health()`, the status page its note."""

    def health(self) -> Health:
        return FINE
