"""Batches: messages whose per-item fields are index-aligned lists, split and merged generically.

A batch output of the engine carries one entry per request in each of its list fields
(``rids[i]``, ``output_ids[i]``, ``read_offsets[i]``, ...). Routing it to several consumers
means cutting every one of those lists the same way. `Batch` does that from the class's own
field list, so adding a field to a batch type needs no other edit anywhere.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable
from itertools import chain, compress
from operator import attrgetter, itemgetter
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    ClassVar,
    Self,
    TypeVar,
    Union,
    cast,
    get_args,
    get_origin,
)

import msgspec

from ._errors import ProtocolError
from ._message import Message, MessageMeta

if TYPE_CHECKING:
    from collections.abc import Sequence

_K = TypeVar("_K", bound=Hashable)

#: Reads every per-item field of a batch in one call (``operator.attrgetter`` when it can).
_Columns = Callable[[Any], tuple[Any, ...]]


# The helpers come before `Batch` because its metaclass runs them on `Batch` itself, while
# the module is still executing.
def _prepare(cls: type[Batch]) -> None:
    """Check ``cls``'s fields and cache its per-item field names and column reader.

    Raises:
        TypeError: A field name in ``shared_fields`` does not exist, a field's annotation
            cannot be resolved, or a per-item field is not annotated as a list.
    """
    shared = cls.shared_fields
    try:
        infos = msgspec.structs.fields(cls)
    except NameError as err:
        raise TypeError(
            f"cannot resolve the field annotations of {cls.__qualname__} ({err}); a Batch "
            "checks its fields when it is defined, so define the types it names first, at "
            "module level"
        ) from err
    known = {info.name for info in infos}
    unknown = [name for name in shared if name not in known]
    if unknown:
        raise TypeError(
            f"{cls.__qualname__}.shared_fields names {unknown}, which are not fields of "
            f"{cls.__qualname__} (its fields: {', '.join(sorted(known)) or 'none'})"
        )
    items: list[str] = []
    for info in infos:
        if info.name in shared:
            continue
        if not _is_list_type(info.type):
            raise TypeError(
                f"{cls.__qualname__}.{info.name} is annotated {info.type!r}, but a Batch "
                "field is per-item (an index-aligned list[X] or list[X] | None) unless it is "
                f"batch-wide: annotate it as a list, or add {info.name!r} to "
                f"{cls.__qualname__}.shared_fields"
            )
        items.append(info.name)
    cls.shared_fields = tuple(shared)
    cls._item_fields = tuple(items)
    cls._columns = _column_reader(cls._item_fields)


def _column_reader(names: tuple[str, ...]) -> _Columns:
    """Return a callable reading the named attributes as a tuple, in one C call when it can."""
    if len(names) >= 2:
        return attrgetter(*names)
    if names:
        # attrgetter of one name returns the bare value, not a 1-tuple.
        (name,) = names
        return lambda batch: (getattr(batch, name),)
    return lambda _batch: ()


def _is_list_type(annotation: Any) -> bool:
    """Whether ``annotation`` is ``list[X]`` or ``list[X] | None`` (``Annotated`` allowed)."""
    annotation = _strip_annotated(annotation)
    origin = get_origin(annotation)
    if annotation is list or origin is list:
        return True
    if origin is Union or origin is types.UnionType:
        args = [_strip_annotated(arg) for arg in get_args(annotation)]
        others = [arg for arg in args if arg is not type(None)]
        return len(others) == 1 and len(args) == 2 and _is_list_type(others[0])
    return False


def _strip_annotated(annotation: Any) -> Any:
    """Remove ``Annotated[...]`` wrappers (msgspec constraints), keeping the bare type."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


class _BatchMeta(MessageMeta):
    """Checks a `Batch` subclass once, when it is defined, and caches its field split.

    msgspec fills in ``__struct_fields__`` only after ``type.__new__`` has run
    ``__init_subclass__``, so the check lives here, in the metaclass ``__init__``, where the
    struct is complete.
    """

    def __init__(
        cls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], /, **kwargs: Any
    ) -> None:
        super().__init__(name, bases, namespace, **kwargs)
        _prepare(cast("type[Batch]", cls))


