"""The ids llama.cpp's stream holds back: which tokens spelled the bytes it sent late.

llama.cpp's server (``process_token`` in ``tools/server/server-context.cpp``) appends each
generated token's bytes to the request's text and sends nothing while that text ends in the
middle of a UTF-8 character (its ``validate_utf8``). The token that completes the character
is sent alone: its id, and *all* the bytes held since (``logprobs.content[].bytes``); the
held tokens' ids are never sent. Its ``timings.predicted_n`` (with ``timings_per_token``)
still counts every token generated, so a frame tells how many ids it lacks.

`TokenPieces.spell` finds them: the ways to write the held bytes as exactly that many
tokens, each of which leaves the text mid-character (else the server would have sent it).
When there is one way, those are the ids; when there are several (rare: a four-byte
character spelled by two fragments of two lengths, say), the caller must fall back on
generating those tokens again in a way that returns their ids.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ("TokenPieces", "ends_mid_character")

#: Held bytes or tokens past which `TokenPieces.spell` does not search (the caller falls
#: back): a bound on the work a pathological stream can cause.
MAX_HELD_BYTES = 256
MAX_HELD_TOKENS = 64


def ends_mid_character(text: bytes) -> bool:
    """Whether llama.cpp's server holds ``text`` back: its ``validate_utf8`` finds a UTF-8
    lead byte among the last four with fewer bytes after it than its character needs.

    This mirrors that function exactly, quirks included: it looks at lead bytes only (a
    stray continuation byte ends nothing) and keeps looking past complete characters.
    """
    n = len(text)
    for back in range(1, min(4, n) + 1):
        byte = text[n - back]
        if byte & 0xE0 == 0xC0:
            needs = 2
        elif byte & 0xF0 == 0xE0:
            needs = 3
        elif byte & 0xF8 == 0xF0:
            needs = 4
        else:
            continue
        if back < needs:
            return True
    return False


class TokenPieces:
    """The bytes llama.cpp writes for each token id, and the way back from bytes to ids.

    Args:
        pieces: ``pieces[i]`` is what token ``i`` writes with special tokens rendered
            (`actors._gguf.token_pieces`).
    """

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self._pieces = list(pieces)
        self._ids: dict[bytes, list[int]] = {}
        for token_id, piece in enumerate(self._pieces):
            self._ids.setdefault(piece, []).append(token_id)
        self._longest = max((len(p) for p in self._pieces), default=0)
        # A token that writes nothing could sit anywhere in a held run: no spelling is sure.
        self._has_empty = b"" in self._ids

    def __len__(self) -> int:
        return len(self._pieces)

    def piece(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` writes."""
        return self._pieces[token_id]

    def spell(self, before: bytes, held: bytes, count: int) -> list[int] | None:
        """The one way to write ``held`` as ``count`` tokens each of which leaves the text
        mid-character.

        Args:
            before: The request's text before the held tokens (only its last bytes matter).
            held: The bytes the held tokens wrote, in order.
            count: How many tokens were held.

        Returns:
            Their ids, or ``None`` when there is no such spelling or more than one (or the
            run is past `MAX_HELD_BYTES` / `MAX_HELD_TOKENS`).
        """
        if count == 0:
            return [] if not held else None
        if self._has_empty or count > MAX_HELD_TOKENS or len(held) > MAX_HELD_BYTES:
            return None
        text = before[-4:] + held
        offset = len(text) - len(held)

        def cut_mid_character(end: int) -> bool:
            return ends_mid_character(text[: offset + end][-4:])

        @cache
        def ways(start: int, left: int) -> int:
            """Spellings of ``held[start:]`` in ``left`` tokens, counted up to 2."""
            if left == 0:
                return 1 if start == len(held) else 0
            found = 0
            last = min(len(held) - (left - 1), start + self._longest)
            for end in range(start + 1, last + 1):
                ids = self._ids.get(held[start:end])
                if ids and cut_mid_character(end):
                    found += len(ids) * ways(end, left - 1)
                    if found >= 2:
                        return 2
            return found

        if ways(0, count) != 1:
            return None
        spelled: list[int] = []
        start = 0
        for left in range(count, 0, -1):
            last = min(len(held) - (left - 1), start + self._longest)
            for end in range(start + 1, last + 1):
                ids = self._ids.get(held[start:end])
                if ids and cut_mid_character(end) and ways(end, left - 1) == 1:
                    spelled.append(ids[0])
                    start = end
                    break
        return spelled
