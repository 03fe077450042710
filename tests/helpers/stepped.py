"""The sampler's loops run when a test says, on the test's thread, instead of on timer threads.

`Sampler(..., periodic=SteppedLoops(...))` makes every loop the sampler registers (each source's,
the tracker tick) a `SteppedLoop`: the sampler works as it does in the exporter (readings, the
`after` callbacks, replaced and discarded loops), only nothing runs until `round()`. So a fake
clock decides every timestamp and a whole run replays the same each time. How often each loop
would run (`every`) is not modelled: rounds are one sample interval apart.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from exporter.runtime.sampler import Periodic


class SteppedLoop(Periodic):
    """A loop that runs only when stepped (its timer thread is never started)."""

    def __init__(
        self, name: str, every: float | Callable[[], float], fn: Callable[[], object]
    ) -> None:
        super().__init__(name, every, fn)
        self.fn = fn
        self.stopped = False

    def stop(self) -> None:
        super().stop()
        self.stopped = True


class SteppedLoops:
    """Makes the sampler's loops and runs them a round at a time."""

    def __init__(self, last: Collection[str] = ()) -> None:
        """`last`: loops that run after all the others in a round (the tracker tick, which
        reads what the sources sampled)."""
        self._last = frozenset(last)
        self._loops: list[SteppedLoop] = []

    def __call__(
        self, name: str, every: float | Callable[[], float], fn: Callable[[], object]
    ) -> Periodic:
        loop = SteppedLoop(name, every, fn)
        self._loops.append(loop)
        return loop

    def round(self) -> None:
        """Each live loop once, in the order made, `last` ones at the end; a loop made during
        the round runs from the next one."""
        self._loops = [loop for loop in self._loops if not loop.stopped]
        first = [loop for loop in self._loops if loop.name not in self._last]
        for loop in first + [loop for loop in self._loops if loop.name in self._last]:
            if not loop.stopped:
                loop.fn()
