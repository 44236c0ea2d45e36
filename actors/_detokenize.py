"""Incremental detokenization: token ids in, streamable text out, never taken back.

Two layers, each with its own invariant:

1. **UTF-8 safety.** Each push decodes a small window, ``ids[surr:]``, and the window's
   already-committed prefix, ``ids[surr:read]``; the new text is the difference. A piece
   that ends in U+FFFD may be an incomplete multi-byte character, so that last character
   is held back (and the offsets stay put) until a later token completes it or the request
   finishes (a run of them, with a byte-fallback decoder, which gives one per byte token;
   the window also waits after ids that decode to nothing, to keep the left context a
   decoder needs). Joined, the committed pieces equal the tokenizer's one-shot decode.
2. **Stop strings.** Committed text is searched for stop strings, across push boundaries;
   text that might be the start of a stop string is held back until it is known not to
   be one, so the stream can be cut before the stop string without retracting anything.
"""

from __future__ import annotations

from codecs import utf_8_decode
from collections.abc import Hashable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from ._byte_table import byte_table, special_ids

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

__all__ = (
    "DetokenizerStates",
    "IncrementalDetokenizer",
    "SupportsDecode",
    "TooManyRequestsError",
)

_REPLACEMENT = "\ufffd"
#: Pushes of ids in a row that a window keeps uncommitted, at most, waiting for a character
#: to complete (at most three byte tokens more) or for text after tokens that decode to
#: nothing: then what they decode to is committed as it is (a stream of invalid bytes,
#: say), so that the window, and each push's decode, stays a few pushes long. Skipped
#: special tokens never enter the window (a decode leaves them out whatever is around
#: them): a push of only those adds nothing to wait for, and is not counted, however many
#: come between the bytes of a character.
_MAX_WAITS = 32

OriginT = TypeVar("OriginT", bound=Hashable)


