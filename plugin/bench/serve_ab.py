"""Serving A/B: one trace against two running OpenAI-compatible servers (SGLang or vLLM), side by side.

Each server gets the same requests: ``/v1/completions`` with the trace's input token ids as the prompt,
``max_tokens`` = the trace's reply length, streamed, with usage reported in the last chunk. A session's turns are
sent in order, each after the previous one finished; sessions start at their trace time divided by
``time_scale``; at most ``concurrency`` requests are in flight per server; the run stops sending at
``time_limit_s``. Reported per server: TTFT p50/p95 (first streamed token), output tokens per second, and the
cached prompt tokens the server reports in ``usage.prompt_tokens_details.cached_tokens``.

Follow-up turns carry the server's own replies, as a chat client's do. The model generates its own tokens, not
the trace's reply, so a next turn built from the trace alone would contain a reply the server never produced,
and no cache could reuse the state after the last decoded token. When turn ``k+1``'s input is turn ``k``'s
input and reply plus a new message (the multi-turn traces' shape), it is sent as the prompt actually sent for
turn ``k``, the tokens the server generated (``return_token_ids``, vLLM), and the new message. A server that
returns no token ids, or a turn of another shape, gets the trace's tokens (counted as ``trace_prompts``).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hybrid_prefix_cache.bench.traces import Request


@dataclass(slots=True)
class ServerResult:
    name: str
    url: str
    requests: int = 0
    failed: int = 0
    follow_ups: int = 0
    trace_prompts: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def ttft_ms(self, q: float) -> float:
        if not self.ttft_s:
            return float("nan")
        ordered = sorted(self.ttft_s)
        return 1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def throughput_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def cached_fraction(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class _Completion:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    generated: list[int] | None  # None: the server sent no token ids


def _stream_completion(url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float) -> _Completion:
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
    }).encode()
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft = None
    usage: dict = {}
    generated: list[int] | None = None
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            choices = chunk.get("choices") or []
            if ttft is None and any(choice.get("text") or choice.get("token_ids") for choice in choices):
                ttft = time.perf_counter() - start
            for choice in choices:
                if choice.get("token_ids"):
                    generated = (generated or []) + list(choice["token_ids"])
            usage = chunk.get("usage") or usage
    if not usage:
        raise ValueError("the server sent no usage (does it support stream_options.include_usage?)")
    details = usage.get("prompt_tokens_details") or {}
    return _Completion(ttft if ttft is not None else time.perf_counter() - start, usage.get("prompt_tokens", 0),
                       details.get("cached_tokens") or 0, usage.get("completion_tokens", 0), generated)


def _follow_up_prompt(previous: Request, sent: list[int], generated: list[int] | None, turn: Request,
                      new_message: list[int]) -> list[int] | None:
    """The prompt a chat client sends for ``turn`` after ``previous``, or None when the trace's must do."""
    history = len(previous.input_tokens) + len(previous.output_tokens)
    if generated is None or tuple(turn.input_tokens[:history]) != (*previous.input_tokens, *previous.output_tokens):
        return None
    return sent + generated + new_message[history:]


def replay_against(name: str, url: str, model: str, requests: Sequence[Request], *, concurrency: int,
                   time_scale: float, time_limit_s: float, vocab_size: int | None, timeout_s: float = 600.0
                   ) -> ServerResult:
    """Replays ``requests`` against one server; sessions in parallel, turns of a session in order."""
    result = ServerResult(name, url)
    sessions: dict[str, list[Request]] = defaultdict(list)
    for request in sorted(requests, key=lambda r: (r.ts, r.turn_id)):
        sessions[request.session_id].append(request)
    lock = threading.Lock()
    slots = threading.Semaphore(concurrency)
    started = time.perf_counter()
    deadline = started + time_limit_s

    def run_session(turns: list[Request]) -> None:
        previous: tuple[Request, list[int], list[int] | None] | None = None
        for turn in turns:
            wait = started + turn.ts / time_scale - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            if time.perf_counter() >= deadline:
                return
            trace_prompt = [t % vocab_size for t in turn.input_tokens] if vocab_size else list(turn.input_tokens)
            prompt = _follow_up_prompt(*previous, turn, trace_prompt) if previous else None
            with slots:
                try:
                    completion = _stream_completion(
                        url, model, prompt or trace_prompt, max(1, len(turn.output_tokens)), timeout_s)
                except (OSError, ValueError, urllib.error.URLError) as error:
                    with lock:
                        result.failed += 1
                        result.errors.append(f"{turn.session_id}/{turn.turn_id}: {error}")
                    return
            with lock:
                result.requests += 1
                result.follow_ups += previous is not None and prompt is not None
                result.trace_prompts += previous is not None and prompt is None
                result.ttft_s.append(completion.ttft_s)
                result.prompt_tokens += completion.prompt_tokens
                result.cached_prompt_tokens += completion.cached_tokens
                result.output_tokens += completion.output_tokens
            previous = (turn, prompt or trace_prompt, completion.generated)

    with ThreadPoolExecutor(max_workers=max(1, min(len(sessions), 4 * concurrency))) as pool:
        list(pool.map(run_session, sessions.values()))
    result.wall_s = time.perf_counter() - started
    return result


def format_side_by_side(results: Sequence[ServerResult]) -> str:
    rows = [
        ("server", lambda r: r.name),
        ("url", lambda r: r.url),
        ("requests ok / failed", lambda r: f"{r.requests} / {r.failed}"),
        ("TTFT p50 (ms)", lambda r: f"{r.ttft_ms(0.5):.1f}"),
        ("TTFT p95 (ms)", lambda r: f"{r.ttft_ms(0.95):.1f}"),
        ("output tok/s", lambda r: f"{r.throughput_tok_s:.1f}"),
        ("prompt tokens", lambda r: f"{r.prompt_tokens:,}"),
        ("cached prompt tokens", lambda r: f"{r.cached_prompt_tokens:,} ({100 * r.cached_fraction:.1f}%)"),
        ("follow-ups with replies", lambda r: f"{r.follow_ups} of {r.follow_ups + r.trace_prompts}"),
    ]
    width = max(24, *(len(r.url) + 2 for r in results))
    lines = []
    for label, cell in rows:
        lines.append(f"{label:<22}" + "".join(f"{cell(r):>{width}}" for r in results))
    for r in results:
        for error in r.errors[:3]:
            lines.append(f"{r.name} error: {error}")
    return "\n".join(lines)
