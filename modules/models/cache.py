"""Prompt-embedding cache keyed by (component, version, content hash).

A frozen text encoder's entries live as long as its version does, so generator updates never flush
them, and a group of K samples of one prompt encodes it once. ``invalidate(component)`` drops only
that component's entries; ``hits``/``misses`` give the hit rate logged by the methods.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable, Optional

import torch


def content_hash(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def file_hash(path: str) -> str:
    """SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class EmbeddingCache:
    def __init__(self, max_entries: int = 8192, device: Optional[str] = None):
        self.max_entries = max_entries
        self.device = device  # where rows are kept; None = where they were computed
        self._store: OrderedDict[tuple[str, int, str], torch.Tensor] = OrderedDict()
        # rows never dropped for room (``put(pin=True)``): those of an encoder that cannot compute them again
        self._pinned: dict[tuple[str, int, str], torch.Tensor] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._store) + len(self._pinned)

    def keys_of(self, component: str) -> list[tuple[str, int, str]]:
        return [key for key in [*self._pinned, *self._store] if key[0] == component]

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def get_or_compute(self, component: str, version: int, texts: list[str],
                       compute: Callable[[list[str]], torch.Tensor]) -> torch.Tensor:
        """Stack of cached rows for ``texts``; missing unique texts are computed in one batch."""
        keys = [(component, version, content_hash(t)) for t in texts]
        missing = list(dict.fromkeys(t for t, k in zip(texts, keys) if k not in self._store and k not in self._pinned))
        # a miss is a text that had to be encoded; a row repeated in the call (a group of K) is a hit
        self.misses += len(missing)
        self.hits += len(texts) - len(missing)
        fresh: dict[tuple[str, int, str], torch.Tensor] = {}
        if missing:
            for text, row in zip(missing, compute(missing)):
                row = row.detach()
                fresh[(component, version, content_hash(text))] = row if self.device is None else row.to(self.device)
        out = []
        for key in keys:
            if key in fresh:
                out.append(fresh[key])
            elif key in self._pinned:
                out.append(self._pinned[key])
            else:
                self._store.move_to_end(key)
                out.append(self._store[key])
        # store after gathering: a call with more distinct texts than max_entries still returns every row
        self._store.update(fresh)
        while len(self._store) > self.max_entries:
            self._store.popitem(last=False)
        return torch.stack(out)

    def put(self, component: str, version: int, texts: list[str], rows: torch.Tensor, pin: bool = False) -> None:
        """Store precomputed ``rows`` (one per text) as ``component``'s entries of ``version`` (counted as
        neither hit nor miss: the lookup that uses them is the hit); ``pin``: never dropped for room (beyond
        ``max_entries``: the few rows a run needs all along, of an encoder that is not loaded)."""
        for text, row in zip(texts, rows):
            key = (component, version, content_hash(text))
            if pin or key in self._pinned:
                self._pinned[key] = row if self.device is None else row.to(self.device)
                continue
            self._store[key] = row if self.device is None else row.to(self.device)
            self._store.move_to_end(key)
        while len(self._store) > self.max_entries:
            self._store.popitem(last=False)

    def row(self, component: str, version: int, text: str) -> torch.Tensor:
        """The cached row of ``text`` (KeyError when it is not cached)."""
        key = (component, version, content_hash(text))
        return self._pinned[key] if key in self._pinned else self._store[key]

    def invalidate(self, component: str, keep_version: int | None = None) -> int:
        """Drop ``component``'s entries (those of other versions than ``keep_version``); returns how many."""
        stale = [k for k in [*self._store, *self._pinned] if k[0] == component and k[1] != keep_version]
        for key in stale:
            self._store.pop(key, None)
            self._pinned.pop(key, None)
        return len(stale)
