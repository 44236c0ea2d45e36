"""Tests for `runtime._batch`: the generic split and merge of index-aligned batches."""

from __future__ import annotations

import gc
import types
from typing import Annotated, Any, ClassVar, Optional, Union, get_args, get_origin

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from actors import messages
from runtime._batch import Batch
from runtime._errors import ProtocolError

# Property tests draw small batches: the bugs they look for (a field left out, an order
# mixed up, a None turned into a list) show at a handful of items, and in few examples.
# Twenty each, over 114 cases: drawing batches of some thirty fields is most of this file's
# time, which was the suite's largest share of CPU at forty.
PROPERTY = settings(max_examples=20, deadline=None)


class TokenOutput(Batch):
    """Map-like, shaped like SGLang's BatchTokenIDOutput, with two shared fields."""

    shared_fields: ClassVar[tuple[str, ...]] = ("step", "model")

    rids: list[str]
    origins: list[int]
    finished_reasons: list[str | None]
    decode_ids: list[list[int]]
    read_offsets: list[int]
    output_logprobs: list[list[float]] | None = None
    spec_verify_ct: Optional[list[int]] = None  # noqa: UP045 -- the typing.Optional spelling
    step: int = 0
    model: str = ""


class HotOutput(Batch, array_like=True, gc=False):
    """Array-like and untracked by the cycle collector, as hot messages may be."""

    rids: list[str]
    output_ids: list[list[int]]
    texts: Annotated[list[str], msgspec.Meta(max_length=1024)] | None = None
    meta: list[dict[str, int]] | None = None


class StopTable(Batch, array_like=True):
    """A shared field that is itself a list, and an Optional spelled with Union."""

    shared_fields: ClassVar[tuple[str, ...]] = ("stop_ids",)

    rids: list[str]
    stop_ids: list[int] = msgspec.field(default_factory=list)
    scores: Union[list[float], None] = None  # noqa: UP007 -- the typing.Union spelling


SAMPLES: tuple[type[Batch], ...] = (TokenOutput, HotOutput, StopTable)

#: The pipeline's real batch types, found in its vocabulary rather than listed here, so a
#: batch type added to `actors.messages` is put through every property below too.
PIPELINE: tuple[type[Batch], ...] = tuple(
    obj
    for obj in vars(messages).values()
    if isinstance(obj, type) and issubclass(obj, Batch) and obj.__module__ == messages.__name__
)

#: Every batch type the properties run over; each property runs once per type.
BATCH_TYPES = SAMPLES + PIPELINE
each_batch_type = pytest.mark.parametrize("cls", BATCH_TYPES, ids=lambda cls: cls.__name__)


def _strip(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _values(annotation: Any) -> st.SearchStrategy[Any]:
    """A strategy for values of ``annotation``, all exactly representable in msgpack.

    Raises:
        NotImplementedError: No strategy for that type: a batch field of a new type must
            extend this function (a test checks every real batch field has one).
    """
    annotation = _strip(annotation)
    origin = get_origin(annotation)
    args = get_args(annotation)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return st.integers(min_value=-(2**63), max_value=2**63 - 1)
    if annotation is float:
        # NaN is not equal to itself, which would fail every equality below for no reason.
        return st.floats(allow_nan=False)
    if annotation is str:
        return st.text(max_size=4)
    if annotation is bytes:
        return st.binary(max_size=8)
    if annotation is type(None):
        return st.none()
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        # A nested struct (Origin): each of its fields from its own annotation.
        fields = {info.name: _values(info.type) for info in msgspec.structs.fields(annotation)}
        return st.builds(annotation, **fields)
    if origin is list:
        return st.lists(_values(args[0]), max_size=3)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_values(args[0]), max_size=3).map(tuple)
        return st.tuples(*(_values(arg) for arg in args))
    if origin is dict:
        return st.dictionaries(_values(args[0]), _values(args[1]), max_size=2)
    if origin is Union or origin is types.UnionType:
        return st.one_of([_values(arg) for arg in args])
    raise NotImplementedError(f"no strategy for {annotation!r}")


def _item_type(annotation: Any) -> tuple[Any, bool]:
    """Split ``list[X]`` / ``list[X] | None`` into ``X`` and whether None is allowed."""
    annotation = _strip(annotation)
    if get_origin(annotation) is list:
        return get_args(annotation)[0], False
    (inner,) = (_strip(arg) for arg in get_args(annotation) if arg is not type(None))
    return get_args(inner)[0], True


