"""The connections the open-file limit lets each process of the server hold
(`actors.http._descriptors`)."""

from __future__ import annotations

import resource

from actors.http import ServeConfig
from actors.http._descriptors import (
    OWNER_FDS,
    OWNER_FDS_PER_PROCESS,
    WORKER_FDS,
    WORKER_FDS_PER_DETOKENIZER,
    connection_bounds,
)
from actors.http._serve import FDS_AT_REST, FDS_PER_PROCESS


class TestConnectionBounds:
    def test_a_high_limit_keeps_max_connections_and_says_nothing(self) -> None:
        config = ServeConfig()
        bounds = connection_bounds(config, 4, 2, limit=1 << 20)
        assert bounds.max_connections == config.max_connections
        assert bounds.hold == (1 << 20) - (OWNER_FDS + OWNER_FDS_PER_PROCESS * 9)
        assert bounds.lowered(config, 4) is None

    def test_a_low_limit_lowers_each_workers_bound_to_what_it_leaves(self) -> None:
        config = ServeConfig()
        bounds = connection_bounds(config, 1, 1, limit=100)
        reserve = WORKER_FDS + WORKER_FDS_PER_DETOKENIZER
        assert bounds.max_connections == 100 - reserve
        # The owner: its own sockets, and those of its 5 processes.
        assert bounds.hold == 100 - (OWNER_FDS + OWNER_FDS_PER_PROCESS * 5)

    def test_the_lowest_limit_serve_starts_with_leaves_each_process_some_connections(
        self,
    ) -> None:
        for workers in (1, 2, 4, 8, 32):
            detokenizers = max(1, workers // 2)
            # What check_fd_limit asks for at the least.
            limit = FDS_AT_REST + FDS_PER_PROCESS * (workers + detokenizers + 3)
            bounds = connection_bounds(ServeConfig(), workers, detokenizers, limit=limit)
            assert bounds.max_connections >= 32, (workers, bounds)
            assert bounds.hold is not None
            assert bounds.hold >= 8 + workers, (workers, bounds)

    def test_a_bound_lower_than_max_connections_is_kept_as_it_is(self) -> None:
        config = ServeConfig(max_connections=10, max_waiting=5)
        bounds = connection_bounds(config, 1, 1, limit=200)
        assert bounds.max_connections == 10
        assert bounds.lowered(config, 1) is None

    def test_no_limit_bounds_nothing(self) -> None:
        config = ServeConfig()
        bounds = connection_bounds(config, 2, 1, limit=None)
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            assert (bounds.max_connections, bounds.hold) == (config.max_connections, None)
        else:  # this process's own limit
            assert bounds.limit == soft

    def test_its_warning_is_one_line_naming_the_limit_the_bounds_and_the_knobs(self) -> None:
        config = ServeConfig()
        bounds = connection_bounds(config, 1, 1, limit=100)
        warning = bounds.lowered(config, 1)
        assert warning is not None
        assert "\n" not in warning
        assert warning.startswith(
            "the open-file limit (RLIMIT_NOFILE) is 100: each worker serves at most 58 "
            "connections at once, not --max-connections 2048 and the port's owner keeps at "
            "most 25 connections waiting, not --max-waiting 1024; past that"
        )
        # Enough for both as configured: 2048 and a worker's 42, or the owner's.
        assert "ulimit -n 2090, or LimitNOFILE= under systemd" in warning
        owner_only = connection_bounds(ServeConfig(max_connections=10), 1, 1, limit=200)
        warning = owner_only.lowered(ServeConfig(max_connections=10), 1)
        assert warning is not None
        assert "each worker" not in warning
        # The queue, 64 handed to the worker and not taken, 256 refusals lingering, the
        # one just accepted, and the owner's own 74.
        assert "ulimit -n 1419," in warning
        assert "--max-connections" in warning
