"""The words the exporter speaks: every label value and config choice, spelled once.

StrEnums compare equal to their strings, so they go into label values, JSON and SQLite unchanged,
and a misspelt member is an AttributeError at import instead of a series nobody queries.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """Where a target is in its load (`model_load_phase{phase}`)."""

    DOWN = "down"
    STARTING = "starting"
    LOADING_WEIGHTS = "loading_weights"
    INITIALIZING = "initializing"
    READY = "ready"
    FAILED = "failed"

    @property
    def in_progress(self) -> bool:
        return self in IN_PROGRESS


IN_PROGRESS = frozenset({Phase.STARTING, Phase.LOADING_WEIGHTS, Phase.INITIALIZING})


class TargetRole(StrEnum):
    """What a target's server is to its model (`model_load_target_info{role}`, `role:`)."""

    SERVER = "server"  # it serves its endpoint: one host's server, or a multi-node model's head
    # One node of a model served over several hosts that runs no API server of its own (vLLM's
    # `--headless`, SGLang's `--node-rank` above 0): the head serves; it is ready when its part
    # of the model is up, as its own log says.
    FOLLOWER = "follower"


class Outcome(StrEnum):
    """How a finished load ended (`model_load_duration_seconds{outcome}`)."""

    READY = "ready"
    FAILED = "failed"


class Cache(StrEnum):
    """Page-cache temperature of the weights at a load's start (`{cache}`)."""

    COLD = "cold"
    WARM = "warm"
    MIXED = "mixed"
    UNKNOWN = "unknown"
    BYPASS = "bypass"  # the loader read around the page cache: residency says nothing of it


class StorageKind(StrEnum):
    """What holds a target's weights (`/api/v1/status` `storage`): what can be measured differs."""

    BLOCK = "block"  # a filesystem on block devices (ext4, xfs, ...): diskstats, page cache
    BTRFS = "btrfs"  # its devices under /sys/fs/btrfs/FSID/devices, not its anonymous st_dev
    IMAGE = "image"  # a read-only image filesystem (squashfs, erofs), on a device or a file
    OVERLAY = "overlay"  # layers over other filesystems; the page cache is the real file's
    MEMORY = "memory"  # tmpfs, ramfs, hugetlbfs: in memory by construction, no device
    FUSE = "fuse"  # a userspace daemon: no byte counter, its own cache rules
    NFS = "nfs"  # counted per mount in mountstats
    LUSTRE = "lustre"  # counted per filesystem in llite stats
    CEPHFS = "cephfs"  # counted per client in the ceph debugfs metrics
    ZFS = "zfs"  # its ARC serves reads, not the page cache
    OTHER = "other"  # none of these: nothing known to count its reads


class ServerKind(StrEnum):
    """Which model server a target runs (`model_load_target_info{server}`): the servers built
    into exporter/servers, and UNKNOWN. The kinds there are the full list (a module added there
    brings its own name), so targets, samples and config hold a kind as its `str`."""

    SGLANG = "sglang"
    VLLM = "vllm"
    LLAMACPP = "llamacpp"
    TGI = "tgi"
    TRITON = "triton"
    UNKNOWN = "unknown"


class ProbeKind(StrEnum):
    """How readiness is asked (`endpoint.probe`)."""

    COMPLETION = "completion"
    HEALTH = "health"
    MODELS = "models"
    TCP = "tcp"


class ProbeResult(StrEnum):
    """What one probe found (`model_load_endpoint_probes_total{result}`)."""

    READY = "ready"
    REFUSED = "refused"
    TIMEOUT = "timeout"
    HTTP_ERROR = "http_error"
    BAD_RESPONSE = "bad_response"
    ERROR = "error"


# `log.format`: a server kind, or AUTO: the first line only one server's format writes decides.
AUTO = "auto"


class LogEncoding(StrEnum):
    """How a log file wraps the server's lines (`log.encoding`): as written, or in a container
    runtime's records (Docker's json-file driver; the CRI format of /var/log/pods)."""

    PLAIN = "plain"
    DOCKER = "docker"
    CRI = "cri"


class Signal(StrEnum):
    """What drove a load's weights progress (`/api/v1/status` progress_source)."""

    WEIGHT_FILES = "weight_files"  # the weight files consumed, file by file
    GPU_PCIE = "gpu_pcie"  # bytes the tree's GPUs received since the first weight file
    GPU_MEMORY = "gpu_memory"  # GPU memory the tree holds past its CUDA contexts
    PAGE_CACHE = "page_cache"  # residency growth of the weight files
    PROCESS_READS = "process_reads"  # storage bytes the tree read
    PROCESS_READ_CHARS = "process_read_chars"  # bytes through read() (rchar)
    DISK_READS = "disk_reads"  # the weights' devices, host-wide
    LOG_SHARDS = "log_shards"  # the shards the server's log counted


class Step(StrEnum):
    """The fine step a server's own log says it is in (`model_load_step{step}`)."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    COMPILE = "compile"
    CUDA_GRAPH = "cuda_graph"
    WARMUP = "warmup"
    NONE = "none"


class Activity(StrEnum):
    """What a load's process visibly does (`/api/v1/status` `activity`, the stall reasons): which
    of these stopped and which still move tells a stall in compile from a dead NFS mount."""

    WEIGHT_BYTES = "weight_bytes"  # of the weight files consumed (or the weights progress)
    STORAGE_READS = "storage_reads"  # storage bytes the tree read (else the weights' devices)
    LOG_LINES = "log_lines"  # lines the server's log wrote
    GPU_MEMORY = "gpu_memory"  # GPU memory the tree holds, up or down
    CPU = "cpu"  # the tree's CPU time: not progress (a hung collective spins), but a clue
