import pytest

from posttrain.algorithms.registry import Registry, UnknownNameError


def _one():
    return 1


def _two():
    return 2


def test_register_get_and_iterate_in_name_order():
    table = Registry("widget")
    table.register("zeta")(_one)
    table.add("alpha", _two)
    assert table.get("zeta") is _one and table.get("alpha") is _two
    assert list(table) == ["alpha", "zeta"]
    assert len(table) == 2 and "alpha" in table and "beta" not in table


def test_duplicate_name_is_rejected_and_first_registration_kept():
    table = Registry("widget")
    table.add("alpha", _one)
    with pytest.raises(ValueError, match=r"widget 'alpha' is already registered .*_one"):
        table.register("alpha")(_two)
    assert table.get("alpha") is _one


def test_unknown_name_suggests_the_nearest():
    table = Registry("preference loss")
    table.add("sigmoid", _one)
    table.add("hinge", _two)
    with pytest.raises(UnknownNameError, match=r"unknown preference loss 'sigmod'; did you mean 'sigmoid'\?"):
        table.get("sigmod")
    with pytest.raises(LookupError, match=r"valid names: hinge, sigmoid"):
        table.get("zzzzzz")


def test_empty_name_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        Registry("widget").add("", _one)
