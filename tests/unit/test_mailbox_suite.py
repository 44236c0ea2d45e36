"""The mailbox suite's order of measurement (`benchmarks.mailbox.groups`)."""

from __future__ import annotations

from benchmarks.mailbox import TWINS, groups, variants


def test_variants_compared_closely_are_measured_round_by_round_with_their_subject() -> None:
    # Compared by a name the variants do not have, the twins were measured each in a run
    # of its own, minutes apart: the ratios read the machine's drift.
    todo = variants()
    measured = groups(todo)
    named = {(group[0].name, group[0].payload): [v.name for v in group[1:]] for group in measured}
    for payload in ("small", "batch"):
        assert named["tell", payload] == ["tell_nometrics", "tell_traced", "tell_traced_new"]
        assert named["ask", payload] == ["ask_sync", "ask_asyncio"]
    assert named["tell", "logprobs"] == []  # its twins are not measured
    twins = {t for ts in TWINS.values() for t in ts}
    assert not [key for key in named if key[0] in twins]
    # Every variant once, in the order they are listed but for the twins.
    assert sorted(v.prefix for group in measured for v in group) == sorted(v.prefix for v in todo)
    assert [g[0] for g in measured] == [v for v in todo if v.name not in twins]
