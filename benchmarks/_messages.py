"""The messages every mailbox benchmark sends, defined once for tokenyard and the baselines.

Two shapes matter for an LLM front end: a *small* request (a few scalar fields, the shape of
a control message or one generate request) and a *batch* output shaped like SGLang's
``BatchTokenIDOutput`` (one entry per running request in each of ~25 index-aligned list
fields), which the engine emits every decode step, in its two forms: without logprobs (the
common step: SGLang sends ``None`` for every logprob field when no request of the batch asked
for them) and with them (every logprob field then carries one list per request, empty for
requests that did not ask). Each shape exists twice: as a tokenyard
``Message`` (msgspec, ``array_like=True``) and as the plain ``@dataclass`` SGLang pickles
with ``send_pyobj``, with the same fields and the same values.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import msgspec

from runtime import Message, Request

#: Requests in one batch output: a typical running batch of a busy decode step.
BATCH_SIZE = 32
#: The trace context a traced message or request carries (W3C's example).
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class SmallRequest(Message, array_like=True):
    """A small message: a few int and str fields."""

    rid: str
    worker: int
    seq: int
    max_new_tokens: int
    text: str


class BatchTokenIDOutput(Message, array_like=True):
    """One decode step's output for a running batch, field for field like SGLang's.

    Every field is a list with one entry per request (``rids[i]`` goes with
    ``decode_ids[i]``). As in SGLang 0.5.3's ``stream_output_generation``, the logprob fields
    are ``None`` when no request of the batch asked for logprobs, else they hold one list per
    request (empty for requests that did not ask); hidden states and placeholder tokens are
    ``None`` unless requested.
    """

    rids: list[str]
    finished_reasons: list[str | None]
    decoded_texts: list[str]
    decode_ids: list[list[int]]
    read_offsets: list[int]
    output_ids: list[list[int]]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    spec_verify_ct: list[int]
    input_token_logprobs_val: list[list[float]] | None
    input_token_logprobs_idx: list[list[int]] | None
    output_token_logprobs_val: list[list[float]] | None
    output_token_logprobs_idx: list[list[int]] | None
    input_top_logprobs_val: list[list[list[float]]] | None
    input_top_logprobs_idx: list[list[list[int]]] | None
    output_top_logprobs_val: list[list[list[float]]] | None
    output_top_logprobs_idx: list[list[list[int]]] | None
    input_token_ids_logprobs_val: list[list[float]] | None
    input_token_ids_logprobs_idx: list[list[int]] | None
    output_token_ids_logprobs_val: list[list[float]] | None
    output_token_ids_logprobs_idx: list[list[int]] | None
    output_hidden_states: list[list[float]] | None
    placeholder_tokens_idx: list[list[int] | None] | None
    placeholder_tokens_val: list[list[int] | None] | None


class Ack(Message, array_like=True):
    """The reply to an ask: a count (or the sequence number echoed)."""

    n: int


class CountQuery(Request[Ack], array_like=True):
    """Asks a counting actor how many messages it has handled."""


class SmallAsk(SmallRequest, Request[Ack], array_like=True, tag="SmallRequest"):
    """``SmallRequest`` asked, answered with an ``Ack``: the same bytes on the wire (its tag
    is ``SmallRequest``'s), typed as a request."""


class BatchAsk(BatchTokenIDOutput, Request[Ack], array_like=True, tag="BatchTokenIDOutput"):
    """``BatchTokenIDOutput`` asked, answered with an ``Ack``: the same bytes on the wire."""


# The pickled twins. SGLang's io_struct classes are plain (non-slots) dataclasses; these
# have the same field names, types and values so send_pyobj pays exactly what SGLang pays.


@dataclass
class SmallRequestObj:
    """``SmallRequest`` as a plain dataclass (the send_pyobj baseline)."""

    rid: str
    worker: int
    seq: int
    max_new_tokens: int
    text: str


@dataclass
class BatchTokenIDOutputObj:
    """``BatchTokenIDOutput`` as a plain dataclass (the send_pyobj baseline)."""

    rids: list[str]
    finished_reasons: list[str | None]
    decoded_texts: list[str]
    decode_ids: list[list[int]]
    read_offsets: list[int]
    output_ids: list[list[int]]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    spec_verify_ct: list[int]
    input_token_logprobs_val: list[list[float]] | None
    input_token_logprobs_idx: list[list[int]] | None
    output_token_logprobs_val: list[list[float]] | None
    output_token_logprobs_idx: list[list[int]] | None
    input_top_logprobs_val: list[list[list[float]]] | None
    input_top_logprobs_idx: list[list[list[int]]] | None
    output_top_logprobs_val: list[list[list[float]]] | None
    output_top_logprobs_idx: list[list[list[int]]] | None
    input_token_ids_logprobs_val: list[list[float]] | None
    input_token_ids_logprobs_idx: list[list[int]] | None
    output_token_ids_logprobs_val: list[list[float]] | None
    output_token_ids_logprobs_idx: list[list[int]] | None
    output_hidden_states: list[list[float]] | None
    placeholder_tokens_idx: list[list[int] | None] | None
    placeholder_tokens_val: list[list[int] | None] | None


#: Payload names the CLI and the peers use.
PAYLOADS = ("small", "batch", "logprobs")

_VOCAB = 32_000
_WORDS = ("the", "model", "token", "stream", "actor", "batch", "decode", "of", "a", "in")


def make_small(seed: int = 0) -> SmallRequest:
    """A representative small request (deterministic for a given seed)."""
    rng = random.Random(seed)
    return SmallRequest(
        rid=rng.randbytes(16).hex(),
        worker=rng.randrange(4),
        seq=rng.randrange(1_000_000),
        max_new_tokens=128,
        text=" ".join(rng.choice(_WORDS) for _ in range(6)),
    )


def make_batch(
    seed: int = 0, size: int = BATCH_SIZE, *, logprobs: bool = False
) -> BatchTokenIDOutput:
    """A representative decode-step output of ``size`` requests (deterministic for a seed).

    Sizes follow a streaming decode step: 1-8 new token ids per request, rids of 32 hex
    characters, a few dozen characters of decoded text. With ``logprobs``, about half of the
    requests asked for output logprobs and every logprob field holds one list per request,
    as SGLang fills them (no input logprobs or top logprobs on a decode step: empty lists);
    without, every logprob field is ``None``.
    """
    rng = random.Random(seed)
    new = [rng.randint(1, 8) for _ in range(size)]
    ids = [[rng.randrange(_VOCAB) for _ in range(k)] for k in new]
    wants_logprobs = [rng.random() < 0.5 for _ in range(size)]

    def empty() -> list[Any] | None:
        # A fresh list per request, as a real batch has (no shared inner objects).
        return [[] for _ in range(size)] if logprobs else None

    completion = [rng.randint(1, 512) for _ in range(size)]
    output_val = [
        [-rng.random() * 5 for _ in range(k)] if want else []
        for k, want in zip(new, wants_logprobs, strict=True)
    ]
    output_idx = [list(x) if want else [] for x, want in zip(ids, wants_logprobs, strict=True)]
    return BatchTokenIDOutput(
        rids=[rng.randbytes(16).hex() for _ in range(size)],
        finished_reasons=[
            rng.choice(("stop", "length")) if rng.random() < 0.05 else None for _ in range(size)
        ],
        decoded_texts=[
            " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 12))) for _ in range(size)
        ],
        decode_ids=ids,
        read_offsets=[rng.randint(0, 64) for _ in range(size)],
        output_ids=[list(x) for x in ids],
        skip_special_tokens=[True] * size,
        spaces_between_special_tokens=[True] * size,
        no_stop_trim=[False] * size,
        prompt_tokens=[rng.randint(16, 2048) for _ in range(size)],
        completion_tokens=completion,
        cached_tokens=[rng.randint(0, 1024) for _ in range(size)],
        spec_verify_ct=[0] * size,
        input_token_logprobs_val=empty(),
        input_token_logprobs_idx=empty(),
        output_token_logprobs_val=output_val if logprobs else None,
        output_token_logprobs_idx=output_idx if logprobs else None,
        input_top_logprobs_val=empty(),
        input_top_logprobs_idx=empty(),
        output_top_logprobs_val=empty(),
        output_top_logprobs_idx=empty(),
        input_token_ids_logprobs_val=empty(),
        input_token_ids_logprobs_idx=empty(),
        output_token_ids_logprobs_val=empty(),
        output_token_ids_logprobs_idx=empty(),
        output_hidden_states=None,
        placeholder_tokens_idx=None,
        placeholder_tokens_val=None,
    )


def make_message(payload: str, seed: int = 0) -> SmallRequest | BatchTokenIDOutput:
    """The tokenyard message of a payload shape (one of ``PAYLOADS``)."""
    if payload == "small":
        return make_small(seed)
    if payload in ("batch", "logprobs"):
        return make_batch(seed, logprobs=payload == "logprobs")
    raise ValueError(f"unknown payload {payload!r}; choose one of {PAYLOADS}")


def make_ask(payload: str, seed: int = 0) -> SmallAsk | BatchAsk:
    """The tokenyard request of a payload shape: `make_message`'s fields, asked."""
    msg = make_message(payload, seed)
    fields = msgspec.structs.asdict(msg)
    return SmallAsk(**fields) if isinstance(msg, SmallRequest) else BatchAsk(**fields)


def message_type(payload: str) -> type[SmallRequest] | type[BatchTokenIDOutput]:
    """The tokenyard message class of a payload shape."""
    return SmallRequest if payload == "small" else BatchTokenIDOutput


def as_dataclass(msg: SmallRequest | BatchTokenIDOutput) -> SmallRequestObj | BatchTokenIDOutputObj:
    """The pickled twin of a message: the same field values in the plain dataclass."""
    fields = msgspec.structs.asdict(msg)
    if isinstance(msg, SmallRequest):
        return SmallRequestObj(**fields)
    return BatchTokenIDOutputObj(**fields)
