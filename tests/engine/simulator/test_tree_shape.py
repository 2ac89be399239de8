"""TreeShape: structure helpers, constructors, validation, serialisation."""

from __future__ import annotations

import pytest

from engine.simulator.tree_shape import TreeShape


def test_kary_fills_breadth_first() -> None:
    shape = TreeShape.kary(2, 5)
    assert shape.parents == (-1, 0, 0, 1, 1, 2)
    assert shape.ranks == (0, 0, 1, 0, 1, 0)
    assert shape.widths_per_depth() == [2, 3]
    assert shape.budget == 5 and shape.max_depth == 2 and shape.max_children == 2


def test_nested_round_trip_and_canonical_form() -> None:
    nested = [[[[]], []], [[]], []]
    shape = TreeShape.from_nested(nested)
    assert shape.to_nested() == nested
    assert TreeShape.from_dict(shape.to_dict()) == shape
    assert TreeShape.kary(1, 3).canonical() == TreeShape.chain(3).canonical()


@pytest.mark.parametrize(
    ("parents", "ranks", "message"),
    [
        ((0, 0), (0, 0), r"parents\[0\] must be -1"),
        ((-1, 2, 0), (0, 0, 0), "must come before it"),
        ((-1, 0, 0), (0, 0, 0), r"children of node 0 have ranks \[0, 0\]"),
        ((-1, 0), (0, 1), r"must be 0\.\.0"),
    ],
)
def test_invalid_shapes(parents: tuple[int, ...], ranks: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TreeShape(parents, ranks)


def test_parse_and_pretty() -> None:
    assert TreeShape.parse("chain:3") == TreeShape.chain(3)
    assert TreeShape.parse("kary:2:4") == TreeShape.kary(2, 4)
    assert TreeShape.parse("none").budget == 0
    with pytest.raises(ValueError, match="expected 'none', 'chain:N' or 'kary:K:N'"):
        TreeShape.parse("star:3")
    assert TreeShape.kary(2, 3).pretty() == "root\n├─ r0\n│  └─ r0\n└─ r1"
