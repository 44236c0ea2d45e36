"""The pipeline's metrics, on one screen: names, units, buckets and labels follow vLLM's
(``vllm:`` becomes ``tokenyard:``, and every series carries ``model_name``), so routers,
dashboards and load generators written for vLLM read them as they are.

Each family lives in the process that measures it (`runtime.metrics`) and the system's
`runtime.MetricsCollector` sums them over processes; where the sum would hide who did what,
a label tells (``worker``, ``detokenizer``, ``member``). Bucket bounds are vLLM's: the time to
first token's reaches 2,560 s, the inter-token latency's 80 s, and the request latencies'
(end to end, queue) 7,680 s.
"""

from __future__ import annotations

from runtime import metrics

__all__ = (
    "DETOKENIZER_LIVE_STATES",
    "E2E_LATENCY",
    "GENERATION_TOKENS",
    "HTTP_DISCONNECTS",
    "HTTP_ERRORS",
    "HTTP_REQUESTS",
    "HTTP_REQUESTS_ACTIVE",
    "HTTP_STREAMS",
    "INTER_TOKEN_LATENCY",
    "MEMBER_RESTARTS",
    "NUM_REQUESTS_RUNNING",
    "NUM_REQUESTS_WAITING",
    "PROMPT_TOKENS",
    "QUEUE_TIME",
    "REQUEST_SUCCESS",
    "RESUBMISSIONS",
    "TIME_TO_FIRST_TOKEN",
    "WORKER_DIED_ERRORS",
    "WORKER_REQUESTS",
)

PREFIX = "tokenyard:"
MODEL = ("model_name",)

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# -- measured by each tokenizer worker, for the requests it serves --------------------------

TIME_TO_FIRST_TOKEN = metrics.histogram(
    f"{PREFIX}time_to_first_token_seconds",
    "Histogram of time to first token in seconds (request admitted by its worker to its "
    "first output there).",
    TTFT_BUCKETS,
    MODEL,
)
INTER_TOKEN_LATENCY = metrics.histogram(
    f"{PREFIX}inter_token_latency_seconds",
    "Histogram of inter-token latency in seconds (between two outputs of a request, one "
    "token each in the stand-in engine).",
    ITL_BUCKETS,
    MODEL,
)
E2E_LATENCY = metrics.histogram(
    f"{PREFIX}e2e_request_latency_seconds",
    "Histogram of e2e request latency in seconds (admitted by its worker to its last output).",
    REQUEST_LATENCY_BUCKETS,
    MODEL,
)
PROMPT_TOKENS = metrics.counter(
    f"{PREFIX}prompt_tokens_total", "Number of prefill tokens processed.", MODEL
)
GENERATION_TOKENS = metrics.counter(
    f"{PREFIX}generation_tokens_total", "Number of generation tokens processed.", MODEL
)
REQUEST_SUCCESS = metrics.counter(
    f"{PREFIX}request_success_total",
    "Count of successfully processed requests.",
    (*MODEL, "finished_reason"),
)
WORKER_REQUESTS = metrics.counter(
    f"{PREFIX}worker_requests_total",
    "Requests a tokenizer worker served to their end, by worker index.",
    (*MODEL, "worker"),
)

# -- read from each serving worker's HTTP app when gathered (`actors.http.HTTPStatistics`) --

HTTP_REQUESTS = metrics.counter(
    f"{PREFIX}http_requests_total",
    "HTTP requests a serving worker's app received, by worker (refusals of its HTTP parser, "
    "before the app, aside).",
    (*MODEL, "worker"),
)
HTTP_REQUESTS_ACTIVE = metrics.gauge(
    f"{PREFIX}http_requests_active",
    "HTTP requests a serving worker is answering now, by worker.",
    (*MODEL, "worker"),
)
HTTP_STREAMS = metrics.counter(
    f"{PREFIX}http_streams_total",
    "Streamed answers a serving worker began (status 200 sent), by worker.",
    (*MODEL, "worker"),
)
HTTP_ERRORS = metrics.counter(
    f"{PREFIX}http_errors_total",
    "Error answers of a serving worker, by worker and status class: 4xx, or 5xx (streams "
    "ended by an error event included).",
    (*MODEL, "worker", "status_class"),
)
HTTP_DISCONNECTS = metrics.counter(
    f"{PREFIX}http_disconnects_total",
    "HTTP requests a serving worker abandoned because their client disconnected, by worker.",
    (*MODEL, "worker"),
)

# -- measured by the scheduler ---------------------------------------------------------------

QUEUE_TIME = metrics.histogram(
    f"{PREFIX}request_queue_time_seconds",
    "Histogram of time spent in WAITING phase for request.",
    REQUEST_LATENCY_BUCKETS,
    MODEL,
)
NUM_REQUESTS_RUNNING = metrics.gauge(
    f"{PREFIX}num_requests_running", "Number of requests in model execution batches.", MODEL
)
NUM_REQUESTS_WAITING = metrics.gauge(
    f"{PREFIX}num_requests_waiting", "Number of requests waiting to be processed.", MODEL
)

# -- measured by each detokenizer ------------------------------------------------------------

DETOKENIZER_LIVE_STATES = metrics.gauge(
    f"{PREFIX}detokenizer_live_states",
    "Requests with a live incremental detokenization state, by detokenizer.",
    (*MODEL, "detokenizer"),
)

# -- measured where requests are resolved after a member's death -----------------------------

MEMBER_RESTARTS = metrics.counter(
    f"{PREFIX}member_restarts_total",
    "Deaths of a pipeline member, each followed by its restart, by member and cause.",
    (*MODEL, "member", "cause"),
)
RESUBMISSIONS = metrics.counter(
    f"{PREFIX}resubmissions_total",
    "Requests started again on another worker after a member's death cost them their "
    "output before any reached the client.",
    MODEL,
)
WORKER_DIED_ERRORS = metrics.counter(
    f"{PREFIX}worker_died_errors_total",
    "Requests failed because a member died after output had reached the client "
    "(WorkerDiedError), by the member lost.",
    (*MODEL, "member"),
)
