"""Which targets a discovered server is watched as (exporter/admission.py: targets_of): one per
server, and one more per model of a repository server holding several."""

from __future__ import annotations

import pytest

from exporter.admission import model_of, models_apart, targets_of
from exporter.discovery import DiscoveredServer
from exporter.vocabulary import ProbeKind

READY = "/v2/models/{model}/ready"


def triton(
    models: tuple[str, ...], weights: tuple[str, ...] = ("/models/repo",)
) -> DiscoveredServer:
    return DiscoveredServer(
        kind="triton",
        name="triton-repo-8000",
        pid=4242,
        start_ticks=99,
        start_time=1.0e9,
        url="http://127.0.0.1:8000",
        probe=ProbeKind.HEALTH,
        probe_path="/v2/health/ready",
        model=models[0] if len(models) == 1 else None,
        weights=weights,
        weights_include=("*.safetensors",),
        reachable=True,
        evidence=(),
        models=models,
        model_ready_path=READY,
    )


@pytest.mark.parametrize("models", [(), ("tiny",)])
def test_a_server_of_one_model_or_none_is_one_target(models: tuple[str, ...]) -> None:
    server = triton(models)
    [own] = targets_of(server)
    assert own.name == server.name and own.endpoint.path == "/v2/health/ready"
    assert not models_apart(server) and model_of(own, server) is None


def test_a_repository_of_several_models_is_a_target_per_model_beside_the_servers() -> None:
    """Each model: `<server>/<model>`, its own ready answer (the name quoted in the path), its
    model's directory under every weight path (one seen through /proc/PID/root too), the
    server's process; the server's own target is unchanged."""
    server = triton(("llama 3#8b", "tiny"), ("/proc/4242/root/models/repo",))
    own, llama, tiny = targets_of(server)
    assert own.name == server.name and own.weights is not None
    assert own.weights.paths == server.weights  # the whole repository: the process's load
    assert own.endpoint.path == "/v2/health/ready" and model_of(own, server) is None
    assert (llama.name, tiny.name) == ("triton-repo-8000/llama-3-8b", "triton-repo-8000/tiny")
    assert llama.endpoint.path == "/v2/models/llama%203%238b/ready"
    assert llama.endpoint.url == own.endpoint.url and llama.endpoint.probe is ProbeKind.HEALTH
    assert llama.weights is not None and tiny.weights is not None
    assert llama.weights.paths == ("/proc/4242/root/models/repo/llama 3#8b",)
    assert tiny.weights.include == ("*.safetensors",)
    assert llama.process == tiny.process == own.process
    assert (model_of(llama, server), model_of(tiny, server)) == ("llama 3#8b", "tiny")
    assert model_of(tiny, None) is None  # a configured target is no model's