class SupportsDecode(Protocol):
    """What the detokenizer needs from a tokenizer: HF ``tokenizers.Tokenizer.decode``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str:
        """Decode ``ids`` to text in one shot."""
        ...


class TooManyRequestsError(Exception):
    """Creating one more detokenizer state would exceed the cap on live states.

    Attributes:
        max_states: The cap that was reached.
    """

    def __init__(self, max_states: int) -> None:
        super().__init__(
            f"cannot track another request: {max_states} detokenizer states are live, the "
            f"cap (max_states={max_states}); raise the detokenizer's max_states or send "
            "fewer concurrent requests"
        )
        self.max_states = max_states


class IncrementalDetokenizer:
    """Turns one request's output token ids into text pieces that are safe to stream.

    The pieces returned by `push`, joined, equal
    ``tokenizer.decode(all_ids, skip_special_tokens=...)`` whatever the chunking (with a
    byte-fallback tokenizer, whenever its byte tokens make valid UTF-8: its decoder turns
    a whole run of byte tokens into U+FFFD when any of them is invalid, which text already
    streamed cannot follow); with stop strings they equal that text cut before the
    earliest stop string (kept through it with ``no_stop_trim``). The earliest stop string
    is the one that is complete first, i.e. whose first occurrence ends first; on a tie the
    longer one wins.

    With a byte-level BPE tokenizer (``actors._byte_table``), a push looks each new id's
    bytes up in a table built once per tokenizer and decodes them with an incremental
    UTF-8 decoder, which holds back only the bytes of an incomplete last character: no
    call into the tokenizer at all. With any other tokenizer, the cost per push is two
    decodes of a window holding the new ids and the previous push's ids (plus any
    held-back partial character), not of everything decoded so far, and only that window
    is kept.

    Args:
        tokenizer: Anything with HF ``tokenizers``' ``decode(ids, skip_special_tokens)``.
        stop: Stop strings; must be non-empty. The stream ends at the first one found.
        no_stop_trim: Keep the matched stop string in the output instead of cutting it.
        skip_special_tokens: Passed to ``decode``.

    Raises:
        ValueError: A stop string is empty.
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        *,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError(
                f"stop strings must be non-empty, got {list(stop)!r}; drop the empty string"
            )
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        table = byte_table(tokenizer)
        # Layer 1 on bytes: each id's bytes, and a decoder holding an incomplete character.
        self._bytes: tuple[bytes, ...] | None = (
            None if table is None else table.of(skip_special_tokens)
        )
        # Layer 1 on windows: the ids left out of them (skipped special tokens).
        self._skipped = (
            special_ids(tokenizer) if table is None and skip_special_tokens else frozenset()
        )
        # The bytes of an incomplete last character, held until it completes.
        self._partial = b""
        self._no_stop_trim = no_stop_trim
        # dict.fromkeys: de-duplicated, first-seen order kept.
        self._stops = tuple(dict.fromkeys(stop))
        longest = max((len(s) for s in self._stops), default=0)
        # A stop string straddling pushes starts at most len-1 characters before the new
        # text, so that much trailing context is enough to find it.
        self._context_len = max(longest - 1, 0)
        # Per stop string, its prefix function (Knuth-Morris-Pratt), and how many of its
        # first characters the committed text ends with: what may be held back is the most
        # of those, kept up to date character by character, a few steps a character
        # whatever the stops. (A regular expression of every prefix grew with the square
        # of a stop string's length: 16 stops of 256 characters took half a second to
        # compile per request and 8 ms a push.)
        self._matchers = [(stop, _prefix_function(stop)) for stop in self._stops]
        self._matched = [0] * len(self._stops)

        # Layer 1: ids[surr:] is kept as _window; _window[:_prefix_len] is ids[surr:read].
        self._window: list[int] = []
        self._prefix_len = 0
        self._prefix_text: str | None = ""
        # Characters of the uncommitted tail's text already passed on (all but a possibly
        # incomplete last character).
        self._tail_emitted = 0
        # Pushes in a row that left their ids uncommitted (`_MAX_WAITS`).
        self._waited = 0

        # Layer 2: the last _context_len characters of committed text, of which the last
        # _held characters (a possible stop-string start) have not been returned yet.
        self._context = ""
        self._held = 0

        self._pieces: list[str] = []
        self._num_tokens = 0
        self._matched_stop: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All text returned by `push` so far, joined."""
        return "".join(self._pieces)

    @property
    def num_tokens(self) -> int:
        """How many token ids have been pushed, including any after a stop string."""
        return self._num_tokens

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the stream, or ``None``."""
        return self._matched_stop

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the stream; later pushes return ''."""
        return self._matched_stop is not None

    @property
    def finished(self) -> bool:
        """Whether the final push (``finished=True``) has been made."""
        return self._finished

    def push(self, new_ids: Sequence[int], *, finished: bool = False) -> str:
        """Feed the next output ids and return the text that is now safe to stream.

        Args:
            new_ids: Ids generated since the last push; may be empty.
            finished: This is the last push: flush everything held back. A trailing
                incomplete character then comes out as U+FFFD, as in a one-shot decode.

        Returns:
            The newly committed piece of text, possibly ''.

        Raises:
            RuntimeError: The request was already finished.
        """
        if self._finished:
            raise RuntimeError("push after the final push (finished=True) of this request")
        self._num_tokens += len(new_ids)
        self._finished = finished
        if self._matched_stop is not None:
            return ""
        table = self._bytes
        if table is None:
            text = self._decode(new_ids, finished)
        else:
            if len(new_ids) == 1 and 0 <= new_ids[0] < len(table):
                data = table[new_ids[0]]
            else:
                data = self._join_bytes(table, new_ids)
            if self._partial:
                data = self._partial + data
            # Lossy UTF-8 decoding that stops before an incomplete last character (all of
            # it on the final push): joined, exactly the one-shot decode of every byte.
            text, used = utf_8_decode(data, "replace", finished)
            self._partial = data[used:] if used < len(data) else b""
        piece = self._filter_stops(text, finished) if self._stops else text
        if piece:
            self._pieces.append(piece)
        return piece

    def _join_bytes(self, table: tuple[bytes, ...], ids: Sequence[int]) -> bytes:
        """The bytes of ``ids``; an id outside the vocabulary is what the tokenizer makes
        of it (nothing, or its error for a negative id)."""
        size = len(table)
        out = []
        for i in ids:
            if 0 <= i < size:
                out.append(table[i])
            else:
                self._tokenizer.decode([i], skip_special_tokens=self._skip_special_tokens)
        return b"".join(out)

    def _decode(self, new_ids: Sequence[int], finished: bool) -> str:
        """Layer 1: decode the window and return the final new text, all of it final."""
        window = self._window
        skipped = self._skipped
        if skipped and not skipped.isdisjoint(new_ids):  # one C-level look, nearly always
            new_ids = [i for i in new_ids if i not in skipped]
        window.extend(new_ids)
        if self._prefix_text is None:
            self._prefix_text = self._tokenizer.decode(
                window[: self._prefix_len], skip_special_tokens=self._skip_special_tokens
            )
        full = self._tokenizer.decode(window, skip_special_tokens=self._skip_special_tokens)
        tail = full[len(self._prefix_text) :]
        held = self._waited < _MAX_WAITS and not finished
        if held and tail.endswith(_REPLACEMENT):
            # Possibly the first bytes of a character whose last bytes are still to come.
            # Lossy UTF-8 decoding makes an incomplete ending one U+FFFD, a byte-fallback
            # decoder one per byte token (Llama's, Mistral's): the trailing run waits.
            ready = len(tail.rstrip(_REPLACEMENT))
            piece = tail[self._tail_emitted : ready]
            self._tail_emitted = max(self._tail_emitted, ready)
            self._waited += bool(new_ids)
            return piece
        if held and not tail:
            # Ids that decode to nothing (a skipped special token) or none at all: the
            # window keeps its prefix, the left context of the text to come (a decoder
            # drops the space that starts a text, and WordPiece glues a "##" piece to
            # what is before it).
            self._waited += bool(new_ids)
            return ""
        if not tail and not finished:
            # Past `_MAX_WAITS` of them: ids that add no text leave the window, which keeps
            # its prefix (sliding would make them the next left context, and lose it).
            del window[self._prefix_len :]
            self._waited = 0
            return ""
        piece = tail[self._tail_emitted :]
        # Commit: the window slides so the ids just decoded become the next prefix (the
        # decoder sees a little left context, which decoders that strip a leading space
        # need), and everything older is dropped. After `_MAX_WAITS` pushes that waited
        # it slides whatever their text, so that a push's cost stays bounded.
        del window[: self._prefix_len]
        self._prefix_len = len(window)
        self._prefix_text = None
        self._tail_emitted = 0
        self._waited = 0
        return piece

    def _filter_stops(self, text: str, finished: bool) -> str:
        """Layer 2: cut at the first stop string; hold back what may start one."""
        if not self._stops:
            return text
        buf = self._context + text
        # Everything before `start` has been returned already.
        start = len(self._context) - self._held
        match = self._find_stop(buf)
        if match is not None:
            stop, begin = match
            self._matched_stop = stop
            cut = begin + len(stop) if self._no_stop_trim else begin
            # A trimmed stop string never began in returned text: that text was held.
            return buf[start:cut]
        # Nothing is held when nothing more can follow, or when a stop string would be kept
        # anyway: then there is no reason to wait and see whether one completes.
        held = 0 if finished or self._no_stop_trim else self._held_suffix_len(text)
        end = max(len(buf) - held, start)
        keep = min(len(buf), self._context_len)
        self._context = buf[len(buf) - keep :]
        self._held = len(buf) - end
        return buf[start:end]

    def _find_stop(self, buf: str) -> tuple[str, int] | None:
        """The stop string whose first occurrence in ``buf`` ends first, and its start."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            begin = buf.find(stop)
            if begin < 0:
                continue
            # Earliest end first, then earliest start (the longer of two that end together).
            candidate = (begin + len(stop), begin, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[2], best[1])

    def _held_suffix_len(self, text: str) -> int:
        """Feed ``text``, committed after everything fed before, to each stop string's
        matcher; the length of the longest suffix of all the text fed that is a proper
        prefix of a stop string."""
        held = 0
        matched = self._matched
        for i, (stop, table) in enumerate(self._matchers):
            state, size = matched[i], len(stop)
            if not state and stop[0] not in text:
                continue  # nothing begun, and nothing begins: the common case, in C
            for char in text:
                while state and (state == size or stop[state] != char):
                    state = table[state - 1]
                if stop[state] == char:
                    state += 1
            matched[i] = state
            # A whole stop string (a match, which `_find_stop` sees first) holds its
            # longest proper prefix that it ends with.
            proper = table[size - 1] if state == size else state
            if proper > held:
                held = proper
        return held


