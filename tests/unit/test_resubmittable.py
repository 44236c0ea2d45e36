"""The one rule both doors into the pipeline resubmit by (`actors._errors.resubmittable`)."""

from __future__ import annotations

from actors._errors import MAX_RESUBMITS, resubmittable
from actors.messages import Member


def test_a_request_lost_before_any_output_is_started_again_up_to_the_bound() -> None:
    assert [resubmittable(Member.SCHEDULER, False, n) for n in range(MAX_RESUBMITS + 1)] == [
        *[True] * MAX_RESUBMITS,
        False,
    ]


def test_a_refusal_and_a_request_whose_output_reached_its_caller_are_final() -> None:
    assert not resubmittable(None, False, 0)  # refused: not lost to a death
    assert not resubmittable(Member.WORKER, True, 0)  # text sent cannot be taken back