@st.composite
def _batches(draw: st.DrawFn, cls: type[Batch], size: int) -> Batch:
    kwargs: dict[str, Any] = {}
    for info in msgspec.structs.fields(cls):
        if info.name in cls.shared_fields:
            kwargs[info.name] = draw(_values(info.type))
            continue
        item, optional = _item_type(info.type)
        column = st.lists(_values(item), min_size=size, max_size=size)
        kwargs[info.name] = draw(st.none() | column if optional else column)
    return cls(**kwargs)


@st.composite
def batches(draw: st.DrawFn, cls: type[Batch], min_size: int = 0) -> Batch:
    """A batch of ``cls``, any size up to 8."""
    size = draw(st.integers(min_value=min_size, max_value=8))
    return draw(_batches(cls, size))


@st.composite
def batches_with_keys(
    draw: st.DrawFn, cls: type[Batch], min_size: int = 0
) -> tuple[Batch, list[str]]:
    """A batch and one key per item, from a small alphabet so that keys repeat."""
    batch = draw(batches(cls, min_size))
    keys = st.sampled_from("wxyz")
    size = batch.batch_size
    return batch, draw(st.lists(keys, min_size=size, max_size=size))


@st.composite
def batches_with_permutation(draw: st.DrawFn, cls: type[Batch]) -> tuple[Batch, list[int]]:
    """A batch and a permutation of its item positions."""
    batch = draw(batches(cls))
    return batch, draw(st.permutations(range(batch.batch_size)))


def _column(batch: Batch, name: str) -> Any:
    return getattr(batch, name)


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, index in enumerate(order):
        inverse[index] = position
    return inverse


def _token_output(size: int = 3) -> TokenOutput:
    return TokenOutput(
        rids=[f"r{i}" for i in range(size)],
        origins=[i % 2 for i in range(size)],
        finished_reasons=[None] * size,
        decode_ids=[[i, i + 1] for i in range(size)],
        read_offsets=list(range(size)),
        step=7,
        model="m",
    )


class TestClassDefinition:
    def test_per_item_fields_are_all_fields_but_the_shared_ones_in_declaration_order(
        self,
    ) -> None:
        assert TokenOutput._item_fields == (
            "rids",
            "origins",
            "finished_reasons",
            "decode_ids",
            "read_offsets",
            "output_logprobs",
            "spec_verify_ct",
        )
        assert StopTable._item_fields == ("rids", "scores")

    def test_a_per_item_field_that_is_not_a_list_is_rejected_with_the_fix(self) -> None:
        with pytest.raises(TypeError, match=r"Scalar\.step .*add 'step' to .*shared_fields"):

            class Scalar(Batch):
                rids: list[str]
                step: int = 0

    @pytest.mark.parametrize("annotation", ["tuple[int, ...]", "list[int] | str", "set[int]"])
    def test_other_container_annotations_are_rejected(self, annotation: str) -> None:
        namespace: dict[str, Any] = {
            "__module__": __name__,
            "__annotations__": {"items": annotation},
        }
        with pytest.raises(TypeError, match=r"\.items is annotated"):
            types.new_class("Odd", (Batch,), exec_body=lambda ns: ns.update(namespace))

    def test_a_shared_field_that_does_not_exist_is_rejected(self) -> None:
        with pytest.raises(TypeError, match=r"Typo\.shared_fields names \['setp'\]"):

            class Typo(Batch):
                shared_fields: ClassVar[tuple[str, ...]] = ("setp",)
                rids: list[str]
                step: int = 0

    def test_an_annotation_that_cannot_be_resolved_is_rejected_at_definition(self) -> None:
        class Local:
            pass

        with pytest.raises(TypeError, match=r"cannot resolve the field annotations of .*Hidden"):

            class Hidden(Batch):
                items: list[Local]

    def test_a_subclass_is_checked_too(self) -> None:
        with pytest.raises(TypeError, match=r"Extended\.total"):

            class Extended(TokenOutput):
                total: int = 0

    def test_a_subclass_adding_a_shared_field_restates_its_parents(self) -> None:
        class Extended(TokenOutput):
            shared_fields: ClassVar[tuple[str, ...]] = (*TokenOutput.shared_fields, "total")
            total: int = 0

        assert "total" not in Extended._item_fields
        assert Extended._item_fields == TokenOutput._item_fields


