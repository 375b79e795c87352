"""The boundary between the tree and an engine's memory pools.

The tree never allocates. It receives KV slot sequences and state slots from its caller and hands back the ones
it drops through a :class:`SlotAllocator` that each engine adapter implements over its own pools.
"""

from __future__ import annotations

from typing import Any, Protocol


class SlotAllocator(Protocol):
    """Receives the slots the tree no longer holds."""

    def free_kv(self, kv: Any) -> None:
        """Free a KV slot sequence (one slot per token) that the tree held."""

    def free_state(self, state: Any) -> None:
        """Free one recurrent-state slot that the tree held."""
