"""The grammar module on the real tokenizer (no model): constraints checked, compiled once and
cached within a byte bound, matchers rebuilt by replay, batch masks applied in place."""

import json
import re
import time
from concurrent.futures import Future

import pytest
import torch

from shared import wire, wire_convert
from shared.engine.constraint import (
    MAX_SPEC_CHARS,
    Constraint,
    answer_or_calls,
    choice_constraint,
    schema_constraint,
    to_grammar,
)
from shared.engine.grammar import (
    GrammarCache,
    GrammarError,
    GrammarState,
    MaskBuffer,
    wait_compiled,
)
from shared.engine.model_files import resolve_model_dir
from shared.engine.sampling import Sampler, SamplingRow
from shared.engine.sampling_params import SamplingParams
from shared.errors import InvalidRequestError

VOCAB = 49152
EOS = 2
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def accepts(constraint: Constraint, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(to_grammar(constraint), text)


@pytest.mark.parametrize(
    ("schema", "where", "message"),
    [
        ({"type": "object", "properties": {"a": {}}, "anyOf": [{"type": "object"}]},
         "p", "`anyOf` beside `type`"),
        ({"type": "string", "pattern": "^[A-Z]+$", "maxLength": 3}, "p", "`pattern` beside"),
        ({"$ref": "#/$defs/S", "maxLength": 2, "$defs": {"S": {"type": "string"}}},
         "p", "`$ref` beside `maxLength`"),
        ({"const": "a", "minLength": 2}, "p", "`const` beside `minLength`"),
        ({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["nmae"]},
         "p.required", "'nmae'"),
        ({"type": "object", "properties": {"o": {"enum": ["a"], "maxLength": 0}}},
         "p.properties.o", "`enum` beside `maxLength`"),
    ],
)  # fmt: skip
def test_keywords_enforced_alone_but_not_together_are_refused(schema, where, message):
    """xgrammar takes the first of `$ref`, `const`, `enum`, `anyOf` and ignores the rest beside
    it, and a pattern's string ignores its length bounds: each was accepted, and output broke the
    schema it was said to meet."""
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        schema_constraint(schema, "p")
    assert info.value.param == where


def test_the_common_combinations_stay_allowed():
    for schema in (
        {"type": "string", "enum": ["a", "b"], "description": "a choice"},
        {"type": "string", "const": "x"},
        {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Opt"},
        {"$ref": "#/$defs/S", "description": "d", "$defs": {"S": {"type": "string"}}},
        {
            "type": "object",
            "properties": {"a": {}},
            "required": ["a"],
            "additionalProperties": True,
        },
        {"type": ["string", "null"], "pattern": "^[a-z]+$"},
        {"items": {"type": "integer"}, "minItems": 1},  # xgrammar takes the array from `items`
    ):
        to_grammar(schema_constraint(schema, "p"))


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "string", "enum": [1, 2]}, "p.enum[0]"),  # compiled to `"1" | "2"`
        ({"type": "string", "enum": ["a", 2]}, "p.enum[1]"),
        ({"type": "integer", "const": "a"}, "p.const"),  # compiled to the string "a"
        ({"type": "integer", "enum": [1.5]}, "p.enum[0]"),
        ({"type": "integer", "const": True}, "p.const"),  # a boolean is no number
        ({"type": "number", "enum": [False]}, "p.enum[0]"),
        ({"type": "boolean", "const": 0}, "p.const"),
        ({"type": "null", "enum": ["null"]}, "p.enum[0]"),
        ({"type": "object", "const": [1]}, "p.const"),
        ({"type": "array", "enum": [{"a": 1}]}, "p.enum[0]"),
        ({"type": ["string", "null"], "enum": ["a", None, 3]}, "p.enum[2]"),
        ({"type": "object", "properties": {"n": {"type": "integer", "enum": ["1"]}}},
         "p.properties.n.enum[0]"),
    ],
)  # fmt: skip
def test_an_enum_or_const_value_its_type_does_not_allow_is_refused(schema, where):
    """xgrammar writes an `enum`'s or `const`'s values and ignores the `type` beside them: the
    output was a value of another type, and the response said it met the schema."""
    with pytest.raises(InvalidRequestError, match="does not allow") as info:
        schema_constraint(schema, "p")
    assert info.value.param == where