class TestPipelineBatchTypes:
    def test_the_four_pipeline_batch_types_are_found_in_the_vocabulary(self) -> None:
        assert {cls.__name__ for cls in PIPELINE} >= {
            "BatchTokenIDOutput",
            "BatchStrOutput",
            "BatchEmbeddingOutput",
            "BatchMultimodalOutput",
        }

    @each_batch_type
    def test_every_field_has_a_value_strategy(self, cls: type[Batch]) -> None:
        # Raises NotImplementedError naming the type of a field no strategy covers yet.
        for info in msgspec.structs.fields(cls):
            _values(info.type)

    @pytest.mark.parametrize("cls", PIPELINE, ids=lambda cls: cls.__name__)
    @PROPERTY
    @given(data=st.data())
    def test_grouping_by_origin_and_merging_back_round_trips_every_field(
        self, cls: type[Batch], data: st.DataObject
    ) -> None:
        # The detokenizer's split: one sub-batch per worker incarnation.
        batch = data.draw(batches(cls, min_size=1))
        pool = [messages.Origin(worker, incarnation) for worker in (0, 1) for incarnation in (1, 2)]
        size = batch.batch_size
        origins = data.draw(st.lists(st.sampled_from(pool), min_size=size, max_size=size))
        batch = msgspec.structs.replace(batch, origins=origins)
        groups = batch.group_by("origins")
        for origin, group in groups.items():
            assert set(_column(group, "origins")) == {origin}
        order = [i for key in groups for i, k in enumerate(origins) if k == key]
        merged = cls.merge(list(groups.values()))
        for name in (info.name for info in msgspec.structs.fields(cls)):
            column = _column(batch, name)
            if name in cls.shared_fields or column is None:
                assert _column(merged, name) == column
            else:
                assert _column(merged, name) == [column[i] for i in order]
        assert merged.select(_inverse(order)) == batch


class TestBatchSize:
    def test_is_the_common_length_of_the_lists(self) -> None:
        assert _token_output(5).batch_size == 5

    def test_ignores_per_item_fields_that_are_none(self) -> None:
        assert HotOutput(rids=["a", "b"], output_ids=[[], [1]], texts=None).batch_size == 2

    def test_is_zero_for_an_empty_batch(self) -> None:
        assert HotOutput(rids=[], output_ids=[]).batch_size == 0

    def test_is_zero_for_the_bare_base_class(self) -> None:
        assert Batch().batch_size == 0

    def test_a_length_mismatch_names_the_field_its_length_and_the_expected_one(self) -> None:
        batch = HotOutput(rids=["a", "b"], output_ids=[[1]])
        with pytest.raises(ProtocolError, match=r"HotOutput\.output_ids has 1 items, expected 2"):
            _ = batch.batch_size

    def test_an_empty_list_beside_a_full_one_is_a_mismatch(self) -> None:
        batch = HotOutput(rids=["a"], output_ids=[[1]], texts=[])
        with pytest.raises(ProtocolError, match=r"HotOutput\.texts has 0 items, expected 1"):
            _ = batch.batch_size


class TestSelect:
    @each_batch_type
    @PROPERTY
    @given(data=st.data())
    def test_selecting_every_index_in_order_gives_an_equal_batch(
        self, cls: type[Batch], data: st.DataObject
    ) -> None:
        batch = data.draw(batches(cls))
        assert batch.select(range(batch.batch_size)) == batch

    @each_batch_type
    @PROPERTY
    @given(data=st.data())
    def test_a_permutation_then_its_inverse_round_trips(
        self, cls: type[Batch], data: st.DataObject
    ) -> None:
        batch, order = data.draw(batches_with_permutation(cls))
        permuted = batch.select(order)
        assert type(permuted) is type(batch)
        for name in type(batch)._item_fields:
            column = _column(batch, name)
            expected = None if column is None else [column[i] for i in order]
            assert _column(permuted, name) == expected
        assert permuted.select(_inverse(order)) == batch

    @each_batch_type
    @PROPERTY
    @given(data=st.data())
    def test_shared_fields_are_copied_and_none_fields_stay_none(
        self, cls: type[Batch], data: st.DataObject
    ) -> None:
        batch = data.draw(batches(cls, min_size=1))
        indices = data.draw(st.lists(st.integers(0, batch.batch_size - 1), max_size=10))
        selected = batch.select(indices)
        assert selected.batch_size == len(indices)
        for name in type(batch).shared_fields:
            assert _column(selected, name) == _column(batch, name)
        for name in type(batch)._item_fields:
            assert (_column(selected, name) is None) == (_column(batch, name) is None)

    def test_repeated_indices_repeat_items(self) -> None:
        assert _token_output(3).select([2, 2, 0]).rids == ["r2", "r2", "r0"]

    def test_no_indices_gives_empty_lists_and_keeps_none(self) -> None:
        empty = _token_output(3).select([])
        assert empty.rids == []
        assert empty.output_logprobs is None
        assert empty.step == 7

    def test_the_result_holds_new_lists(self) -> None:
        batch = _token_output(3)
        selected = batch.select([0, 1, 2])
        assert selected.rids is not batch.rids

    @pytest.mark.parametrize("index", [3, 100, -1])
    def test_an_index_out_of_range_is_a_protocol_error(self, index: int) -> None:
        with pytest.raises(ProtocolError, match=rf"index {index} is out of range .* of 3 items"):
            _token_output(3).select([0, index])

    def test_any_index_into_an_empty_batch_is_out_of_range(self) -> None:
        with pytest.raises(ProtocolError, match=r"index 0 is out of range"):
            HotOutput(rids=[], output_ids=[]).select([0])

    def test_a_batch_with_mismatched_lengths_is_refused(self) -> None:
        batch = _token_output(3)
        batch.read_offsets = [0, 1]
        with pytest.raises(ProtocolError, match=r"TokenOutput\.read_offsets has 2 items"):
            batch.select([0])

    def test_an_untracked_class_stays_untracked(self) -> None:
        batch = HotOutput(rids=["a", "b"], output_ids=[[1], [2]])
        assert not gc.is_tracked(batch.select([1]))


