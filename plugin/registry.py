"""Named prefix-cache backends: an admission policy paired with an eviction policy.

``mamba-radix`` and ``marconi`` are built in; any ``ADMISSION/EVICTION`` pair (``marconi/lru``, ``all/flop-aware``,
``periodic:256/lru``) names a backend too. Third-party packages add backends through the entry-point group
``hybrid_prefix_cache.backends``: each entry point loads a :class:`Backend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from hybrid_prefix_cache.core import EvictionPolicy, LRUEviction
from hybrid_prefix_cache.cost_model import ModelSpec
from hybrid_prefix_cache.policies.admission import AdmissionPolicy, make_admission

ENTRY_POINT_GROUP = "hybrid_prefix_cache.backends"
EVICTION_NAMES = ("lru", "flop-aware")


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    admission: str
    eviction: str
    description: str

    def make_admission(self) -> AdmissionPolicy:
        return make_admission(self.admission)

    def make_eviction(self, spec: ModelSpec, alpha: float = 0.0) -> EvictionPolicy:
        return make_eviction(self.eviction, spec, alpha)

    @property
    def tunes_alpha(self) -> bool:
        return self.eviction == "flop-aware"


BUILTIN_BACKENDS = (
    Backend("mamba-radix", "all", "lru", "radix tree with upstream's policy: every chunk-aligned state, LRU eviction"),
    Backend("marconi", "marconi", "flop-aware",
            "Marconi admission (branch points + last decoded token), FLOP-aware eviction guarded against LRU"),
)


def make_eviction(name: str, spec: ModelSpec, alpha: float = 0.0) -> EvictionPolicy:
    if name == "lru":
        return LRUEviction()
    if name == "flop-aware":
        from hybrid_prefix_cache.policies.eviction import FlopAwareEviction

        return FlopAwareEviction(spec, alpha=alpha)
    raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(EVICTION_NAMES)}")


def _third_party_backends() -> list[Backend]:
    found = []
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        backend = entry_point.load()
        if not isinstance(backend, Backend):
            raise TypeError(f"entry point {entry_point.name!r} in {ENTRY_POINT_GROUP} must load a Backend, "
                            f"got {type(backend).__name__}")
        found.append(backend)
    return found


def list_backends() -> list[Backend]:
    """Built-in backends first (``mamba-radix`` leads), then third-party ones."""
    return [*BUILTIN_BACKENDS, *_third_party_backends()]


def resolve_backend(name: str) -> Backend:
    """A registered name or an ``ADMISSION/EVICTION`` pair; a clear error lists the choices otherwise."""
    for backend in list_backends():
        if backend.name == name:
            return backend
    if "/" in name:
        admission, _, eviction = name.partition("/")
        make_admission(admission)
        if eviction not in EVICTION_NAMES:
            raise ValueError(f"backend {name!r}: unknown eviction policy {eviction!r}; "
                             f"choose from {', '.join(EVICTION_NAMES)}")
        return Backend(name, admission, eviction, f"admission {admission}, eviction {eviction}")
    choices = ", ".join(b.name for b in list_backends())
    raise ValueError(f"unknown prefix-cache backend {name!r}; choose from {choices}, or ADMISSION/EVICTION "
                     f"with ADMISSION in all, marconi, periodic:N and EVICTION in {', '.join(EVICTION_NAMES)}")