def test_an_enum_or_const_of_its_types_values_stays_allowed():
    for schema in (
        {"type": "integer", "enum": [1, 2.0, -3]},  # 2.0 is an integer in JSON Schema
        {"type": "number", "enum": [1, 2.5]},  # a number may be an integer
        {"type": ["string", "null"], "enum": ["a", None]},
        {"type": "boolean", "const": False},
        {"type": "object", "const": {"a": [1]}},
        {"type": "array", "enum": [[1], []]},
        {"type": "null", "const": None},
        {"enum": [1, "a", None]},  # no type: any value
    ):
        to_grammar(schema_constraint(schema, "p"))


def test_an_enum_or_const_beside_an_unknown_type_is_refused():
    with pytest.raises(InvalidRequestError, match="must be") as info:
        schema_constraint({"type": "text", "enum": ["a"]}, "p")
    assert info.value.param == "p.type"


@pytest.mark.parametrize(
    ("schema", "where", "message"),
    [
        ({"type": "object", "properties": {"n": {"minimum": 0, "maximum": 10}}},
         "p.properties.n", "`minimum` without a `type`"),
        ({"pattern": "^[a-z]+$"}, "p", "`pattern` without a `type`"),
        ({"maxLength": 2}, "p", "`maxLength` without a `type`"),
        ({"minItems": 2}, "p", "`minItems` without a `type`"),
        ({"anyOf": [{"type": "string"}, {"exclusiveMaximum": 2}]}, "p.anyOf[1]", "without a"),
        ({"type": []}, "p.type", "at least one type"),
        ({"$ref": "http://example.com/s.json"}, "p.$ref", "cannot be resolved"),
        ({"type": "object", "additionalProperties": True, "required": ["id"]},
         "p.required", "'id'"),
        ({"type": "object", "additionalProperties": {"type": "string"}, "required": ["id"]},
         "p.required", "'id'"),
        ({"type": "object", "properties": {"a": {}}, "required": [["a"]]},
         "p.required", "list of property names"),  # unhashable: was a TypeError
    ],
)  # fmt: skip
def test_what_xgrammar_would_read_as_any_value_is_refused(schema, where, message):
    """Each was accepted and then not enforced: a value keyword beside no `type` (xgrammar then
    allows any value), no type at all, a reference outside the schema, and a required name
    `properties` does not list (dropped when other properties are allowed)."""
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        schema_constraint(schema, "p")
    assert info.value.param == where


@pytest.mark.parametrize(
    ("schema", "where", "message"),
    [
        ({"anyOf": []}, "p.anyOf", "at least one schema"),  # allowed nothing: a 500 mid-decode
        ({"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]},
         "p.properties.a.anyOf", "at least one schema"),
        ({"type": "string", "maxLength": -1}, "p.maxLength", "non-negative integer"),  # any length
        ({"type": "string", "minLength": -1}, "p.minLength", "non-negative integer"),
        ({"type": "array", "items": {}, "minItems": -2}, "p.minItems", "non-negative integer"),
        ({"type": "array", "items": {}, "maxItems": 1.5}, "p.maxItems", "non-negative integer"),
        ({"type": "string", "maxLength": True}, "p.maxLength", "non-negative integer"),
    ],
)  # fmt: skip
def test_schemas_no_value_or_any_length_would_meet_are_refused(schema, where, message):
    """An empty `anyOf` compiled into a grammar that allows no output (the request then failed
    with a 500 at its first token), and xgrammar read `"maxLength": -1` as no bound at all."""
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        schema_constraint(schema, "p")
    assert info.value.param == where


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"$ref": "#"}, "p"),
        ({"anyOf": [{"$ref": "#"}]}, "p"),
        ({"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}},
         "p"),
        ({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]},
         "p.properties.a"),
    ],
)  # fmt: skip
def test_refs_that_lead_only_to_one_another_are_refused(schema, where):
    """xgrammar compiled them into a rule that derives nothing: the request failed at its first
    token (or at the property), a 500, where the schema is the client's error."""
    with pytest.raises(InvalidRequestError, match="lead only to one another") as info:
        schema_constraint(schema, "p")
    assert info.value.param == where


