"""The fake NVML against the real `pynvml` module, so the fake cannot drift from what it fakes.

Everything the exporter's GPU source (and the probe) touches on the module must exist in both,
with the same call signatures, the same error classes, the same structs, and the same C
functions behind the calls the fake models as missing on an older driver. The field-value
struct's members (`x.nvmlReturn`) look like module names; they are checked against the struct.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pynvml
import pytest
from helpers.fake_nvml import (
    FIELD_VALUES,
    MEMORY_V2,
    PROCESSES_V3,
    VALUE_MEMBERS,
    FakeGpu,
    FakeNvml,
    FakeProcess,
    h200_node,
)

from exporter.sources import gpu

ROOT = Path(__file__).resolve().parents[1]
USERS = (ROOT / "exporter" / "sources" / "gpu.py", ROOT / "scripts" / "nvml_probe.py")
NVML_NAME = re.compile(r"^(nvml[A-Z]\w*|NVML\w*)$")
FIELD_VALUE_MEMBERS = [name for name, _ in pynvml.c_nvmlFieldValue_t._fields_]
# nvmlValueType_t as nvml.h orders it, by the binding's names.
VALUE_TYPES = [
    "NVML_VALUE_TYPE_DOUBLE",
    "NVML_VALUE_TYPE_UNSIGNED_INT",
    "NVML_VALUE_TYPE_UNSIGNED_LONG",
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG",
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG",
    "NVML_VALUE_TYPE_SIGNED_INT",
    "NVML_VALUE_TYPE_UNSIGNED_SHORT",
]


def names_used(path: Path) -> set[str]:
    """NVML names a module reaches for: `x.nvmlFoo` attributes and "NVMLError_Foo" strings."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and NVML_NAME.match(node.attr):
            if node.attr not in FIELD_VALUE_MEMBERS:
                found.add(node.attr)
        elif isinstance(node, ast.Constant) and NVML_NAME.match(str(node.value)):
            found.add(str(node.value))
    return found


def fake_functions() -> dict[str, object]:
    return {
        name: getattr(FakeNvml([]), name)
        for name in dir(FakeNvml)
        if name.startswith("nvml") and callable(getattr(FakeNvml, name))
    }


def shape(function: object) -> list[tuple[str, object, object]]:
    """Parameter names, kinds and defaults: what a caller depends on, annotations aside."""
    return [
        (p.name, p.kind, p.default)
        for p in inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("path", USERS, ids=lambda p: p.name)
def test_every_name_the_exporter_uses_exists_in_both(path: Path) -> None:
    used = names_used(path)
    assert "nvmlDeviceGetMemoryInfo" in used  # the parse found the calls at all
    fake = FakeNvml([])
    assert sorted(n for n in used if not hasattr(pynvml, n)) == []
    assert sorted(n for n in used if not hasattr(fake, n)) == []


@pytest.mark.parametrize("name", sorted(fake_functions()))
def test_fake_functions_have_the_real_signatures(name: str) -> None:
    assert shape(fake_functions()[name]) == shape(getattr(pynvml, name))


def test_fake_errors_and_constants_are_the_real_objects() -> None:
    shared = [n for n in vars(FakeNvml) if n.startswith("NVML") or n.startswith("nvmlMemory")]
    assert "NVMLLibraryMismatchError" in shared and "nvmlMemory_v2" in shared
    assert [n for n in shared if getattr(FakeNvml, n) is not getattr(pynvml, n)] == []
    # Not an NVMLError: code that catches only NVMLError lets it through (see test_gpu).
    assert not issubclass(pynvml.NVMLLibraryMismatchError, pynvml.NVMLError)


def test_memory_structs_are_the_real_ones_with_their_fields() -> None:
    nvml = FakeNvml(h200_node(1))
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    v1 = nvml.nvmlDeviceGetMemoryInfo(handle)
    v2 = nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    assert type(v1) is pynvml.c_nvmlMemory_t
    assert type(v2) is pynvml.c_nvmlMemory_v2_t
    assert [f[0] for f in pynvml.c_nvmlMemory_t._fields_] == ["total", "free", "used"]
    assert [f[0] for f in pynvml.c_nvmlMemory_v2_t._fields_] == [
        "version",
        "total",
        "reserved",
        "free",
        "used",
    ]
    assert v2.version == pynvml.nvmlMemory_v2


def test_process_entries_have_the_real_fields() -> None:
    nvml = FakeNvml(h200_node(1))
    nvml.gpus[0].processes = [FakeProcess(7, 5), FakeProcess(8, None)]
    nvml.nvmlInit()
    listed = nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(0))
    real = pynvml.nvmlStructToFriendlyObject(pynvml.c_nvmlProcessInfo_t())
    assert [sorted(vars(p)) for p in listed] == [sorted(vars(real))] * 2
    assert [(p.pid, p.usedGpuMemory) for p in listed] == [(7, 5), (8, None)]


