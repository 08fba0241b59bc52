"""Which text goes to train and which to val: documents, cut into pieces when long, split by a hash.

A document shorter than `PIECE_CHARS` is one piece. A longer one (a book, or a whole corpus in one file) is
cut at a paragraph end, else a line end, else a space, in the second half of each `PIECE_CHARS` window, so
that one big file still gives a val split; the cuts depend only on the text.

Each piece goes to val when a hash of (seed, its text) falls below `val_fraction`. Consecutive pieces of a
document that land in the same split are one stretch of text there and are encoded together, exactly as the
uncut document would be when all of it lands in one split. Each stretch ends with EOS: at the document's real
end, and where the split's stream skips pieces that went to the other split, because what follows there does
not continue the text (gluing the stretches would teach a continuation that the document does not have).
No EOS is ever put between two pieces that follow each other in a split.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator

PIECE_CHARS = 16_384  # a few thousand tokens: many pieces per big file, few cuts in an ordinary document
SPLITS = ("train", "val")


def is_val(seed: int, text: str, val_fraction: float) -> bool:
    """A piece's split from a hash of its text: the same wherever the files lie, and a repeated piece never
    lands on both sides."""
    digest = hashlib.blake2b(f"{seed}\0{text}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return struct.unpack("<Q", digest)[0] / 2**64 < val_fraction


def pieces(text: str, budget: int = PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of at most `budget` characters, at the last paragraph end, line end or space of
    the window's second half (a hard cut only in text without any)."""
    out, start = [], 0
    while len(text) - start > budget:
        low, high = start + budget // 2, start + budget
        cut = -1
        for mark in ("\n\n", "\n", " "):
            found = text.rfind(mark, low, high)
            if found >= 0:
                cut = found + len(mark)
                break
        cut = cut if cut > start else high
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def stretches(documents: Iterable[str], seed: int, val_fraction: float, last_to: str | None = None,
              budget: int = PIECE_CHARS) -> Iterator[tuple[str, str, int]]:
    """(split, text, pieces) of every stretch of the documents, in order; each stretch is followed by EOS.

    last_to: the split of the last piece whatever its hash (a corpus whose every piece fell in one split
    still gets the other).
    """
    docs = iter(documents)
    current = next(docs, None)
    while current is not None:
        following = next(docs, None)
        cut = pieces(current, budget)
        splits = ["val" if is_val(seed, p, val_fraction) else "train" for p in cut]
        if last_to and following is None:
            splits[-1] = last_to
        start = 0
        for i in range(1, len(cut) + 1):
            if i == len(cut) or splits[i] != splits[start]:
                yield splits[start], "".join(cut[start:i]), i - start
                start = i
        current = following
