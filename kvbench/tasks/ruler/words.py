"""The word lists RULER's generators draw from: the NIAH key space (wonderwords adjective-noun pairs, in sorted
order without materialising them) and the common-words vocabulary.
"""

from __future__ import annotations

import bisect
import functools
import warnings
from typing import Any, Sequence

from kvbench.tasks.base import TaskError


def _wonderwords(name: str) -> list[str]:
    # wonderwords 2.2.0 reads its lists with the deprecated importlib.resources.open_text, on import too.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from wonderwords import random_word
        except ImportError:
            raise TaskError("RULER needs the `wonderwords==2.2.0` package (its word lists)") from None
        return random_word._get_words_from_text_file(name)


class SortedKeySpace(Sequence[str]):
    """`sorted(set(f"{adj}-{noun}" for adj in adjs for noun in nouns))` without building its millions of strings.

    Strings of two adjectives interleave only when one adjective extends the other by "-..." ("blue" and
    "blue-eyed"); such families are merged and sorted explicitly, every other adjective is one contiguous block
    "<adj>-<noun in sorted order>". Indexing is exact, so `random.choice` draws the official key.
    """

    def __init__(self, adjs: Sequence[str], nouns: Sequence[str]) -> None:
        adjs = sorted(set(adjs))
        self._nouns = sorted(set(nouns))
        root: dict[str, str] = {}
        for a in adjs:  # sorted: a prefix adjective is seen before its extensions
            parents = [r for r in root if a.startswith(r + "-")]
            root[a] = root[min(parents, key=len)] if parents else a
        families: dict[str, list[str]] = {}
        for a, r in root.items():
            families.setdefault(r, []).append(a)
        blocks: list[tuple[str, Any]] = []
        for r, members in families.items():
            if len(members) == 1:
                blocks.append((f"{r}-{self._nouns[0]}", r))
            else:
                merged = sorted({f"{m}-{n}" for m in members for n in self._nouns})
                blocks.append((merged[0], merged))
        blocks.sort(key=lambda b: b[0])
        self._blocks = [b for _, b in blocks]
        self._starts: list[int] = []
        total = 0
        for b in self._blocks:
            self._starts.append(total)
            total += len(self._nouns) if isinstance(b, str) else len(b)
        self._len = total

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        k = bisect.bisect_right(self._starts, i) - 1
        b, j = self._blocks[k], i - self._starts[k]
        return f"{b}-{self._nouns[j]}" if isinstance(b, str) else b[j]


@functools.lru_cache(maxsize=1)
def niah_keys() -> SortedKeySpace:
    return SortedKeySpace(_wonderwords("adjectivelist.txt"), _wonderwords("nounlist.txt"))


@functools.lru_cache(maxsize=1)
def cwe_vocab() -> tuple[str, ...]:
    return tuple(sorted(set(_wonderwords("nounlist.txt") + _wonderwords("adjectivelist.txt")
                            + _wonderwords("verblist.txt"))))