def test_field_values_are_the_real_structs_with_the_value_where_its_type_says() -> None:
    nvml = FakeNvml(
        [FakeGpu("GPU-a", pcie_rx_bytes=2**32 + 7), FakeGpu("GPU-b", pcie_rx_bytes=None)]
    )
    nvml.gpus[0].pcie_value_type = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    fields = [pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES]
    rx, tx = nvml.nvmlDeviceGetFieldValues(handle, fields)
    [absent] = nvml.nvmlDeviceGetFieldValues(nvml.nvmlDeviceGetHandleByIndex(1), fields[:1])

    assert type(rx) is pynvml.c_nvmlFieldValue_t and type(rx.value) is pynvml.c_nvmlValue_t
    assert FIELD_VALUE_MEMBERS == [
        "fieldId", "scopeId", "timestamp", "latencyUsec", "valueType", "nvmlReturn", "value",
    ]  # fmt: skip
    assert (rx.fieldId, rx.nvmlReturn, rx.valueType) == (198, pynvml.NVML_SUCCESS, 1)
    assert rx.value.uiVal == 7  # 32 bits wide: wrapped at 4 GiB
    # A field the GPU lacks says so in its own nvmlReturn; the call itself succeeds.
    assert (tx.fieldId, tx.nvmlReturn) == (197, pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert absent.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_the_source_reads_the_union_member_each_value_type_names() -> None:
    """The source's own field id and its type -> member table against the binding's."""
    assert gpu.PCIE_RX_BYTES_FIELD == pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES == 198
    union = [name for name, _ in pynvml.c_nvmlValue_t._fields_]
    assert [getattr(pynvml, name) for name in VALUE_TYPES] == list(range(len(VALUE_TYPES)))
    assert list(gpu.VALUE_MEMBERS) == union  # nvml.h orders the union as it orders the types
    for value_type, (member, _) in VALUE_MEMBERS.items():
        assert gpu.VALUE_MEMBERS[value_type] == member


def test_the_modelled_c_functions_are_the_ones_the_binding_calls() -> None:
    """The fake's "older driver" lacks C functions by name: they must be what pynvml calls."""
    memory = inspect.getsource(pynvml.nvmlDeviceGetMemoryInfo)
    assert f'"{MEMORY_V2}"' in memory and "if not version" in memory
    listing = inspect.getsource(pynvml.nvmlDeviceGetComputeRunningProcesses_v3)
    assert f'"{PROCESSES_V3}"' in listing
    unversioned = pynvml.nvmlDeviceGetComputeRunningProcesses
    assert unversioned.__wrapped__.__code__.co_names == ("nvmlDeviceGetComputeRunningProcesses_v3",)
    assert inspect.getsource(pynvml.throwOnVersionMismatch).count("NVMLLibraryMismatchError") == 1
    fields = inspect.getsource(pynvml.nvmlDeviceGetFieldValues)
    assert f'_nvmlGetFunctionPointer("{FIELD_VALUES}")' in fields
    assert "_nvmlCheckReturn(ret)" in fields and "nvmlReturn" not in fields  # fields unchecked


def test_shutdown_without_init_raises_uninitialized_in_both() -> None:
    """libnvidia-ml counts inits; nobody in this test process holds one now."""
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlShutdown()
    nvml = FakeNvml([])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()
    nvml.nvmlInit()
    nvml.nvmlInit()
    nvml.nvmlShutdown()
    assert nvml.initialized
    nvml.nvmlShutdown()
    assert not nvml.initialized
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