class TestGroup:
    @each_batch_type
    @PROPERTY
    @given(data=st.data())
    def test_each_group_holds_exactly_the_items_with_its_key_in_order(
        self, cls: type[Batch], data: st.DataObject
    ) -> None:
        batch, keys = data.draw(batches_with_keys(cls))
        groups = batch.group(keys)
        assert list(groups) == list(dict.fromkeys(keys))
        for key, group in groups.items():
            assert type(group) is type(batch)
            mine = [i for i, k in enumerate(keys) if k == key]
            assert group.batch_size == len(mine)
            for name in type(batch)._item_fields:
                column = _column(batch, name)
                expected = None if column is None else [column[i] for i in mine]
                assert _column(group, name) == expected
            for name in type(batch).shared_fields:
                assert _column(group, name) == _column(batch, name)

    @each_batch_type
    @PROPERTY
    @given(data=st.data())
    def test_merging_the_groups_then_restoring_the_order_gives_the_original(
        self, cls: type[Batch], data: st.DataObject
    ) -> None:
        batch, keys = data.draw(batches_with_keys(cls, min_size=1))
        groups = batch.group(keys)
        order = [i for key in groups for i, k in enumerate(keys) if k == key]
        merged = type(batch).merge(list(groups.values()))
        assert merged == batch.select(order)
        assert merged.select(_inverse(order)) == batch

    @each_batch_type
    @PROPERTY
    @given(data=st.data())
    def test_merging_the_groups_of_contiguous_keys_gives_the_original(
        self, cls: type[Batch], data: st.DataObject
    ) -> None:
        batch, keys = data.draw(batches_with_keys(cls, min_size=1))
        runs = sorted(keys)
        assert type(batch).merge(list(batch.group(runs).values())) == batch

    def test_one_key_gives_one_equal_batch(self) -> None:
        batch = _token_output(4)
        assert batch.group(["w"] * 4) == {"w": batch}

    def test_an_empty_batch_gives_no_groups(self) -> None:
        assert HotOutput(rids=[], output_ids=[]).group([]) == {}

    def test_keys_of_the_wrong_length_are_a_protocol_error(self) -> None:
        with pytest.raises(ProtocolError, match=r"got 2 keys for a batch of 3 items"):
            _token_output(3).group(["a", "b"])

    def test_a_batch_with_mismatched_lengths_is_refused(self) -> None:
        batch = HotOutput(rids=["a", "b"], output_ids=[[1], [2]], texts=["x"])
        with pytest.raises(ProtocolError, match=r"HotOutput\.texts has 1 items, expected 2"):
            batch.group(["k", "k"])

    def test_group_by_a_field_uses_its_values_as_keys(self) -> None:
        batch = _token_output(5)
        assert batch.group_by("origins") == batch.group(batch.origins)
        assert list(batch.group_by("origins")) == [0, 1]

    def test_group_by_a_field_that_is_not_per_item_is_refused(self) -> None:
        with pytest.raises(ValueError, match=r"'step' is not a per-item field"):
            _token_output().group_by("step")

    def test_group_by_a_field_that_is_none_is_a_protocol_error(self) -> None:
        with pytest.raises(ProtocolError, match=r"'spec_verify_ct' is None"):
            _token_output().group_by("spec_verify_ct")


