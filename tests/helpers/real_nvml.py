"""What the real NVML on this host says, asked through `pynvml` directly, without the exporter.

Tests that touch the real library compare the exporter's answer with this one, so they hold on a
host without a driver (both say "unavailable", for the same reason) and on a GPU host (both list
the same GPUs) alike, instead of assuming there is no GPU here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pynvml


@dataclass(frozen=True)
class RealGpu:
    index: int
    uuid: str
    name: str
    total_bytes: int


@dataclass(frozen=True)
class RealNvml:
    error: pynvml.NVMLError | None  # why nvmlInit failed or no GPU is seen; None when usable
    driver_version: str = ""
    gpus: tuple[RealGpu, ...] = ()

    @property
    def present(self) -> bool:
        return self.error is None and bool(self.gpus)


@functools.cache
def real_nvml() -> RealNvml:
    """Once per test session: init, read identities and totals, shut down (refcount balanced)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return RealNvml(err)
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(
                RealGpu(
                    index,
                    _text(pynvml.nvmlDeviceGetUUID(handle)),
                    _text(pynvml.nvmlDeviceGetName(handle)),
                    int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                )
            )
        return RealNvml(None, _text(pynvml.nvmlSystemGetDriverVersion()), tuple(gpus))
    except pynvml.NVMLError as err:
        return RealNvml(err)
    finally:
        pynvml.nvmlShutdown()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
