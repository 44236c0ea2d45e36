"""Two "hosts" on one machine for these tests (`benchmarks._netns`): root only, as CI runs."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

from benchmarks._netns import Hosts, NodeProcess, two_hosts

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["Hosts", "NodeProcess"]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    """This namespace (host A) and a second one (host B), for the module's tests."""
    if os.geteuid() != 0:
        pytest.fail("the multi-host tests need root (network namespaces): CI runs as root")
    with two_hosts() as pair:
        yield pair
