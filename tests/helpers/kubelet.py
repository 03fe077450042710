"""A prober that follows the kubelet's rules for an `httpGet` probe (pkg/probe/http and
pkg/kubelet/prober in Kubernetes): one GET every `periodSeconds`, each bounded by
`timeoutSeconds`; a status from 200 to 399 is success, anything else (another status, a refused
connection, a timeout) is failure; `failureThreshold` failures in a row make the kubelet act
(restart the container for liveness), `successThreshold` successes in a row undo it. The body
(up to 10 KiB) is what the probe's event in `kubectl describe` shows.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import requests

BODY_LIMIT = 10 * 1024  # the kubelet keeps this much of a probe's body


@dataclass(frozen=True)
class Probe:
    """One probe as the kubelet saw it."""

    at: float  # time.time() when the probe was sent
    code: int | None  # None: no HTTP answer (refused, timed out)
    body: str

    @property
    def ok(self) -> bool:
        return self.code is not None and 200 <= self.code < 400


class Prober:
    """Probes `url` on its own thread from `start()` to `stop()`, keeping every answer."""

    def __init__(
        self,
        url: str,
        period: float = 10.0,
        timeout: float = 1.0,
        failure_threshold: int = 3,
        **request: Any,
    ) -> None:
        self.url, self.period, self.timeout = url, period, timeout
        self.failure_threshold = failure_threshold
        self.request = request  # auth=, verify=, headers=: what the probe's spec would send
        self.probes: list[Probe] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._lock = threading.Lock()

    def start(self) -> Prober:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period + self.timeout + 5)

    def _run(self) -> None:
        # The kubelet ticks on its own schedule whatever the probe took (a probe never runs
        # twice at once: a slow one delays the next tick, as the kubelet's worker does).
        next_at = time.monotonic()
        while not self._stop.is_set():
            probe = self._probe()
            with self._lock:
                self.probes.append(probe)
            next_at = max(next_at + self.period, time.monotonic())
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _probe(self) -> Probe:
        at = time.time()
        try:
            response = requests.get(
                self.url, timeout=self.timeout, allow_redirects=False, **self.request
            )
        except requests.RequestException as exc:
            return Probe(at, None, f"{type(exc).__name__}")
        return Probe(at, response.status_code, response.text[:BODY_LIMIT].strip())

    def seen(self) -> list[Probe]:
        with self._lock:
            return list(self.probes)

    def between(self, start: float, end: float = float("inf")) -> list[Probe]:
        return [p for p in self.seen() if start <= p.at < end]

    def first(self, ok: bool, after: float) -> Probe | None:
        """The first probe at or after `after` that succeeded (or failed)."""
        return next((p for p in self.seen() if p.at >= after and p.ok == ok), None)

    def restart_at(self, after: float = 0.0) -> float | None:
        """When the kubelet would have acted: the probe that made `failure_threshold` failures
        in a row (counting from `after`); None if none did."""
        run = 0
        for probe in self.between(after):
            run = 0 if probe.ok else run + 1
            if run >= self.failure_threshold:
                return probe.at
        return None

    def wait_for(self, ok: bool, after: float, timeout: float) -> Probe:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.first(ok, after)
            if found is not None:
                return found
            time.sleep(self.period / 4)
        tail = [(round(p.at - after, 2), p.code, p.body) for p in self.seen()[-5:]]
        raise AssertionError(f"no {'success' if ok else 'failure'} within {timeout}s: {tail}")