class TestMerge:
    def test_one_batch_merges_to_an_equal_one(self) -> None:
        batch = _token_output()
        assert TokenOutput.merge([batch]) == batch

    def test_lists_are_concatenated_in_the_order_given(self) -> None:
        first = HotOutput(rids=["a"], output_ids=[[1]], texts=["x"])
        second = HotOutput(rids=["b", "c"], output_ids=[[2], [3]], texts=["y", "z"])
        merged = HotOutput.merge([second, first])
        assert merged == HotOutput(
            rids=["b", "c", "a"], output_ids=[[2], [3], [1]], texts=["y", "z", "x"]
        )

    def test_a_field_none_in_some_batches_only_is_a_protocol_error(self) -> None:
        first = HotOutput(rids=["a"], output_ids=[[1]], texts=["x"])
        second = HotOutput(rids=["b"], output_ids=[[2]])
        with pytest.raises(ProtocolError, match=r"'texts' is None in batches \[1\]"):
            HotOutput.merge([first, second])

    def test_shared_fields_that_differ_are_a_protocol_error(self) -> None:
        first = _token_output()
        second = _token_output()
        second.step = 8
        with pytest.raises(ProtocolError, match=r"shared field 'step' is 8 in batch 1 but 7"):
            TokenOutput.merge([first, second])

    def test_a_part_with_mismatched_lengths_is_refused(self) -> None:
        broken = HotOutput(rids=["a", "b"], output_ids=[[1]])
        with pytest.raises(ProtocolError, match=r"output_ids has 1 items, expected 2"):
            HotOutput.merge([broken])

    def test_nothing_to_merge_is_a_value_error(self) -> None:
        with pytest.raises(ValueError, match=r"at least one batch"):
            HotOutput.merge([])

    def test_a_batch_of_another_type_is_a_type_error(self) -> None:
        with pytest.raises(TypeError, match=r"Batch\.merge got a HotOutput at position 0"):
            Batch.merge([HotOutput(rids=[], output_ids=[])])


class TestLengthMismatch:
    @each_batch_type
    @PROPERTY
    @given(data=st.data())
    def test_one_list_longer_or_shorter_than_the_others_is_refused_by_every_operation(
        self, cls: type[Batch], data: st.DataObject
    ) -> None:
        batch = data.draw(batches(cls))
        present = [name for name in cls._item_fields if _column(batch, name) is not None]
        assume(len(present) >= 2)
        name = data.draw(st.sampled_from(present))
        column = _column(batch, name)
        if column and data.draw(st.booleans()):
            wrong = column[:-1]
        else:
            info = next(info for info in msgspec.structs.fields(cls) if info.name == name)
            wrong = [*column, data.draw(_values(_item_type(info.type)[0]))]
        broken = msgspec.structs.replace(batch, **{name: wrong})
        size = batch.batch_size
        mismatch = rf"{cls.__qualname__}\.\w+ has \d+ items, expected \d+"
        with pytest.raises(ProtocolError, match=mismatch):
            _ = broken.batch_size
        with pytest.raises(ProtocolError, match=mismatch):
            broken.select(range(size))
        with pytest.raises(ProtocolError, match=mismatch):
            broken.group(["k"] * size)
        with pytest.raises(ProtocolError, match=mismatch):
            cls.merge([batch, broken])


class TestWire:
    @each_batch_type
    @PROPERTY
    @given(data=st.data())
    def test_a_group_survives_a_msgpack_round_trip(
        self, cls: type[Batch], data: st.DataObject
    ) -> None:
        batch, keys = data.draw(batches_with_keys(cls))
        for group in batch.group(keys).values():
            decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(group), type=type(batch))
            assert decoded == group

    @each_batch_type
    @PROPERTY
    @given(data=st.data())
    def test_a_selection_survives_a_msgpack_round_trip(
        self, cls: type[Batch], data: st.DataObject
    ) -> None:
        batch = data.draw(batches(cls, min_size=1))
        indices = data.draw(st.lists(st.integers(0, batch.batch_size - 1), max_size=10))
        selected = batch.select(indices)
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(selected), type=type(batch))
        assert decoded == selected


class TestSchemaEvolution:
    def test_a_field_added_by_a_subclass_is_split_with_no_other_edit(self) -> None:
        class TokenOutputV2(TokenOutput, array_like=True):
            prompt_tokens: list[int] | None = None

        batch = TokenOutputV2(
            rids=["a", "b", "c"],
            origins=[0, 1, 0],
            finished_reasons=[None, "stop", None],
            decode_ids=[[1], [2], [3]],
            read_offsets=[0, 0, 0],
            prompt_tokens=[10, 20, 30],
            step=3,
        )
        groups = batch.group_by("origins")
        assert groups[0].prompt_tokens == [10, 30]
        assert groups[1].prompt_tokens == [20]
        assert TokenOutputV2.merge([groups[0], groups[1]]).prompt_tokens == [10, 30, 20]