def _prefix_function(word: str) -> list[int]:
    """For each length k of ``word``'s prefixes, the longest proper prefix of
    ``word[:k]`` that is also its suffix (Knuth-Morris-Pratt's table)."""
    table = [0] * len(word)
    k = 0
    for i in range(1, len(word)):
        while k and word[i] != word[k]:
            k = table[k - 1]
        if word[i] == word[k]:
            k += 1
        table[i] = k
    return table


class DetokenizerStates(Generic[OriginT]):
    """The live `IncrementalDetokenizer` of every request, with a cap on how many.

    A state is keyed by ``(origin, rid)``: the rid is the caller's and is not trusted to be
    unique across workers (a request resubmitted after its worker died keeps its rid), the
    origin (worker id and incarnation) is what tells two such requests apart.

    Args:
        tokenizer: Shared by every state.
        max_states: Cap on live states; `create` beyond it raises `TooManyRequestsError`.

    Raises:
        ValueError: ``max_states`` is not positive.
    """

    def __init__(self, tokenizer: SupportsDecode, *, max_states: int) -> None:
        if max_states < 1:
            raise ValueError(f"max_states must be at least 1, got {max_states}")
        self._tokenizer = tokenizer
        self._max_states = max_states
        self._states: dict[tuple[OriginT, str], IncrementalDetokenizer] = {}
        # origin -> rids, so dropping a dead worker's states costs O(its requests).
        self._by_origin: dict[OriginT, set[str]] = {}

    @property
    def max_states(self) -> int:
        """The cap on live states."""
        return self._max_states

    def create(
        self,
        origin: OriginT,
        rid: str,
        *,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
        skip_special_tokens: bool = True,
    ) -> IncrementalDetokenizer:
        """Start tracking a request and return its new state.

        Args:
            origin: The worker (id and incarnation) that owns the request.
            rid: The request id.
            stop: Stop strings, as for `IncrementalDetokenizer`.
            no_stop_trim: As for `IncrementalDetokenizer`.
            skip_special_tokens: As for `IncrementalDetokenizer`.

        Returns:
            The new state.

        Raises:
            TooManyRequestsError: ``max_states`` states are already live.
            KeyError: A state for ``(origin, rid)`` is already live.
            ValueError: A stop string is empty.
        """
        key = (origin, rid)
        if key in self._states:
            raise KeyError(f"request {rid!r} from {origin} already has a detokenizer state")
        if len(self._states) >= self._max_states:
            raise TooManyRequestsError(self._max_states)
        state = IncrementalDetokenizer(
            self._tokenizer,
            stop=stop,
            no_stop_trim=no_stop_trim,
            skip_special_tokens=skip_special_tokens,
        )
        self._states[key] = state
        self._by_origin.setdefault(origin, set()).add(rid)
        return state

    def get(self, origin: OriginT, rid: str) -> IncrementalDetokenizer | None:
        """Return the live state of a request, or ``None``."""
        return self._states.get((origin, rid))

    def pop(self, origin: OriginT, rid: str) -> IncrementalDetokenizer | None:
        """Stop tracking a request (it finished or was aborted) and return its state.

        Returns:
            The state, or ``None`` if the request was not tracked.
        """
        state = self._states.pop((origin, rid), None)
        if state is not None:
            rids = self._by_origin[origin]
            rids.discard(rid)
            if not rids:
                del self._by_origin[origin]
        return state

    def drop_origin(self, origin: OriginT) -> list[str]:
        """Drop every state of one origin, e.g. a worker incarnation that died.

        Returns:
            The rids whose states were dropped.
        """
        rids = sorted(self._by_origin.pop(origin, ()))
        for rid in rids:
            del self._states[(origin, rid)]
        return rids

    def origins(self) -> Iterator[OriginT]:
        """Iterate over the origins that have live states."""
        return iter(list(self._by_origin))

    def __len__(self) -> int:
        """Number of live states."""
        return len(self._states)

    def __contains__(self, key: object) -> bool:
        """Whether an ``(origin, rid)`` pair has a live state."""
        return key in self._states
