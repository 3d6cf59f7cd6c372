"""The JSON-Schema keyword check does work linear in the schema, within a budget (issue #42.6)."""
from __future__ import annotations

import pytest

from radixlang.constrained import UnsupportedGrammar
from radixlang.constrained.schema_policy import WorkBudget, check_schema, one_of_is_disjoint, prepare_schema


def _tagged_one_of(num_branches: int, depth: int = 1) -> dict:
    """oneOf of objects told apart by a const tag, each branch holding the next level's oneOf."""
    node: dict | None = None
    for _ in range(depth):
        branches = []
        for i in range(num_branches):
            props: dict = {"kind": {"const": f"k{i}"}, "size": {"enum": [1, 2, 3]}}
            if node is not None:
                props["inner"] = node
            branches.append({"type": "object", "properties": props, "required": sorted(props)})
        node = {"oneOf": branches}
    return node  # type: ignore[return-value]


def _work(schema: dict, backend: str = "xgrammar") -> int:
    budget = WorkBudget(limit=10**9)
    check_schema(schema, backend, budget=budget)
    return budget.limit - budget.left


@pytest.mark.parametrize("backend", ["outlines", "xgrammar", "llguidance"])
def test_one_of_check_work_grows_linearly(backend):
    # a pairwise walk over the branches did ~n^2 / 2 tag comparisons: 20,000 branches took a minute
    small, large = _work(_tagged_one_of(500), backend), _work(_tagged_one_of(10_000), backend)
    assert large <= 21 * small
    assert large < 20 * 10_000
    nested = _work(_tagged_one_of(40, depth=3), backend)  # 40 * 40 * 40 branches at the bottom
    assert nested < 20 * (40 + 40**2 + 40**3)


def test_disjointness_is_unchanged_by_the_linear_check():
    ints, nums, strs = {"type": "integer"}, {"type": "number"}, {"type": "string"}
    assert one_of_is_disjoint([ints, strs, {"type": "null"}])
    assert not one_of_is_disjoint([ints, nums])  # 1 is both
    assert not one_of_is_disjoint([{"type": ["integer", "string"]}, strs])
    tagged = _tagged_one_of(3)["oneOf"]
    assert one_of_is_disjoint(tagged)
    clash = [*tagged, {**tagged[0], "properties": {**tagged[0]["properties"], "kind": {"enum": ["k9", "k2"]}}}]
    assert not one_of_is_disjoint(clash)
    assert not one_of_is_disjoint([{"type": "object", "properties": {}}, {"type": "object", "properties": {}}])


def test_a_schema_past_the_budget_is_refused_naming_the_field():
    schema = _tagged_one_of(10_000)
    with pytest.raises(UnsupportedGrammar, match="too large to check") as e:
        check_schema(schema, "llguidance", budget=WorkBudget(limit=50_000))
    assert e.value.param == "json_schema"
    with pytest.raises(UnsupportedGrammar) as e:  # in a structural tag the field is structural_tag
        check_schema(schema, "llguidance", param="structural_tag",
                     budget=WorkBudget(limit=50_000, param="structural_tag"))
    assert e.value.param == "structural_tag"
    prepare_schema(schema, "llguidance")  # the default budget takes it


def test_a_schema_nested_past_the_stack_is_refused_naming_the_field():
    schema: dict = {"type": "string"}
    for _ in range(5_000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(UnsupportedGrammar, match="nests too deeply") as e:
        prepare_schema(schema, "xgrammar")
    assert e.value.param == "json_schema"
