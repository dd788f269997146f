import enum
import math
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest

from keel.core.errors import UnhashableConfigError
from keel.core.hashing import canonical_json, content_hash


class Color(enum.Enum):
    RED = "red"


@dataclass(frozen=True)
class Inner:
    path: Path
    color: Color = Color.RED


@dataclass(frozen=True)
class Outer:
    lr: float
    inner: Inner
    tags: tuple[str, ...] = ()
    weights: dict[str, float] = field(default_factory=dict)


def test_canonical_json_is_sorted_compact_and_renders_special_types():
    value = Outer(
        lr=3e-4, inner=Inner(Path("/data/x")), tags=("b", "a"), weights={"z": 1, "a": 0.5}
    )
    assert canonical_json(value) == (
        '{"inner":{"color":"red","path":"/data/x"},"lr":0.0003,"tags":["b","a"],'
        '"weights":{"a":0.5,"z":1}}'
    )


def test_dict_order_does_not_change_the_hash():
    assert content_hash({"a": 1, "b": [1, 2]}) == content_hash({"b": [1, 2], "a": 1})


def test_integral_floats_hash_like_ints_and_negative_zero_like_zero():
    assert canonical_json({"x": 1.0, "y": -0.0}) == canonical_json({"x": 1, "y": 0})
    assert canonical_json(0.1 + 0.2) == "0.30000000000000004"  # exact, never rounded
    assert canonical_json(1e300) == "1e+300"


def test_non_finite_floats_have_one_spelling():
    assert canonical_json([math.nan, math.inf, -math.inf]) == '["NaN","Infinity","-Infinity"]'


def test_sets_are_sorted_and_paths_are_posix():
    assert canonical_json({3, 1, 2}) == "[1,2,3]"
    assert canonical_json(PurePosixPath("a/b")) == '"a/b"'


def test_different_values_give_different_hashes():
    assert content_hash(Outer(1e-3, Inner(Path("a")))) != content_hash(
        Outer(2e-3, Inner(Path("a")))
    )
    assert len(content_hash(None)) == 64


def test_lambda_is_rejected_with_its_location():
    with pytest.raises(UnhashableConfigError, match=r"config\.weights\.f: a lambda"):
        canonical_json(Outer(1.0, Inner(Path("a")), weights={"f": lambda x: x}))


def test_open_file_is_rejected(tmp_path):
    with (
        open(tmp_path / "f.txt", "w") as handle,
        pytest.raises(UnhashableConfigError, match="open file"),
    ):
        canonical_json({"log": handle})


def test_arbitrary_object_is_rejected():
    with pytest.raises(UnhashableConfigError, match="cannot be part of a config"):
        canonical_json([object()])


def test_non_string_dict_keys_are_rejected():
    with pytest.raises(UnhashableConfigError, match="dict key"):
        canonical_json({(1, 2): "x"})


def test_encode_hook_replaces_values_it_knows():
    class Token:
        pass

    text = canonical_json(
        {"t": Token()}, encode=lambda v: "TOKEN" if isinstance(v, Token) else _nh()
    )
    assert text == '{"t":"TOKEN"}'


def _nh():
    from keel.core.hashing import NOT_HANDLED

    return NOT_HANDLED


def test_fields_marked_out_of_identity_do_not_change_the_hash():
    @dataclass(frozen=True)
    class Job:
        size: int
        report_to: str = field(default="", metadata={"identity": False})

    assert content_hash(Job(3, "a")) == content_hash(Job(3, "b")) != content_hash(Job(4, "a"))
