"""Real filesystems made inside a test: loop-device images, overlays, tmpfs, FUSE, blkio throttles.

Everything is undone in reverse order when the `Scratch` closes, failed test or not: mounts are
unmounted (lazily when something still holds them), loop devices detached by their own name (the
machine's other loop devices are never touched), cgroups emptied and removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from itertools import count
from pathlib import Path

from helpers.require import require

MIB = 1 << 20
BLKIO = Path("/sys/fs/cgroup/blkio")
_names = count()

# What each filesystem needs: its kernel name in /proc/filesystems and the tool that makes it.
NEEDS: dict[str, tuple[str, str | None]] = {
    "ext4": ("ext4", "mkfs.ext4"),
    "xfs": ("xfs", "mkfs.xfs"),
    "btrfs": ("btrfs", "mkfs.btrfs"),
    "squashfs": ("squashfs", "mksquashfs"),
    "erofs": ("erofs", "mkfs.erofs"),
    "overlay": ("overlay", None),
    "tmpfs": ("tmpfs", None),
    "fuse": ("fuse", "bindfs"),
}
IMAGE_BYTES = {"ext4": 64 * MIB, "xfs": 320 * MIB, "btrfs": 160 * MIB}  # each mkfs's minimum
MKFS = {
    "ext4": ["mkfs.ext4", "-q", "-F"],
    "xfs": ["mkfs.xfs", "-q", "-f"],
    "btrfs": ["mkfs.btrfs", "-q", "-f"],
}


def kernel_filesystems() -> set[str]:
    with open("/proc/filesystems") as f:
        return {line.split()[-1] for line in f if line.strip()}


def require_filesystem(*names: str) -> None:
    """Skip (fail under MLE_STRICT) where this kernel or this machine cannot make them."""
    require(os.geteuid() == 0, "needs root (mounts, loop devices)")
    for name in names:
        kernel, tool = NEEDS[name]
        require(kernel in kernel_filesystems(), f"this kernel has no {kernel} filesystem")
        if tool is not None:
            require(shutil.which(tool) is not None, f"needs {tool}")
        if name not in ("tmpfs", "overlay", "fuse"):
            require(shutil.which("losetup") is not None, "needs losetup (util-linux)")


def run(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=60).stdout


class Scratch:
    """Filesystems and throttles for one test, all undone by close()."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self._undo = contextlib.ExitStack()

    def close(self) -> None:
        self._undo.close()

    def path(self, name: str) -> Path:
        path = self.root / f"{name}-{next(_names)}"
        path.mkdir(parents=True)
        return path

    def _mount(self, *args: str) -> Path:
        point = self.path("mnt")
        run("mount", *args, str(point))
        self._undo.callback(_unmount, point)
        return point

    def loop(self, image: Path) -> str:
        """Attach `image` to a free loop device; its kernel name (loop3)."""
        device = run("losetup", "--find", "--show", str(image)).strip()
        self._undo.callback(_detach, device)
        return os.path.basename(device)

    def block_image(self, fstype: str) -> tuple[Path, str, Path]:
        """A fresh `fstype` (ext4, xfs, btrfs) on a loop device: (mount point, loop, image)."""
        image = self.root / f"{fstype}-{next(_names)}.img"
        with open(image, "wb") as f:
            f.truncate(IMAGE_BYTES[fstype])
        run(*MKFS[fstype], str(image))
        device = self.loop(image)
        return self._mount("-t", fstype, f"/dev/{device}"), device, image

    def read_only_image(self, fstype: str, content: Path) -> tuple[Path, str, Path]:
        """`content` packed as a squashfs or erofs image on a loop device."""
        image = self.root / f"{fstype}-{next(_names)}.img"
        if fstype == "squashfs":
            run("mksquashfs", str(content), str(image), "-quiet", "-noappend", "-no-progress")
        else:
            run("mkfs.erofs", "--quiet", str(image), str(content))
        device = self.loop(image)
        return self._mount("-t", fstype, "-o", "ro", f"/dev/{device}"), device, image

    def tmpfs(self) -> Path:
        return self._mount("-t", "tmpfs", "-o", "size=64m", "mle-test")

    def overlay(self, lower: Path, upper_base: Path) -> Path:
        """An overlay of `lower` with its upper and work directories made in `upper_base`."""
        upper, work = upper_base / "upper", upper_base / "work"
        upper.mkdir()
        work.mkdir()
        return self._mount(
            "-t", "overlay", "mle-test", "-o",
            f"lowerdir={lower},upperdir={upper},workdir={work}",
        )  # fmt: skip

    def bindfs(self, source: Path, *options: str) -> tuple[Path, int]:
        """bindfs in the foreground, so its daemon's pid is known (to throttle its reads):
        (mount point, daemon pid). Unmounting ends the daemon."""
        point = self.path("fuse")
        daemon = subprocess.Popen(
            ["bindfs", "-f", *options, str(source), str(point)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._undo.callback(_reap, daemon)
        deadline = time.monotonic() + 10
        while not os.path.ismount(point):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"bindfs did not mount {point} (exit {daemon.returncode})")
            time.sleep(0.02)
        self._undo.callback(_unmount, point)
        return point, daemon.pid

    def hide(self, directory: Path) -> None:
        """Mount an empty tmpfs over `directory`: what was there can no longer be reached."""
        run("mount", "-t", "tmpfs", "-o", "size=1m", "mle-hide", str(directory))
        self._undo.callback(_unmount, directory)

    def throttle(self, device: str, read_bps: int) -> Path:
        """A blkio cgroup (v1) that reads `device` at most `read_bps`; its cgroup.procs."""
        require((BLKIO / "blkio.throttle.read_bps_device").exists(), "needs blkio cgroup v1")
        group = BLKIO / f"mle-test-{os.getpid()}-{next(_names)}"
        group.mkdir()
        self._undo.callback(_remove_cgroup, group)
        majmin = Path(f"/sys/class/block/{device}/dev").read_text().strip()
        (group / "blkio.throttle.read_bps_device").write_text(f"{majmin} {read_bps}\n")
        return group / "cgroup.procs"


def into_cgroup(procs: Path) -> Callable[[], None]:
    """A preexec_fn that puts the child into a cgroup before it runs anything."""

    def enter() -> None:
        procs.write_text(f"{os.getpid()}\n")

    return enter


@contextlib.contextmanager
def scratch(root: Path) -> Iterator[Scratch]:
    s = Scratch(root)
    try:
        yield s
    finally:
        s.close()


def _unmount(point: Path) -> None:
    for _ in range(20):
        done = subprocess.run(["umount", str(point)], capture_output=True, timeout=30)
        if done.returncode == 0:
            return
        time.sleep(0.1)  # a FUSE daemon or the sampler may still hold it for a moment
    subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=30)


def _reap(daemon: subprocess.Popen[bytes]) -> None:
    try:
        daemon.wait(timeout=10)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


def _detach(device: str) -> None:
    subprocess.run(["losetup", "-d", device], capture_output=True, timeout=30)


def _remove_cgroup(group: Path) -> None:
    parent = group.parent / "cgroup.procs"
    with contextlib.suppress(OSError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                parent.write_text(f"{pid}\n")
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def fincore_bytes(path: Path) -> int:
    """Resident bytes by util-linux fincore (mmap + mincore as root: the kernel's truth)."""
    out = run("fincore", "--bytes", "--raw", "--noheadings", "--output", "RES", str(path))
    return int(out.split()[0])