class Batch(Message, metaclass=_BatchMeta):
    """A message whose fields hold one entry per item, index-aligned.

    Every field of a subclass is *per-item*: annotated ``list[X]`` or ``list[X] | None``, with
    entry ``i`` of each list belonging to item ``i``. A field that holds one value for the whole
    batch is declared as such in `shared_fields`; nothing is guessed, and a class breaking
    these rules is rejected with `TypeError` when it is defined. A per-item field that is
    ``None`` means "not carried by this batch" and stays ``None`` through every operation.

    Splitting (`select`, `group`, `group_by`) and joining (`merge`) work from the class's field
    list, cached once per class, so a field added to a subclass is carried with no other edit.
    The results are shallow: they hold new lists of the same item objects, so treat batches
    as immutable values.

    Subclasses may set ``array_like=True`` or ``gc=False`` like any other message. A subclass
    that adds shared fields restates its parent's: ``(*Parent.shared_fields, "new")``.

    Attributes:
        shared_fields: Names of the fields that are batch-wide rather than per-item. They are
            copied as they are by `select` and `group`, and must be equal across the batches
            given to `merge`.

    Example:
        >>> class TokenOutput(Batch, array_like=True):
        ...     shared_fields: ClassVar[tuple[str, ...]] = ("step",)
        ...     rids: list[str]
        ...     output_ids: list[list[int]]
        ...     logprobs: list[float] | None = None
        ...     step: int = 0
        >>> out = TokenOutput(rids=["a", "b", "c"], output_ids=[[1], [2], [3]], step=7)
        >>> out.group(["w0", "w1", "w0"])["w0"]
        TokenOutput(rids=['a', 'c'], output_ids=[[1], [3]], logprobs=None, step=7)
    """

    shared_fields: ClassVar[tuple[str, ...]] = ()

    # Filled by `_prepare` for each class, so the hot path does no introspection.
    _item_fields: ClassVar[tuple[str, ...]] = ()
    _columns: ClassVar[_Columns]

    @property
    def batch_size(self) -> int:
        """The number of items: the common length of the per-item lists that are not ``None``.

        A batch whose per-item fields are all ``None`` (or that has none) has size 0.

        Raises:
            ProtocolError: Two per-item lists differ in length.
        """
        return self._present()[2]

    def select(self, indices: Sequence[int]) -> Self:
        """Return a batch of the same type holding the items at ``indices``, in that order.

        Per-item lists are cut to those indices (repeats allowed), ``None`` per-item fields stay
        ``None``, shared fields are copied as they are.

        Args:
            indices: Positions of the items to keep, each in ``range(self.batch_size)``.

        Returns:
            A new batch with ``len(indices)`` items.

        Raises:
            ProtocolError: The batch's per-item lists differ in length, or an index is out of
                range (negative indices are out of range too: they would silently pick from
                the end).
        """
        names, columns, size = self._present()
        if indices and (min(indices) < 0 or max(indices) >= size):
            bad = next(i for i in indices if not 0 <= i < size)
            raise ProtocolError(
                f"{type(self).__qualname__}.select: index {bad} is out of range for a batch "
                f"of {size} items (valid: 0..{size - 1})"
            )
        return self._take(names, columns, indices)

    def group(self, keys: Sequence[_K]) -> dict[_K, Self]:
        """Split the batch into one sub-batch per distinct key.

        Args:
            keys: One hashable key per item, index-aligned with the per-item fields (for
                instance each request's origin worker).

        Returns:
            A dict from each distinct key, in order of first appearance, to a batch of the same
            type holding the items with that key in their original relative order. Shared
            fields are copied into every sub-batch. An empty batch gives an empty dict.

        Raises:
            ProtocolError: The batch's per-item lists differ in length, or ``keys`` does not
                have one entry per item.
        """
        names, columns, size = self._present()
        if len(keys) != size:
            raise ProtocolError(
                f"{type(self).__qualname__}.group got {len(keys)} keys for a batch of {size} "
                "items: pass exactly one key per item"
            )
        buckets: dict[_K, list[int]] = {}
        for index, key in enumerate(keys):
            bucket = buckets.get(key)
            if bucket is None:
                buckets[key] = [index]
            else:
                bucket.append(index)
        # Build every sub-batch with C-level calls only. A bucket's indices increase, so first
        # and last tell whether it is one run: a run is cut by slicing each list. Otherwise
        # the batch is transposed once into rows, and each group's rows back into lists,
        # which costs fewer calls than picking each list's items apart.
        rows: list[tuple[Any, ...]] | None = None
        groups: dict[_K, Self] = {}
        for key, indices in buckets.items():
            first = indices[0]
            if indices[-1] - first + 1 == len(indices):
                cut = map(itemgetter(slice(first, first + len(indices))), columns)
            else:
                if rows is None:
                    rows = list(zip(*columns, strict=True))
                # Not a run, so at least two indices: the itemgetter returns a tuple of rows.
                cut = map(list, zip(*itemgetter(*indices)(rows), strict=True))
            groups[key] = msgspec.structs.replace(self, **dict(zip(names, cut, strict=True)))
        return groups

    def group_by(self, field: str) -> dict[Any, Self]:
        """Split the batch by the values of one of its own per-item fields.

        ``batch.group_by("origins")`` is ``batch.group(batch.origins)``.

        Args:
            field: Name of a per-item field whose entries are hashable.

        Returns:
            As `group`.

        Raises:
            ValueError: ``field`` is not a per-item field of this class.
            ProtocolError: The field is ``None`` in this batch, or lengths differ (as `group`).
        """
        cls = type(self)
        if field not in cls._item_fields:
            raise ValueError(
                f"{cls.__qualname__}.group_by: {field!r} is not a per-item field; "
                f"choose one of {', '.join(cls._item_fields) or '(none)'}"
            )
        keys = getattr(self, field)
        if keys is None:
            raise ProtocolError(
                f"{cls.__qualname__}.group_by: field {field!r} is None in this batch, "
                "so it cannot supply the keys"
            )
        return self.group(keys)

    @classmethod
    def merge(cls, batches: Sequence[Self]) -> Self:
        """Concatenate batches of this type, item lists end to end, in the order given.

        ``cls.merge(list(batch.group(keys).values()))`` holds the same items as ``batch``,
        reordered by key; when the keys come in contiguous runs it equals ``batch``.

        Args:
            batches: At least one batch, each exactly of type ``cls``.

        Returns:
            A new batch whose per-item lists are the concatenations, and whose shared fields
            are those of the first batch. A per-item field stays ``None`` only if it is
            ``None`` in every batch.

        Raises:
            ValueError: ``batches`` is empty.
            TypeError: A batch is not exactly of type ``cls``.
            ProtocolError: A batch's lists differ in length, a per-item field is ``None`` in
                some batches but not others, or a shared field differs between batches.
        """
        if not batches:
            raise ValueError(f"{cls.__qualname__}.merge needs at least one batch, got none")
        first = batches[0]
        for position, batch in enumerate(batches):
            if type(batch) is not cls:
                raise TypeError(
                    f"{cls.__qualname__}.merge got a {type(batch).__qualname__} at position "
                    f"{position}: merge batches of one type, with that type's merge"
                )
            batch._present()  # validates each part's lengths
            for name in cls.shared_fields:
                if getattr(batch, name) != getattr(first, name):
                    raise ProtocolError(
                        f"{cls.__qualname__}.merge: shared field {name!r} is "
                        f"{getattr(batch, name)!r} in batch {position} but "
                        f"{getattr(first, name)!r} in batch 0; only batches that agree on "
                        "shared fields can be merged"
                    )
        merged: dict[str, list[Any]] = {}
        for name in cls._item_fields:
            parts = [getattr(batch, name) for batch in batches]
            missing = [position for position, part in enumerate(parts) if part is None]
            if len(missing) == len(parts):
                continue  # None everywhere: the copy of the first batch keeps it None
            if missing:
                raise ProtocolError(
                    f"{cls.__qualname__}.merge: per-item field {name!r} is None in batches "
                    f"{missing} but present in others; a field must be carried by all the "
                    "merged batches or by none"
                )
            merged[name] = list(chain.from_iterable(parts))
        return msgspec.structs.replace(first, **merged)

    def _present(self) -> tuple[tuple[str, ...], tuple[list[Any], ...], int]:
        """Return the names and lists of the per-item fields that are not None, and the size.

        Raises:
            ProtocolError: Two of the lists differ in length.
        """
        cls = type(self)
        names = cls._item_fields
        columns = cls._columns(self)
        # Everything below runs in C (filter, compress, map) in the common cases: that is
        # most of the cost of a split, which runs once per engine step.
        present = tuple(filter(None, columns))
        if len(present) != len(columns):
            if len(present) + columns.count(None) == len(columns):
                # Only None fields were dropped: the selector truth values match the filter.
                names = tuple(compress(names, columns))
                columns = present
            else:
                # Some lists are empty: an empty batch, or a length mismatch named below.
                names = tuple(
                    name for name, column in zip(names, columns, strict=True) if column is not None
                )
                columns = tuple(column for column in columns if column is not None)
        if not columns:
            return names, columns, 0
        size = len(columns[0])
        if len(set(map(len, columns))) != 1:
            # Slow path, only to name the culprit.
            for name, column in zip(names, columns, strict=True):
                if len(column) != size:
                    raise ProtocolError(
                        f"{cls.__qualname__}.{name} has {len(column)} items, expected {size} "
                        f"(the length of {cls.__qualname__}.{names[0]}): every per-item "
                        "field of a batch holds exactly one entry per item"
                    )
        return names, columns, size

    def _take(
        self, names: tuple[str, ...], columns: tuple[list[Any], ...], indices: Sequence[int]
    ) -> Self:
        """Build the batch of the items at ``indices`` (checked, not negative) in one call."""
        # Each branch cuts all lists in C (map over an itemgetter), one new list per field.
        if len(indices) <= 1:
            # An itemgetter of one index returns the bare item, so slice instead.
            start = indices[0] if indices else 0
            cut = map(itemgetter(slice(start, start + len(indices))), columns)
        else:
            cut = map(list, map(itemgetter(*indices), columns))
        return msgspec.structs.replace(self, **dict(zip(names, cut, strict=True)))
