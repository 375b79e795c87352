"""Intrusive doubly linked lists: O(1) push, remove and move-to-tail without searching."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class Link:
    """One list membership of an owner object; an owner that sits in two lists holds two links."""

    __slots__ = ("next", "owner", "prev")

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.prev: Link | None = None
        self.next: Link | None = None

    @property
    def linked(self) -> bool:
        return self.prev is not None


class LinkedList:
    """A sentinel-based list; the head is the oldest entry, the tail the newest.

    Invariant: a link is in at most one list, and ``link.prev is None`` exactly when it is in none.
    """

    __slots__ = ("_sentinel", "size")

    def __init__(self) -> None:
        self._sentinel = Link(None)
        self._sentinel.prev = self._sentinel
        self._sentinel.next = self._sentinel
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def push_tail(self, link: Link) -> None:
        sentinel = self._sentinel
        last = sentinel.prev
        link.prev = last
        link.next = sentinel
        last.next = link
        sentinel.prev = link
        self.size += 1

    def insert_after(self, anchor: Link, link: Link) -> None:
        following = anchor.next
        link.prev = anchor
        link.next = following
        anchor.next = link
        following.prev = link
        self.size += 1

    def remove(self, link: Link) -> None:
        link.prev.next = link.next
        link.next.prev = link.prev
        link.prev = None
        link.next = None
        self.size -= 1

    def move_to_tail(self, link: Link) -> None:
        # Inlined remove + push_tail: this runs for every node on every touched path.
        following = link.next
        if following is self._sentinel:
            return
        previous = link.prev
        previous.next = following
        following.prev = previous
        sentinel = self._sentinel
        last = sentinel.prev
        link.prev = last
        link.next = sentinel
        last.next = link
        sentinel.prev = link

    def head(self) -> Any | None:
        first = self._sentinel.next
        return None if first is self._sentinel else first.owner

    def tail(self) -> Any | None:
        last = self._sentinel.prev
        return None if last is self._sentinel else last.owner

    def __iter__(self) -> Iterator[Any]:
        link = self._sentinel.next
        while link is not self._sentinel:
            following = link.next
            yield link.owner
            link = following
