"""The test peer itself: a real vLLM loads the test checkpoint and answers, and stops cleanly."""

from __future__ import annotations

from collections.abc import Callable

from servers.vllm_server import VllmServer


def test_vllm_answers_after_loading_a_checkpoint(start_vllm: Callable[..., VllmServer]) -> None:
    server = start_vllm("cold")
    log = server.log.read_text(errors="replace")
    begin, end = log.find("Starting to load model"), log.find("Loading weights took")
    assert 0 <= begin < end, server.tail()

    answer = server.complete("hello world", tokens=4)
    assert answer["usage"]["completion_tokens"] == 4
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["choices"][0]["text"].strip()

    assert len(server.tree()) >= 3  # API server, EngineCore, Worker
    assert server.stop() == []
    assert server.tree() == []
