"""The weight files a discovered server loads, as paths this exporter can open: a local path,
every part of a split GGUF, a hub id's snapshot in the process's own Hugging Face cache, the
models of a model repository. Looked at with the process's rights (discovery/scan.py)."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Mapping

from exporter.discovery.refusals import Refuser
from exporter.discovery.serverargs import Evidence, Recognised
from exporter.discovery.view import ProcessView
from exporter.trust.safeio import Refused, open_checked, read_regular

MAX_REF_BYTES = 4096
MAX_SNAPSHOTS = 1024  # snapshot directories looked at for the newest
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?\Z")
_COMMIT = re.compile(r"[0-9a-f]{40}\Z")
GGUF_SPLIT = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf\Z")
# Where huggingface_hub looks, in its own order; TRANSFORMERS_CACHE for older transformers.
_HUB_CACHE_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE")


def repository_models(path: str) -> tuple[str, ...]:
    """The models of a model repository (Triton's): its directories holding a config.pbtxt or
    a numbered version directory, at most MAX_SNAPSHOTS entries looked at."""
    models = []
    try:
        with os.scandir(path) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_SNAPSHOTS:
                    break
                if entry.is_dir(follow_symlinks=False) and _is_model_dir(entry.path):
                    models.append(entry.name)
    except OSError:
        return ()
    return tuple(sorted(models))


def _is_model_dir(path: str) -> bool:
    try:
        with os.scandir(path) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_SNAPSHOTS:
                    break
                if entry.name == "config.pbtxt" or (entry.name.isdigit() and entry.is_dir()):
                    return True
    except OSError:
        pass
    return False


def _usable(path: str, what: str, refuse: Refuser) -> bool | None:
    """Whether the process may open `path` (True), it is missing (None), or refused (False)."""
    try:
        fd, _ = open_checked(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR) and not isinstance(exc, Refused):
            return None
        refuse.of(exc, what)
        return False
    os.close(fd)
    return True


def weights_of(
    recognised: Recognised, view: ProcessView, environ: Mapping[str, str] | None, refuse: Refuser
) -> tuple[tuple[str, ...], list[Evidence]]:
    """The weight paths a server loads, as paths this exporter can open, and why."""
    model = recognised.model
    if model is None:
        return (), [Evidence("weights", "unknown", "no model argument")]
    try:
        path = view.host_path(model)
    except OSError as exc:
        refuse.of(exc, model)
        return (), [Evidence("weights", "refused", _refusal(exc))]
    usable = _usable(path, model, refuse) if path is not None else None
    if usable is False:
        return (), [Evidence("weights", "refused", "not readable with the process's rights")]
    if path is not None and usable:
        if recognised.command.model_is == "file":
            return _gguf_parts(path, refuse), [Evidence("weights", path, "the model file")]
        return (path,), [Evidence("weights", path, "local path")]
    if recognised.command.model_is == "model" and _HUB_ID.match(model):
        return _hub_snapshot(model, recognised, view, environ, refuse)
    return (), [Evidence("weights", "not found", f"{model} does not exist (yet)")]


def _refusal(exc: OSError) -> str:
    return exc.reason.replace("_", " ") if isinstance(exc, Refused) else str(exc.strerror)


def _gguf_parts(path: str, refuse: Refuser) -> tuple[str, ...]:
    """All files of a split GGUF (`x-00001-of-00003.gguf`); llama.cpp loads them together."""
    split = GGUF_SPLIT.match(path)
    if not split:
        return (path,)
    stem, total = split.group(1), min(int(split.group(3)), MAX_SNAPSHOTS)
    parts = (f"{stem}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1))
    return tuple(p for p in parts if _usable(p, p, refuse))


def _hub_snapshot(
    repo_id: str,
    recognised: Recognised,
    view: ProcessView,
    environ: Mapping[str, str] | None,
    refuse: Refuser,
) -> tuple[tuple[str, ...], list[Evidence]]:
    """A hub id's snapshot in the process's own Hugging Face cache."""
    env = environ or {}
    caches: list[tuple[str, str]] = []
    if recognised.hub_cache:
        caches.append((recognised.hub_cache, "the server's cache directory argument"))
    caches.extend((env[var], f"environment {var}") for var in _HUB_CACHE_VARS if env.get(var))
    if env.get("HF_HOME"):
        caches.append((f"{env['HF_HOME']}/hub", "environment HF_HOME"))
    if env.get("XDG_CACHE_HOME"):
        caches.append((f"{env['XDG_CACHE_HOME']}/huggingface/hub", "environment XDG_CACHE_HOME"))
    if view.home:
        caches.append((f"{view.home}/.cache/huggingface/hub", "default under the owner's home"))
    folder = "models--" + repo_id.replace("/", "--")
    for cache, source in caches:
        try:
            host = view.host_path(f"{cache}/{folder}")
        except OSError as exc:
            refuse.of(exc, cache)
            continue
        if host is None or not _usable(host, cache, refuse) or not os.path.isdir(host):
            continue
        snapshot, how = _revision_snapshot(host, recognised.revision, refuse)
        if snapshot is not None:
            return (snapshot,), [Evidence("weights", snapshot, f"hub cache from {source}; {how}")]
    searched = ", ".join(cache for cache, _ in caches) or "no cache directory known"
    return (), [Evidence("weights", "not found", f"hub id {repo_id} in none of: {searched}")]


def _revision_snapshot(
    repo: str, revision: str | None, refuse: Callable[[str, str, str], None] | None = None
) -> tuple[str | None, str]:
    """The snapshot a revision names (refs/<revision>, default main), as huggingface_hub does.

    refs/<revision> must be a small regular file: a FIFO or /dev/zero there is refused.
    """
    rev = revision or "main"
    commit: str | None = rev if _COMMIT.match(rev) else None
    if commit is None and "/" not in rev and rev not in (".", ".."):
        try:
            text = read_regular(f"{repo}/refs/{rev}", MAX_REF_BYTES).decode("ascii").strip()
            commit = text if _COMMIT.match(text) else None
        except Refused as exc:
            if refuse is not None:
                refuse(exc.reason, f"{repo}/refs/{rev}", str(exc))
        except (OSError, UnicodeDecodeError):
            commit = None
    if commit and os.path.isdir(f"{repo}/snapshots/{commit}"):
        return f"{repo}/snapshots/{commit}", f"refs/{rev} -> {commit}"
    snapshots: list[tuple[float, str]] = []
    try:
        with os.scandir(f"{repo}/snapshots") as entries:
            for entry in entries:
                if len(snapshots) >= MAX_SNAPSHOTS:
                    break
                if entry.is_dir():
                    snapshots.append((entry.stat().st_mtime, entry.path))
    except OSError:
        return None, "no snapshots"
    if not snapshots:
        return None, "no snapshots"
    newest = max(snapshots)[1]
    return newest, f"refs/{rev} missing: newest of {len(snapshots)} snapshot(s)"