def test_recursive_schemas_that_reach_a_value_stay_allowed():
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    for schema in (
        tree,
        {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
        {"$ref": "#/$defs/A", "$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}}},
    ):
        to_grammar(schema_constraint(schema, "p"))


def test_xgrammars_errors_do_not_name_its_source_files():
    for constraint in (
        Constraint("json_schema", '{"type": "foo"}', "p"),
        Constraint("regex", "a(?=b)", "p"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            to_grammar(constraint)
        assert ".cc:" not in info.value.message and "/project" not in info.value.message


@pytest.mark.parametrize(
    ("target", "text"),
    [
        ({"type": "object"}, '{"a": 1, "b": [true]}'),
        ({"type": "object", "description": "any"}, '{"a": 1}'),
        ({"type": ["object", "null"]}, '{"a": 1}'),
        ({"type": "array"}, '[1, "two", {"three": 3}]'),
        ({"type": "array", "minItems": 1}, "[1]"),  # was refused: "more than its prefixItems"
    ],
)
def test_an_unbounded_object_or_array_is_the_same_behind_a_ref(target, text):
    """Written in place, `{"type": "object"}` is any object and `{"type": "array"}` any array;
    behind a `$ref` xgrammar closed them: `{}` and `[]` only."""
    for schema in (target, {"$ref": "#/$defs/T", "$defs": {"T": target}}):
        assert accepts(schema_constraint(schema, "p"), text), schema
    inside = {"type": "object", "properties": {"t": {"$ref": "#/$defs/T"}}, "$defs": {"T": target}}
    assert accepts(schema_constraint(inside, "p"), '{"t": ' + text + "}")


def test_an_arrays_bounds_beside_items_are_enforced_without_a_type():
    constraint = schema_constraint({"items": {"type": "integer"}, "minItems": 2}, "p")
    assert accepts(constraint, "[1, 2]") and not accepts(constraint, "[1]")


@pytest.mark.parametrize(
    ("pattern", "text", "ok"),
    [
        (r"^[A-Z]:\\[a-z]+$", r'"C:\\users"', True),  # the backslash, escaped
        (r"^[A-Z]:\\[a-z]+$", r'"C:\users"', False),  # raw: invalid JSON
        (r"^a\nb$", r'"a\nb"', True),
        (r"^a\nb$", '"a\nb"', False),  # a raw newline
        (r"^a\tb$", r'"a\u0009b"', True),
        ('^"$', r'"\""', True),
        ('^"$', '"""', False),
        (r'^[\\"]{1,2}$', r'"\\\""', True),
        ("^é.*$", '"éa"', True),
        ("^é.*$", '"é"a"', False),  # a pattern with é took `.` as any character, `"` too
        ("^é[^a]$", r'"é\"', False),
        (r"^é\s$", '"é\t"', False),  # a raw tab
        (r"^\d{2}$", '"12"', True),
        (r"^\d{2}$", '"1a"', False),
        (r"^[\x1f]$", r'"\u001F"', True),
        (r"^[\x1f]$", r'"\u0011"', False),  # the class took both hex digits of 0x1f
    ],
)
def test_a_pattern_constrains_the_strings_value_not_its_json_text(pattern, text, ok):
    """xgrammar wrote what a pattern allows between the quotes as it is: a backslash, quote or
    newline the pattern asked for (and, in a pattern it could not compile as one automaton, any
    character `.` or a negated class allowed) came out raw, invalid JSON."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    document = '{"s": ' + text + "}"
    assert accepts(schema_constraint(schema, "p"), document) is ok
    if ok:
        assert re.fullmatch(pattern, json.loads(document)["s"])


def test_a_patterns_ecma_syntax_is_read_as_ecma_reads_it():
    """The patterns are parsed with Python's parser: what ECMA-262 spells otherwise is read."""
    for pattern, text in [
        (r"^(?<year>\d{4})-(?<month>\d{2})$", '"2026-12"'),  # Python: (?P<year>...)
        (r"^\u{e9}\cJ$", r'"é\n"'),
        ("^a[^]$", '"a-"'),  # any character
    ]:
        schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
        assert accepts(schema_constraint(schema, "p"), '{"s": ' + text + "}"), pattern
    assert not accepts(schema_constraint({"type": "string", "pattern": r"^\d$"}, "p"), '"٣"')


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("^(?!test)[a-z]+$", "lookahead"),  # xgrammar dropped it: "test" was allowed
        ("(?<=a)b", "lookbehind"),
        (r"\bword", "`\\b`"),
        (r"(a)\1", "back-references"),
        ("(?i)abc", "inline flags"),
        ("a^b", "`^` and `$`"),
        ("[a-", "not a valid regex"),
        (5, "must be a string"),
    ],
)
def test_patterns_the_translation_cannot_keep_are_refused(pattern, message):
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        schema_constraint(schema, "p")
    assert info.value.param == "p.properties.s.pattern"


@pytest.mark.parametrize(
    "regex",
    ["$a", "a^b", "^^a|b^", "(a$)b", "a$|b(^c)", r"\\$a", "[a]^b", r"\e^a"],
)
def test_a_regex_with_an_anchor_inside_is_refused(regex):
    """xgrammar warned and dropped a `^` or `$` that something could come before or after: `$a`
    matched "a", where no text can match it."""
    with pytest.raises(InvalidRequestError, match=re.escape("`^` and `$`")) as info:
        to_grammar(Constraint("regex", regex, "structured_outputs.regex"))
    assert info.value.param == "structured_outputs.regex"


def test_a_regex_with_anchors_at_its_ends_or_escaped_stays_allowed():
    for regex, text in [
        ("^a$", "a"),
        ("^a|^b$", "b"),
        ("(^a)(b$)", "ab"),
        ("^^a$$", "a"),
        (r"\^a\$", "^a$"),
        (r"a\\$", "a\\"),
        ("[^$]", "a"),
        ("[$^]b", "^b"),
        (r"[\]^]", "^"),
        (r"\e$", "\x1b"),  # (Python's parser refuses `\e`; xgrammar reads it as ESC)
    ]:
        assert accepts(Constraint("regex", regex), text), regex


@pytest.mark.parametrize(
    "pattern",
    [
        "^[A-Za-z]{2,8000}$",  # over 25 s in xgrammar, the gateway's event loop blocked
        "^.{1,1000}$",  # 4.4 s
        "^(ab?){1,5000}$",  # 7.4 s
        "^(ab){3000,}$",  # 2.3 s
        "^((a*){1,256}){1,256}$",
    ],
)
def test_a_pattern_too_costly_to_compile_is_refused(pattern):
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    with pytest.raises(InvalidRequestError, match="maxLength") as info:
        schema_constraint(schema, "p")
    assert info.value.param == "p.properties.s.pattern"


def test_patterns_too_costly_together_are_refused():
    """Each within the bound, but xgrammar's time is paid for each: a schema of many patterns
    blocked the gateway for their sum."""
    fields = {f"s{i}": {"type": "string", "pattern": f"^[a-z]{{1,{990 + i}}}$"} for i in range(6)}
    constraint = schema_constraint({"type": "object", "properties": fields}, "p")
    with pytest.raises(InvalidRequestError, match="patterns") as info:
        to_grammar(constraint)
    assert info.value.param == "p"


def test_the_common_bounded_patterns_stay_allowed():
    fields = {
        "slug": "^[a-z0-9-]{1,63}$",
        "summary": "^.{1,200}$",
        "word": "^[A-Za-z]{1,1000}$",
        "words": r"^(\w+\s?){1,100}$",
        "phone": r"^\+?\d{1,3}[- ]?\d{3}[- ]?\d{4}$",
    }
    properties = {name: {"type": "string", "pattern": p} for name, p in fields.items()}
    properties |= {
        f"code{i}": {"type": "string", "pattern": f"^[A-Z]{{{i + 1}}}$"} for i in range(40)
    }
    to_grammar(schema_constraint({"type": "object", "properties": properties}, "p"))


def test_length_bounded_strings_are_json_strings():
    """A string with `minLength`/`maxLength` took raw control characters: invalid JSON. (Escapes
    stay out of such strings, as xgrammar has them: see the next test.)"""
    bounded = schema_constraint(
        {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4},
         "l": {"type": "array", "items": {"type": "string", "maxLength": 1}},
         "o": {"type": "string", "minLength": 1, "maxLength": 1}},
         "required": ["s", "l"]}, "p")  # fmt: skip
    for text, ok in [
        ('{"s": "ab", "l": []}', True),
        ('{"s": "abcd", "l": ["x"], "o": "é"}', True),
        ('{"s": "abcde", "l": []}', False),  # five characters
        ('{"s": "a\tb", "l": []}', False),  # a raw tab
        ('{"s": "ab", "l": ["\u0000"]}', False),  # a raw NUL
        ('{"s": "a", "l": []}', False),
        ('{"s": "ab", "l": ["xy"]}', False),
        ('{"s": "ab", "l": [], "o": "\t"}', False),  # bounds of one are written inline
        ('{"s": "ab", "l": [], "o": "\u001f"}', False),
    ]:
        assert accepts(bounded, text) is ok, text
        if ok:
            json.loads(text)


