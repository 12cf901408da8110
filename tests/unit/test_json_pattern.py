"""A schema's `pattern` translated for xgrammar (`shared.engine.json_pattern`): what Python's
regex parser refuses is refused by name, as a request error, never raised as something else."""

import pytest

from shared.engine.constraint import schema_constraint
from shared.errors import InvalidRequestError


@pytest.mark.parametrize(
    "pattern",
    [
        "^x{99999999999999999999}$",  # past any count Python's parser holds (OverflowError)
        "^x{4294967295}$",  # its largest, MAXREPEAT, which it refuses too
        "^x{2,4294967296}$",
    ],
)
def test_a_repetition_past_any_count_is_refused_by_name(pattern):
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    with pytest.raises(InvalidRequestError, match="repetition") as info:
        schema_constraint(schema, "p")
    assert info.value.param == "p.properties.s.pattern"
