"""The API's structured-output fields: each spelling mapped to its engine constraint, and every
bad value answered with a 400 naming the field before any work."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from services.gateway.openai_protocol import ApiError, parse_chat_request, parse_completion_request
from shared.engine.constraint import MAX_SPEC_CHARS, Constraint, to_grammar
from shared.wire import SamplingSpec, decode, encode
from shared.wire_convert import sampling_params, sampling_spec

MODEL = "smollm2"
MAX_LEN = 2048
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def constraint(**fields) -> Constraint | None:
    request = parse_chat_request({**CHAT, **fields}, MODEL, MAX_LEN)
    return request.sampling_params(10, MAX_LEN).constraint


def refused(param: str, match: str, **fields) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat_request({**CHAT, **fields}, MODEL, MAX_LEN)
    assert info.value.status == 400
    assert info.value.param == param, info.value.message
    assert match in info.value.message


def test_each_spelling_maps_to_its_constraint():
    json_schema = {"name": "a", "schema": SCHEMA, "strict": True}
    assert constraint(response_format={"type": "text"}) is None
    assert constraint(response_format={"type": "json_object"}) == Constraint("json_object")
    assert constraint(response_format={"type": "json_schema", "json_schema": json_schema}) == (
        Constraint("json_schema", json.dumps(SCHEMA))
    )
    assert constraint(structured_outputs={"json": SCHEMA}).kind == "json_schema"
    assert constraint(structured_outputs={"json": json.dumps(SCHEMA)}).kind == "json_schema"
    assert constraint(structured_outputs={"regex": "[a-z]+"}) == Constraint("regex", "[a-z]+")
    assert constraint(structured_outputs={"choice": ["x", "y"]}).spec == '["x", "y"]'
    grammar = 'root ::= "a" | "b"'
    assert constraint(structured_outputs={"grammar": grammar}) == Constraint("grammar", grammar)
    assert constraint(structured_outputs={"json_object": True}).kind == "json_object"
    completion = parse_completion_request(
        {"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "a+"}}, MODEL, MAX_LEN
    )
    assert completion.sampling_params(1, MAX_LEN).constraint == Constraint("regex", "a+")


@pytest.mark.parametrize(
    ("fields", "param", "match"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type", "must be one of"),
        # Unhashable: a TypeError, answered with a 500.
        ({"response_format": {"type": ["json_object"]}}, "response_format.type", "must be one of"),
        ({"response_format": {"type": {}}}, "response_format.type", "must be one of"),
        (
            {"structured_outputs": {"json": {**SCHEMA, "required": [["a"]]}}},
            "structured_outputs.json.required",
            "list of property names",
        ),
        ({"response_format": "json"}, "response_format", "must be an object"),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "`name` and `schema`",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
            "required",
        ),
        # OpenAI's rule for the name, as for a tool's (these passed)
        *(
            (
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": name, "schema": SCHEMA},
                    }
                },
                "response_format.json_schema.name",
                "1 to 64 letters, digits, _ or -",
            )  # fmt: skip
            for name in ("a b/c!", "n" * 65, "")
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}},
                }
            },
            "response_format.json_schema.schema",
            "keyword `not` cannot be enforced",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
            "response_format.json_schema.schema",
            "must be an object",
        ),
        (
            {"response_format": {"type": "json_object", "schema": {}}},
            "response_format.schema",
            "unknown field",
        ),
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex", "invalid regex"),
        ({"structured_outputs": {"grammar": "x ::="}}, "structured_outputs.grammar", "invalid"),
        ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs.json", "invalid"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs.json", "not valid JSON"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "1 to 256"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "non-empty string"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "unknown"),
        ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object", "true"),
        (
            {"structured_outputs": {"regex": "a" * (MAX_SPEC_CHARS + 1)}},
            "structured_outputs.regex",
            "at most",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "not both",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields, param, match):
    refused(param, match, **fields)


def test_a_null_schema_is_not_given():
    """JSON null is "not given" (as OpenAI's SDK sends an unset optional field): a
    `json_schema` with `"schema": null` asks for any JSON object, as one without it; it was a
    400 ("a JSON schema must be an object")."""
    spec = {"name": "a", "schema": None, "strict": None, "description": None}
    assert constraint(response_format={"type": "json_schema", "json_schema": spec}).kind == (
        "json_object"
    )


def test_a_json_schema_description_must_be_a_string():
    spec = {"name": "a", "schema": SCHEMA, "description": 5}
    refused("response_format.json_schema.description", "string",
            response_format={"type": "json_schema", "json_schema": spec})  # fmt: skip


def test_the_constraint_round_trips_over_the_wire():
    params = parse_chat_request(
        {**CHAT, "structured_outputs": {"json": SCHEMA}}, MODEL, MAX_LEN
    ).sampling_params(10, MAX_LEN)
    spec = sampling_spec(params)
    assert spec.constraint.kind == "json_schema"
    assert sampling_params(spec) == params
    assert sampling_params(SamplingSpec()).constraint is None


def test_the_wire_refuses_a_bad_constraint():
    from shared import wire

    message = wire.Cancel(request_id="r", reason="x")
    assert decode(encode(message)) == message
    with pytest.raises(wire.WireError, match="constraint"):
        wire.decode(_submit_with_constraint({"kind": "yaml", "spec": ""}))
    with pytest.raises(wire.WireError, match="constraint"):
        wire.decode(_submit_with_constraint({"kind": "regex", "spec": "a" * (64 << 10 + 1)}))


def _submit_with_constraint(constraint: dict) -> list[bytes]:
    import msgpack

    from shared import wire

    submit = wire.Submit(
        request_id="r",
        prompt_token_ids=[1],
        sampling=SamplingSpec(),
        tenant="t",
        priority=0,
        gateway_peer_id="g",
        arrival_time=0.0,
    )
    frames = wire.encode(submit)
    header = msgpack.unpackb(bytes(frames[1]))
    header["sampling"]["constraint"] = constraint
    return [frames[0], msgpack.packb(header)]


@pytest.fixture
def grammar_parses(monkeypatch) -> list[Constraint]:
    """The constraints the gateway hands the grammar engine to parse, from an empty cache."""
    from services.gateway import structured_outputs

    calls: list[Constraint] = []

    def counted(constraint):
        calls.append(constraint)
        return to_grammar(constraint)

    monkeypatch.setattr(structured_outputs, "to_grammar", counted)
    structured_outputs.check_parses.cache_clear()
    return calls


def test_a_constraint_is_parsed_by_the_grammar_engine_once(grammar_parses):
    """Each prompt of a completions batch (and each turn of an agent, which sends its schema
    again) parsed the same schema with xgrammar on the gateway's event loop: 64 prompts under a
    schema of four long patterns blocked every other request for 20 s."""
    schema = {**SCHEMA, "properties": {"a": {"type": "string", "pattern": "^[a-z]{1,9}$"}}}
    fields = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }
    body = {"model": MODEL, "max_tokens": 5, **fields}
    for prompt in ("one", "two", "three"):
        parse_completion_request({**body, "prompt": prompt}, MODEL, MAX_LEN)
    assert len(grammar_parses) == 1
    for _ in range(2):  # a refusal is not remembered: each request gets its own, naming its field
        refused(
            "structured_outputs.grammar", "invalid grammar", structured_outputs={"grammar": "x"}
        )
    assert len(grammar_parses) == 3


def test_a_forced_tool_calls_schema_is_parsed_once(grammar_parses):
    """An agent forcing a call every turn sends the same tools: the call schema was parsed with
    xgrammar on the event loop each time, past the cache the response formats used."""
    tool = {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for turn in ("Paris?", "Rome?", "Oslo?"):
        body = {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": turn}],
            "tools": [tool],
            "tool_choice": "required",
        }
        parse_chat_request(body, MODEL, MAX_LEN)
    assert len(grammar_parses) == 2  # the tool's parameters (a 400 names them), and the call


# Grammars that parse but whose rules cannot all end: xgrammar accepted them and the request
# failed at generation (a 500, "the output constraint allows no next token") or, where the
# matcher let the model into a rule without an end, ran to max_tokens. (rule named, grammar)
NEVER_ENDING = [
    ("root", 'root ::= "a" root'),  # only refers to itself
    ("root", "root ::= a\na ::= b\nb ::= a"),  # rules leading only to one another
    ("x", 'root ::= x\nx ::= x "b"'),  # left recursion without a base case
    ("x", 'root ::= "a" x\nx ::= x "b"'),  # "a", then nothing can follow
    ("x", 'root ::= "a" x\nx ::= "b" x'),  # "a", then "b" forever
    ("b", 'root ::= a\na ::= "a" a | "b" b\nb ::= "b" b'),  # no alternative ends
    # The root can end, but the model could walk into a rule that cannot: after "a" the
    # matcher allowed "b", and then only "b" again, to max_tokens.
    ("x", 'root ::= "a" | "a" x\nx ::= "b" x'),
    ("x", 'root ::= "a" x?\nx ::= "b" x'),
    ("x", 'root ::= "a" x*\nx ::= "b" x'),
    ("x", 'root ::= ("c" x)+ | "d"\nx ::= "b" x'),
    ("x", 'root ::= "a" x{1,3}\nx ::= "b" x'),
    ("x", 'root ::= "a" x{0,3}\nx ::= "b" x'),
    ("x", 'root ::= TagDispatch(("<a>", x))\nx ::= "b" x'),
    ("x", 'root ::= TokenTagDispatch((5, x))\nx ::= "b" x'),  # (after its token, the rule)
    # A character class that matches no character: nothing can follow "a".
    ("root", 'root ::= "a" [^\\0-\\U0010ffff]'),
    ("x", 'root ::= "a" | "b" x\nx ::= [^\\0-\\x7f\\x80-\\U0010ffff] "c"'),
]


@pytest.mark.parametrize(("rule", "grammar"), NEVER_ENDING)
def test_a_grammar_whose_rules_cannot_end_is_refused_naming_the_rule(rule, grammar):
    with pytest.raises(ApiError) as info:
        parse_chat_request({**CHAT, "structured_outputs": {"grammar": grammar}}, MODEL, MAX_LEN)
    assert info.value.status == 400
    assert info.value.param == "structured_outputs.grammar", info.value.message
    assert f"`{rule}`" in info.value.message and "never end" in info.value.message


def _printed_schema_grammar(schema: dict) -> str:
    from shared.engine.constraint import schema_constraint

    return str(to_grammar(schema_constraint(schema, "s")))


TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["name", "children"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
CAN_END = [
    'root ::= "a" | "b"',
    'root ::= ""',
    'root ::= "x" | "a" root',  # recursion with a base case
    'root ::= x\nx ::= "b" | x "b"',  # left recursion with one
    'root ::= a\na ::= "(" b ")" | "x"\nb ::= a | a "," b',  # mutual recursion with one
    'root ::= "(" num " + " num ")"\nnum ::= [1-9] [0-9]?',
    'root ::= ("a" | "b")* "c"?',
    'root ::= [a-z]+ [^0-9]{2,5} "q"{3} [\\x00-\\x1f\\\\\\]\\-]*',
    'root ::= "a" x*\nx ::= "b" | "c" x',
    'root ::= "a" (x | "d")+\nx ::= "b" x?',
    'root ::= "a" x{2,}\nx ::= "b"',
    "root ::= x{0,0}\nx ::= x",  # never entered
    'root ::= "a"\nunused ::= unused',  # never reached
    'root ::= "a" x\nx ::= "b" (= "c")',  # a lookahead is no part of the text
    'root ::= TagDispatch(("<a>", x), ("<b>", y))\nx ::= "q"\ny ::= "z" y | ""',
    'root ::= Regex("[a-z]+") Token(1, 2)',
    'root ::= "a" [^\\0-\\U0010ffff]* [^\\0-\\U0010fffe]',  # none of none; the last one
    'root ::= "\\"" ([^"\\\\] | "\\\\" ["\\\\nt])* "\\""',  # a string with escapes
    # Grammars the engine writes, read back: every construct its printed form has.
    _printed_schema_grammar(TREE),
    _printed_schema_grammar({"type": "object"}),
    _printed_schema_grammar(
        {
            "type": "object",
            "properties": {
                "s": {"type": "string", "pattern": "^[a-z]{2,4}$"},
                "n": {"type": "integer", "minimum": -3, "maximum": 90},
                "e": {"enum": ["a", 1, None]},
                "l": {"type": "array", "items": {"type": "number"}, "minItems": 1},
                "u": {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 3}]},
            },
        }
    ),
]


@pytest.mark.parametrize("grammar", CAN_END)
def test_a_grammar_whose_rules_can_all_end_passes(grammar):
    assert constraint(structured_outputs={"grammar": grammar}) == Constraint("grammar", grammar)


def test_the_builtin_json_grammar_passes():
    import xgrammar as xgr

    grammar = str(xgr.Grammar.builtin_json_grammar())
    assert constraint(structured_outputs={"grammar": grammar}).spec == grammar


def _node(child: dict, required: bool) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 5}, "child": child},
        "required": ["name", "child"] if required else ["name"],
    }


# Schemas whose `$ref`s lead back through required properties or items only: no finite value
# meets them, and the model wrote `{"child": {"child": ...` to max_tokens ("length", no JSON).
ENDLESS_SCHEMAS = [
    _node({"$ref": "#"}, required=True),
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {
        "$defs": {"a": _node({"$ref": "#/$defs/b"}, True), "b": _node({"$ref": "#/$defs/a"}, True)},
        "$ref": "#/$defs/a",
    },  # fmt: skip
    # A value can end, but a part the model may enter cannot.
    {
        "$defs": {"loop": _node({"$ref": "#/$defs/loop"}, True)},
        **_node({"$ref": "#/$defs/loop"}, required=False),
    },  # fmt: skip
    {
        "anyOf": [{"type": "null"}, {"$ref": "#/$defs/x"}],
        "$defs": {"x": _node({"$ref": "#/$defs/x"}, True)},
    },
]


@pytest.mark.parametrize("schema", ENDLESS_SCHEMAS)
def test_a_schema_with_no_finite_value_is_refused(schema):
    for fields, param in (
        ({"structured_outputs": {"json": schema}}, "structured_outputs.json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": schema},
                }
            },
            "response_format.json_schema.schema",
        ),
    ):
        refused(param, "never end", **fields)


FINITE_SCHEMAS = [
    _node({"$ref": "#"}, required=False),  # a tree: the child may be left out
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
    {"anyOf": [{"type": "null"}, _node({"$ref": "#"}, True)]},  # null ends it
    {
        "$defs": {
            "t": {
                "anyOf": [
                    {"type": "integer"},
                    {"type": "array", "items": {"$ref": "#/$defs/t"}, "minItems": 1},
                ]
            }
        },
        "$ref": "#/$defs/t",
    },  # fmt: skip
    TREE,
]


@pytest.mark.parametrize("schema", FINITE_SCHEMAS)
def test_a_recursive_schema_with_a_base_case_passes(schema):
    assert constraint(structured_outputs={"json": schema}).kind == "json_schema"


@pytest.mark.parametrize("regex", [r"[^\s\S]", r"a[^\d\D]", r"a([^\s\S]|[^\d\D])+"])
def test_a_regex_that_no_text_can_match_is_refused(regex):
    """A character class that matches no character: the request failed at generation where
    nothing could follow ("the output constraint allows no next token", a 500)."""
    refused("structured_outputs.regex", "matches no character", structured_outputs={"regex": regex})


@pytest.mark.parametrize("regex", [r"a|[^\s\S]", r"(a|[^\s\S]b)c", r"a[^\s\S]*", r"[^\x00-\uffff]"])
def test_a_regex_whose_empty_classes_are_never_needed_passes(regex):
    assert constraint(structured_outputs={"regex": regex}) == Constraint("regex", regex)


def test_a_forced_tools_endless_parameters_are_refused_naming_them():
    """A forced call is held to its tool's parameters: an object that must contain itself was
    `{"child": {"child": ...` to max_tokens, a call that never parsed."""
    parameters = _node({"$ref": "#"}, required=True)
    tool = {"type": "function", "function": {"name": "walk", "parameters": parameters}}
    refused("tools[0].function.parameters", "never end", tools=[tool], tool_choice="required")


@pytest.fixture(scope="module")
def generator():
    """The gateway's request preparation on the real model's tokenizer (49,152 tokens)."""
    from transformers import AutoTokenizer

    from services.gateway.cluster import ClusterView
    from services.gateway.generation import Generator
    from shared.engine.model_files import resolve_model_dir
    from shared.lifecycle import GatewayEvents
    from shared.logs import get_logger

    directory, _ = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    no_status = SimpleNamespace(view=ClusterView())  # (prepare reads the largest decode pool)
    return Generator(no_status, tokenizer, MODEL, MAX_LEN, GatewayEvents(get_logger()))


@pytest.mark.parametrize(
    "grammar",
    [
        "root ::= Token(49152)",
        'root ::= "a" Token(5, 999999)',
        "root ::= ExcludeToken(1, 2, 60000)",
        'root ::= TokenTagDispatch((5, a), (70000, a))\na ::= "x"',
        'root ::= TokenTagDispatch((5, a), excludes=(6, 1000000))\na ::= "x"',
    ],
)
def test_a_grammars_token_past_the_vocabulary_is_refused(generator, grammar):
    """The worker's compile failed ("Token id ... out of the vocabulary range"): the request
    ended as a failed generation, where the grammar is the client's error."""
    body = {**CHAT, "max_tokens": 5, "structured_outputs": {"grammar": grammar}}
    request = parse_chat_request(body, MODEL, MAX_LEN)
    with pytest.raises(ApiError) as info:
        generator.prepare(request, "chatcmpl")
    assert info.value.status == 400
    assert info.value.param == "structured_outputs.grammar"
    assert "[0, 49152)" in info.value.message


def test_a_grammars_tokens_in_the_vocabulary_pass(generator):
    grammar = 'root ::= Token(0, 49151) ExcludeToken(2) TokenTagDispatch((5, a))\na ::= "x"'
    body = {**CHAT, "max_tokens": 5, "structured_outputs": {"grammar": grammar}}
    generation = generator.prepare(parse_chat_request(body, MODEL, MAX_LEN), "chatcmpl")
    assert generation.params.constraint == Constraint("grammar", grammar)