def test_a_bounded_strings_masks_fill_as_fast_as_xgrammars_own(tokenizer):
    """The rewrite keeps one character class: a class or an escape, alternating, made every mask
    fill inside a bounded string 100-1,000 times slower (22 ms a token at maxLength 64, 140 ms at
    200, on the default model's 49,152 tokens), and a step waits on its masks. Compared with
    xgrammar's own grammar of the same schema, side by side (medians of 15 fills)."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 200}},
              "required": ["s"]}  # fmt: skip
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB), cache_enabled=False
    )
    own = xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True)
    ours = to_grammar(schema_constraint(schema, "p"))

    def median_fill_s(grammar) -> float:
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
        assert matcher.accept_string('{"s": "')
        bitmask = xgr.allocate_token_bitmask(1, VOCAB)
        times = []
        for _ in range(15):
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - start)
            assert matcher.accept_string("a")
        return sorted(times)[7]

    assert median_fill_s(ours) < 20 * median_fill_s(own) + 0.002


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    directory, _ = resolve_model_dir(None)
    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def cache(tokenizer):
    return GrammarCache(tokenizer, VOCAB, [EOS])


def test_unenforceable_schema_keywords_are_refused_by_name():
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}
    with pytest.raises(InvalidRequestError, match="`format`") as info:
        schema_constraint(schema, "response_format")
    assert info.value.param == "response_format.properties.a"
    for keyword in ("oneOf", "allOf", "not", "patternProperties", "uniqueItems"):
        with pytest.raises(InvalidRequestError, match=f"`{keyword}`"):
            schema_constraint({keyword: []}, "p")


@pytest.mark.parametrize(
    "constraint, message",
    [
        (Constraint("regex", "a(", "p"), "invalid regex"),
        (Constraint("grammar", "root ::= ", "p"), "invalid grammar"),
        (Constraint("json_schema", '{"type": 5}', "p"), "invalid json_schema"),
    ],
)
def test_invalid_specs_are_refused(constraint, message):
    with pytest.raises(InvalidRequestError, match=message):
        to_grammar(constraint)


def test_wrong_values_are_refused():
    with pytest.raises(InvalidRequestError, match="unknown constraint kind"):
        Constraint("yaml", "")
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_SPEC_CHARS}"):
        Constraint("regex", "a" * (MAX_SPEC_CHARS + 1))
    with pytest.raises(InvalidRequestError, match="non-empty strings"):
        choice_constraint(["a", ""], "c")
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        schema_constraint("{", "s")
    with pytest.raises(InvalidRequestError, match="not valid JSON"):  # (was a 500)
        schema_constraint('{"items":' * 100_000 + "{}" + "}" * 100_000, "s")
    with pytest.raises(InvalidRequestError, match="must be a Constraint"):
        SamplingParams(constraint={"kind": "regex"})
    with pytest.raises(ValueError, match="max_bytes"):
        GrammarCache(None, VOCAB, [EOS], max_bytes=0)


def test_compiles_once_per_distinct_constraint(cache):
    a = schema_constraint(PERSON, "x")
    first = cache.get(a)
    hits = cache.num_hits
    same = schema_constraint(json.loads(json.dumps(PERSON)), "other")  # equal, other field
    assert cache.get(same) is first
    assert cache.num_hits == hits + 1


def test_cache_is_bounded_by_bytes_lru(tokenizer):
    small = GrammarCache(tokenizer, VOCAB, [EOS], max_bytes=1)
    for i in range(3):
        small.get(Constraint("regex", f"x{i}+"))
        small.submit(Constraint("regex", "keep")).result()  # settle the callback
    # Every completed entry is over the bound alone, so at most the newest pending survives.
    assert small.num_bytes <= max(small._sizes.values(), default=0)
    assert len(small) <= 2


def test_compile_past_the_time_limit_fails_with_a_clear_error():
    with pytest.raises(GrammarError, match="did not compile within 0.01 s"):
        wait_compiled(Future(), 0.01)


def test_a_compile_past_its_requests_limit_goes_on_and_serves_the_next_ask(cache, monkeypatch):
    """A spec whose compile outlasts the time limit fails its request, as the error says, but
    is compiled all the same: sent again, it is served from the cache (a heavy schema costs its
    first request, not every one)."""
    compile_now = cache._compile
    monkeypatch.setattr(cache, "_compile", lambda c: (time.sleep(0.5), compile_now(c))[1])
    constraint = Constraint("regex", "slow+")
    with pytest.raises(GrammarError, match="a compile under way goes on"):
        cache.get(constraint, timeout_s=0.1)
    num_compiles = cache.num_compiles
    cache.submit(constraint).result(timeout=30)
    assert cache.get(constraint, timeout_s=0.1) is not None
    assert cache.num_compiles == num_compiles


def test_invalid_constraint_fails_in_the_cache_too(cache):
    with pytest.raises(GrammarError, match="invalid regex"):
        cache.get(Constraint("regex", "(("))


def test_replay_rebuilds_the_matcher_state(cache, tokenizer):
    constraint = schema_constraint(PERSON, "x")
    done = tokenizer.encode('{"name": "Al", "age": 3}')
    state = GrammarState(cache.submit(constraint), time.monotonic() + 60, done[:3])
    matcher = state.build(done[3:])
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    hello = tokenizer.encode("hello")
    broken = GrammarState(cache.submit(constraint), time.monotonic() + 60, hello)
    with pytest.raises(GrammarError, match="breaks the grammar"):
        broken.build([])


def test_masks_constrained_rows_in_place_and_leaves_free_rows(cache, tokenizer):
    choice = choice_constraint(["yes", "no"], "c")
    matcher = GrammarState(cache.submit(choice), time.monotonic() + 60).build([])
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    MaskBuffer(VOCAB).apply(logits, [None, matcher, None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = (logits[1] > -torch.inf).nonzero().squeeze(1).tolist()
    assert allowed and all(
        any(c.startswith(tokenizer.decode([t])) for c in ("yes", "no")) for t in allowed
    )


def test_masks_filled_ahead_equal_masks_filled_at_sampling(cache, tokenizer):
    """Rows filled ahead (on the mask thread, while a forward would run) and rows filled late
    (a matcher built after it) mask exactly as one fill at sampling time does."""
    person = GrammarState(cache.submit(schema_constraint(PERSON, "x")), time.monotonic() + 60)
    person.build(tokenizer.encode('{"name": "'))
    choice = GrammarState(
        cache.submit(choice_constraint(["yes", "no"], "c")), time.monotonic() + 60
    )
    choice.build([])
    matchers = [person.matcher, None, choice.matcher]
    logits = torch.randn(3, VOCAB)
    expected = logits.clone()
    MaskBuffer(VOCAB).apply(expected, matchers)
    buffer = MaskBuffer(VOCAB)
    for ahead in ([person.matcher, choice.matcher], [choice.matcher], []):
        buffer.fill_ahead(ahead)
        masked = logits.clone()
        buffer.apply(masked, matchers)
        assert torch.equal(masked, expected), ahead
    buffer.fill_ahead([person.matcher])
    assert buffer.settle() == {id(person.matcher): 0}  # a fill nobody used: waited for, dropped
    assert buffer.settle() == {}
    masked = logits.clone()
    buffer.apply(masked, matchers)  # nothing ahead now: all filled late
    assert torch.equal(masked, expected)


def test_the_sampler_uses_masks_filled_ahead_and_loads_nothing_for_free_batches(cache):
    state = GrammarState(cache.submit(Constraint("regex", "[0-9]{4}")), time.monotonic() + 60)
    state.build([])
    sampler = Sampler()
    sampler.fill_masks_ahead([], VOCAB)
    assert sampler._masks is None  # free batches never make a mask buffer
    row = SamplingRow(SamplingParams(temperature=0), None, [1], [], grammar_matcher=state.matcher)
    logits = torch.randn(1, VOCAB)
    sampler.fill_masks_ahead([state.matcher], VOCAB)
    token = sampler(logits, [row]).token_ids[0]
    assert state.matcher.accept_token(token)  # the drawn token is one the grammar allows
    assert sampler._masks.settle() == {}  # the call took the fill


def test_sampler_draws_only_what_the_grammar_allows(cache, tokenizer):
    constraint = Constraint("regex", "[0-9]{4}")
    state = GrammarState(cache.submit(constraint), time.monotonic() + 60)
    state.build([])
    sampler = Sampler()
    params = SamplingParams(temperature=1.0, seed=1)
    generator = torch.Generator().manual_seed(1)
    tokens = []
    while not state.is_terminated:
        row = SamplingRow(params, generator, [1], tokens, grammar_matcher=state.matcher)
        free = SamplingRow(SamplingParams(temperature=0), None, [1], [])
        out = sampler(torch.randn(2, VOCAB), [row, free])
        tokens.append(out.token_ids[0])
        state.accept(out.token_ids[0])
        assert len(tokens) <= 6
    assert tokens[-1] == EOS
    text = tokenizer.decode(tokens[:-1])
    assert len(text) == 4 and text.isdigit()


def test_engine_config_refuses_wrong_grammar_limits():
    from shared.engine.engine import EngineConfig

    with pytest.raises(ValueError, match="grammar_cache_bytes"):
        EngineConfig(grammar_cache_bytes=0)
    with pytest.raises(ValueError, match="grammar_compile_timeout_s"):
        EngineConfig(grammar_compile_timeout_s=0)


def test_an_engine_without_a_tokenizer_refuses_constrained_requests():
    from shared.engine.grammar import GrammarBinding

    binding = GrammarBinding(None, VOCAB, {EOS})
    with pytest.raises(InvalidRequestError, match="without a tokenizer"):
        binding.cache  # noqa: B018


def answer_or_calls_constraint(max_calls: int = 8) -> Constraint:
    answer = Constraint(
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "required": ["a"],
                "properties": {"a": {"type": "integer"}},
                "additionalProperties": False,
            }
        ),
    )
    call = {
        "type": "object",
        "properties": {"name": {"const": "f"}, "arguments": {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return answer_or_calls(answer, json.dumps(call), "tagged", max_calls)


def test_an_answer_or_calls_compiles_and_travels_on_the_wire(cache, tokenizer):
    """A response format beside `auto` tools: compiled against the tokenizer, and the same
    constraint after the wire (a worker of the previous schema would refuse the kind)."""
    constraint = answer_or_calls_constraint()
    spec = wire_convert.sampling_spec(SamplingParams(constraint=constraint))
    decoded = wire.decode(
        wire.encode(
            wire.PrefillJob(
                request_id="r",
                prompt_token_ids=[1],
                sampling=spec,
                gateway_address="g",
                decode_peer_id="d",
                decode_address="a",
            )
        )
    )
    assert wire_convert.sampling_params(decoded.sampling).constraint == constraint
    state = GrammarState(cache.submit(constraint), time.monotonic() + 60)
    state.build([])
    for token in tokenizer.encode('<tool_call>{"name": "f", "arguments": {}}</tool_call>'):
        assert state.matcher.accept_token(token)
    assert state.matcher.accept_token(EOS) and state.is_terminated


GOOD_SPEC = {"answer": {"kind": "regex", "spec": "a"}, "calls": "{}", "format": "tagged"}


@pytest.mark.parametrize(
    "spec",
    [
        "not json",
        "[]",
        json.dumps({**GOOD_SPEC, "format": "yaml", "max_calls": 1}),
        json.dumps({**GOOD_SPEC, "max_calls": 0}),
        json.dumps({**GOOD_SPEC, "max_calls": True}),
        json.dumps({**GOOD_SPEC, "max_calls": 1, "answer": {"kind": "answer_or_calls"}}),
        json.dumps({**GOOD_SPEC, "max_calls": 1, "answer": {"kind": "nope"}}),
        json.dumps({**GOOD_SPEC, "max_calls": 1, "calls": 5}),
    ],
)
def test_a_malformed_answer_or_calls_spec_is_an_invalid_request(spec):
    """The spec comes off the wire: anything malformed fails its request with a clear error,
    never a KeyError in the worker."""
    with pytest.raises(InvalidRequestError, match="answer_or_calls|unknown constraint kind"):
        to_grammar(Constraint("answer_or_calls", spec))


def test_the_tokenizer_tables_are_built_off_the_callers_thread(tokenizer, monkeypatch):
    # Built on the caller's thread they stalled an engine's loop (every sequence on it) for
    # 0.2-0.3 s at its first constrained request.
    import threading

    import xgrammar as xgr

    built_on = []
    original = xgr.TokenizerInfo.from_huggingface

    def recording(*args, **kwargs):
        built_on.append(threading.current_thread())
        return original(*args, **kwargs)

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", recording)
    cache = GrammarCache(tokenizer, VOCAB, [EOS])
    assert cache.get(Constraint("regex", "a+")) is not None
    assert built_on and threading.current_thread() not in built_on


def test_warming_builds_the_tables_and_reports_what_failed(tokenizer, monkeypatch):
    from shared.engine.grammar import GrammarBinding

    binding = GrammarBinding(tokenizer, VOCAB, {EOS})
    assert binding.warm() is None
    assert binding.cache._compiler.done()
    assert GrammarBinding(None, VOCAB, {EOS}).warm() is None  # nothing to build

    import xgrammar as xgr

    def broken(*args, **kwargs):
        raise RuntimeError("no tables")

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", broken)
    failing = GrammarBinding(tokenizer, VOCAB, {EOS})
    assert failing.warm() == "RuntimeError: no tables"
    with pytest.raises(GrammarError, match="no tables"):
        failing.cache.get(Constraint("regex", "a+"))
