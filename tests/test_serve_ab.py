"""serve-ab against two stand-in OpenAI-compatible servers on loopback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybrid_prefix_cache.bench.serve_ab import replay_against
from hybrid_prefix_cache.bench.traces import Request
from hybrid_prefix_cache.cli import main


def make_server(cached_fraction: float, reply_token: int | None = None):
    """A streaming /v1/completions that reports a fixed fraction of the prompt as cached; with ``reply_token``
    it generates that token every step and streams its id (as vLLM does with ``return_token_ids``)."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            choice = {"text": "x"} if reply_token is None else {"text": "x", "token_ids": [reply_token]}
            for _ in range(body["max_tokens"]):
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": int(cached_fraction * len(body["prompt"]))}}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


@pytest.fixture
def servers():
    a, seen_a = make_server(0.25)
    b, seen_b = make_server(0.75)
    yield (a, seen_a), (b, seen_b)
    a.shutdown()
    b.shutdown()


def _trace() -> list[Request]:
    return [Request("s1", 0, 0.0, (1, 2, 3, 4), (9, 9)), Request("s1", 1, 0.01, (1, 2, 3, 4, 9, 9, 5, 6), (7,)),
            Request("s2", 0, 0.0, (500, 501), (8, 8, 8))]


def test_replay_reports_ttft_usage_and_keeps_session_order(servers):
    (server, seen), _ = servers
    url = f"http://127.0.0.1:{server.server_address[1]}"
    result = replay_against("a", url, "tiny", _trace(), concurrency=2, time_scale=1.0, time_limit_s=30,
                            vocab_size=100)
    assert (result.requests, result.failed) == (3, 0)
    assert result.prompt_tokens == 14 and result.output_tokens == 6
    assert result.cached_prompt_tokens == 1 + 2 + 0
    assert len(result.ttft_s) == 3 and all(t >= 0 for t in result.ttft_s)
    prompts = [body["prompt"] for body in seen]
    assert prompts.index([1, 2, 3, 4]) < prompts.index([1, 2, 3, 4, 9, 9, 5, 6])
    assert [0, 1] in prompts  # ids mapped into the vocabulary


def test_follow_up_turns_carry_the_servers_own_reply():
    server, seen = make_server(0.0, reply_token=42)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    trace = [*_trace(), Request("s2", 1, 0.02, (777, 2), (3,))]  # not an extension of turn 0: sent as traced
    try:
        result = replay_against("a", url, "tiny", trace, concurrency=1, time_scale=1.0, time_limit_s=30,
                                vocab_size=100)
    finally:
        server.shutdown()
    assert (result.requests, result.follow_ups, result.trace_prompts) == (4, 1, 1)
    prompts = [body["prompt"] for body in seen]
    assert [1, 2, 3, 4, 42, 42, 5, 6] in prompts  # the generated reply, not the trace's (9, 9)
    assert [77, 2] in prompts
    assert all(body["return_token_ids"] for body in seen)


def test_cli_serve_ab_prints_both_servers_side_by_side(servers, tmp_path, capsys):
    (a, _), (b, _) = servers
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"session_id": r.session_id, "turn_id": r.turn_id, "ts": r.ts,
                                         "input_tokens": list(r.input_tokens),
                                         "output_tokens": list(r.output_tokens)}) + "\n" for r in _trace()))
    out = tmp_path / "ab.json"
    code = main(["serve-ab", "--a", f"lru=http://127.0.0.1:{a.server_address[1]}",
                 "--b", f"marconi=http://127.0.0.1:{b.server_address[1]}", "--served-model", "tiny",
                 "--trace", str(trace), "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "cached prompt tokens" in text and "lru" in text and "marconi" in text
    figures = json.loads(out.read_text())
    assert [f["cached_prompt_tokens"] for f in figures] == [3, 3 + 6 + 1]


def test_unreachable_server_is_reported_not_raised(capsys):
    result = replay_against("down", "http://127.0.0.1:9", "tiny", _trace()[:1], concurrency=1, time_scale=1.0,
                            time_limit_s=5, vocab_size=None, timeout_s=2)
    assert (result.requests, result.failed) == (0, 1) and result.errors
