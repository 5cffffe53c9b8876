"""Tool calls: every parser's format -> parse round trip (by hand and by hypothesis), several calls and the
content around them, one error line per malformed call, the registry's validation messages, sync and
async tools through call and acall, and the registry's schemas rendered by a real transformers chat template."""
import asyncio
import gc
import json
import warnings

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rl.envs.tools.calls import (PARSERS, JsonTagsParser, ParsedCalls, PythonTagParser, Tool, ToolCall, ToolCallParser,
                            ToolError, ToolRegistry, format_result, make_parser, register_parser, result_text)
from tests.tokenizer_dirs import build_bpe_tokenizer

PARSER_CASES = [
    ("json_tags", {}, "get_weather", {"city": "Paris", "days": 3, "units": {"temp": "C"}, "hourly": [1, 2.5]}),
    ("json_tags", {"open_tag": "[CALL]", "close_tag": "[/CALL]"}, "search", {"query": "what is \"x\"?\n"}),
    ("hermes", {}, "clock", {}),
    ("hermes", {}, "système", {"texte": "✓ 42 = 6 * 7", "ok": True, "none": None}),
    ("python_tag", {"arg_key": "code"}, "python_exec", {"code": "print(2+3)"}),
    ("python_tag", {"arg_key": "code"}, "python_exec", {"code": "for i in range(3):\n    print(i)"}),
    ("python_tag", {"open_tag": "<<", "close_tag": ">>"}, "lookup.key-2", {"input": "the key is: seven"}),
    ("python_tag", {}, "clock", {}),
]


@pytest.mark.parametrize("parser_name,options,name,arguments", PARSER_CASES)
def test_format_then_parse_gives_back_the_call_and_its_exact_span(parser_name, options, name, arguments):
    parser = make_parser(parser_name, **options)
    assert isinstance(parser, ToolCallParser)
    text = parser.format(name, arguments)
    before, after = "Let me check.\n", "\nDone."
    parsed = parser.parse(before + text + after)
    assert parsed == ParsedCalls(calls=[ToolCall(name, arguments, text)], errors=[], content=before + after)
    assert parsed.calls[0].text == text


def test_hermes_is_json_tags_with_qwen_tags():
    assert PARSERS["hermes"] is PARSERS["json_tags"]
    assert make_parser("hermes") == make_parser() == JsonTagsParser("<tool_call>", "</tool_call>")
    text = make_parser("hermes").format("f", {"a": 1})
    assert text == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def test_several_calls_in_one_text_keep_their_order_and_the_content_between_them():
    text = ('I will look up both.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call><tool_call>{"name": "a"}'
            '</tool_call>\nthen answer.')
    parsed = make_parser().parse(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("a", {"x": 1}), ("b", {"y": [2]}), ("a", {})]
    assert parsed.errors == []
    assert parsed.content == "I will look up both.\n and \nthen answer."
    for call in parsed.calls:  # each span is where it was found, tags included
        assert call.text in text and call.text.startswith("<tool_call>") and call.text.endswith("</tool_call>")

    tags = make_parser("python_tag", arg_key="code").parse("a<tool>run: 1</tool>b<tool>run:\n2\n</tool>c<tool>t</tool>")
    assert [(c.name, c.arguments) for c in tags.calls] == [("run", {"code": "1"}), ("run", {"code": "2"}), ("t", {})]
    assert tags.content == "abc" and tags.errors == []


def test_text_without_calls_is_all_content():
    text = "no calls here, only a stray </tool_call> and <tool> that is not ours"
    assert make_parser().parse(text) == ParsedCalls(calls=[], errors=[], content=text)
    assert make_parser().parse("") == ParsedCalls()


MALFORMED_JSON = [
    ('<tool_call>{"name": "a", "arguments": {}}', "unclosed <tool_call>"),
    ("<tool_call>{name: a}</tool_call>", "bad JSON"),
    ('<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>', "bad JSON"),
    ('<tool_call>["a", {}]</tool_call>', "is a JSON list, expected an object"),
    ('<tool_call>{"arguments": {"x": 1}}</tool_call>', "'name' is missing"),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "'name' is '', expected a non-empty string"),
    ('<tool_call>{"name": 7}</tool_call>', "'name' is 7"),
    ('<tool_call>{"name": "a", "arguments": [1, 2]}</tool_call>', "arguments is a JSON list, expected an object"),
    ('<tool_call>{"name": "a", "arguments": "{x"}</tool_call>', "arguments string is not JSON"),
    ('<tool_call>{"name": "a", "arguments": "[1]"}</tool_call>', "arguments is a JSON list"),
]


@pytest.mark.parametrize("bad,problem", MALFORMED_JSON)
def test_each_malformed_json_call_is_one_error_line_and_the_good_calls_still_parse(bad, problem):
    good = '<tool_call>{"name": "ok", "arguments": {"n": 1}}</tool_call>'
    parsed = make_parser().parse(f"before {good} middle {bad}")
    assert [c.name for c in parsed.calls] == ["ok"]
    assert len(parsed.errors) == 1 and problem in parsed.errors[0] and "\n" not in parsed.errors[0]
    assert parsed.content == "before  middle "  # a malformed call's span is not content either


def test_an_unclosed_call_loses_only_itself_when_another_call_follows():
    text = ('<tool_call>{"name": "lost", "arguments": {}}\n'
            '<tool_call>{"name": "kept", "arguments": {}}</tool_call> tail')
    parsed = make_parser().parse(text)
    assert [c.name for c in parsed.calls] == ["kept"]
    assert len(parsed.errors) == 1 and "unclosed <tool_call>" in parsed.errors[0] and "lost" in parsed.errors[0]
    assert parsed.content == " tail"


def test_error_lines_quote_a_short_excerpt_on_one_line():
    long_bad = "<tool_call>{" + "x" * 500 + "\n</tool_call>"
    (error,) = make_parser().parse(long_bad).errors
    assert "bad JSON" in error and "..." in error and len(error) < 160 and "\n" not in error


@pytest.mark.parametrize("bad,problem", [
    ("<tool>print(1)</tool>", "no 'name:' prefix"),
    ("<tool>two words: x</tool>", "'two words' is not a name"),
    ("<tool>: x</tool>", "'' is not a name"),
    ("<tool>run: x", "unclosed <tool>"),
])
def test_each_malformed_python_tag_call_is_one_error_line(bad, problem):
    parsed = make_parser("python_tag").parse(f"<tool>ok: 1</tool> {bad}")
    assert parsed.calls == [ToolCall("ok", {"input": "1"}, "<tool>ok: 1</tool>")]
    assert len(parsed.errors) == 1 and problem in parsed.errors[0] and "\n" not in parsed.errors[0]
    assert parsed.content == " "


def test_python_tag_refuses_to_format_what_it_could_not_parse_back():
    parser = PythonTagParser(arg_key="code")
    for arguments in ({"other": "x"}, {"code": 3}, {"code": " padded"}, {"code": "a</tool>b"},
                      {"code": "x", "more": "y"}):
        with pytest.raises(ValueError, match="python_tag writes one stripped string argument 'code'"):
            parser.format("run", arguments)
    with pytest.raises(ValueError, match="tool name 'not a name'"):
        parser.format("not a name", {})


_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8)
                            | st.floats(allow_nan=False, allow_infinity=False),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3), max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(st.tuples(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True),
                                st.dictionaries(st.text(max_size=6), _json_values, max_size=4)), max_size=4),
       pieces=st.lists(st.text(max_size=12), min_size=5, max_size=5),
       python_tag=st.booleans())
def test_random_calls_between_random_text_round_trip(calls, pieces, python_tag):
    """Any calls, interleaved with any text free of the tags, parse back in order; the text is the content."""
    parser = make_parser("python_tag", arg_key="code") if python_tag else make_parser()
    if python_tag:  # the compact format carries one stripped string argument or none
        calls = [(name, {"code": json.dumps(args)} if args else {}) for name, args in calls]
    assume(not any(parser.close_tag in json.dumps(args, ensure_ascii=False) for _, args in calls))
    assume(not any(tag in p for p in pieces for tag in (parser.open_tag, parser.close_tag)))
    formatted = [parser.format(name, args) for name, args in calls]
    text = pieces[0] + "".join(f + p for f, p in zip(formatted, pieces[1:]))
    parsed = parser.parse(text)
    assert parsed.errors == []
    assert parsed.calls == [ToolCall(n, a, f) for (n, a), f in zip(calls, formatted)]
    assert parsed.content == "".join(pieces[:len(calls) + 1])


def test_parser_registry_names_and_options():
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'xml', expected one of \['hermes', 'json_tags', "
                                         r"'python_tag'"):
        make_parser("xml")
    with pytest.raises(ValueError, match="tool-call parser 'json_tags': bad options \\['arg_key'\\]"):
        make_parser("json_tags", arg_key="code")
    with pytest.raises(ValueError, match="close_tag must be a non-empty string, got ''"):
        make_parser("json_tags", close_tag="")
    with pytest.raises(ValueError, match="open_tag and close_tag are both '```', expected two different tags"):
        make_parser("python_tag", open_tag="```", close_tag="```")
    with pytest.raises(ValueError, match="arg_key must be a non-empty string"):
        make_parser("python_tag", arg_key="")
    with pytest.raises(ValueError, match="'json_tags' is already registered"):
        register_parser("json_tags")(JsonTagsParser)

    @register_parser("upper_json_test")
    def upper(**options):
        return JsonTagsParser(open_tag="<CALL>", close_tag="</CALL>", **options)

    try:
        parsed = make_parser("upper_json_test").parse('x<CALL>{"name": "f"}</CALL>')
        assert parsed.calls == [ToolCall("f", {}, '<CALL>{"name": "f"}</CALL>')] and parsed.content == "x"
    finally:
        del PARSERS["upper_json_test"]


def _add(a: int, b: int = 0) -> int:
    return a + b


async def _slow_echo(text: str, times: int = 1) -> str:
    await asyncio.sleep(0)
    return text * times


def _registry() -> ToolRegistry:
    everything = {"s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
                  "b": {"type": "boolean"}, "a": {"type": "array"}, "o": {"type": "object"},
                  "maybe": {"type": ["string", "null"]}, "unit": {"type": "string", "enum": ["C", "F"]}}
    return ToolRegistry([
        Tool("add", "Add two integers.", {"type": "object", "properties": {
            "a": {"type": "integer", "description": "first"}, "b": {"type": "integer"}}, "required": ["a"]}, _add),
        Tool("echo", "Repeat a text.", {"type": "object", "properties": {
            "text": {"type": "string"}, "times": {"type": "integer"}}, "required": ["text"]}, _slow_echo),
        Tool("typed", "Takes every JSON type.", {"type": "object", "properties": everything}, lambda **kw: kw),
    ])


def test_registry_refuses_duplicates_and_names_the_known_tools():
    registry = _registry()
    assert registry.names == ["add", "echo", "typed"] and "add" in registry and "nope" not in registry
    assert registry.get("add").fn is _add
    with pytest.raises(ValueError, match="tool 'add' is already registered"):
        registry.register(Tool("add", "again", {"type": "object"}, _add))
    with pytest.raises(ValueError, match=r"unknown tool 'sub', expected one of \['add', 'echo', 'typed'\]"):
        registry.get("sub")


@pytest.mark.parametrize("parameters,problem", [
    ({"properties": {}}, "must be a JSON schema {'type': 'object'"),
    ({"type": "object", "properties": {"x": {"type": "str"}}}, "property 'x' has schema {'type': 'str'}"),
    ({"type": "object", "properties": {"x": {"type": "string"}}, "required": ["y"]}, "['required'] = ['y']"),
])
def test_tool_schema_mistakes_are_refused_when_the_tool_is_built(parameters, problem):
    with pytest.raises(ValueError, match="tool 'f': parameters") as info:
        Tool("f", "", parameters, _add)
    assert problem in str(info.value)


@pytest.mark.parametrize("call,messages", [
    (ToolCall("add", {"a": 1, "b": 2}), []),
    (ToolCall("sub", {"a": 1}), ["unknown tool 'sub', expected one of ['add', 'echo', 'typed']"]),
    (ToolCall("add", {"b": 2}), ["tool 'add': missing required argument 'a'"]),
    (ToolCall("add", {"a": 1, "c": 3}), ["tool 'add': unexpected argument 'c', expected one of ['a', 'b']"]),
    (ToolCall("add", {"a": "1", "b": 2.5}), ["tool 'add': argument 'a' is string '\"1\"', expected integer",
                                             "tool 'add': argument 'b' is number '2.5', expected integer"]),
    (ToolCall("add", {"a": True}), ["tool 'add': argument 'a' is boolean 'true', expected integer"]),
    (ToolCall("typed", {"s": "x", "i": 1, "n": 1, "b": False, "a": [1], "o": {}, "maybe": None, "unit": "C"}), []),
    (ToolCall("typed", {"s": 1, "n": "1", "b": 0, "a": {}, "o": [], "maybe": 2, "unit": "K"}), [
        "tool 'typed': argument 's' is integer '1', expected string",
        "tool 'typed': argument 'n' is string '\"1\"', expected number",
        "tool 'typed': argument 'b' is integer '0', expected boolean",
        "tool 'typed': argument 'a' is object '{}', expected array",
        "tool 'typed': argument 'o' is array '[]', expected object",
        "tool 'typed': argument 'maybe' is integer '2', expected string or null",
        "tool 'typed': argument 'unit' is '\"K\"', expected one of ['C', 'F']"]),
])
def test_validation_messages(call, messages):
    assert _registry().validate(call) == messages


def test_additional_properties_allows_unexpected_arguments():
    tool = Tool("kw", "", {"type": "object", "properties": {}, "additionalProperties": True}, lambda **kw: sorted(kw))
    registry = ToolRegistry([tool])
    assert registry.validate(ToolCall("kw", {"any": 1})) == []
    assert registry.call(ToolCall("kw", {"z": 1, "a": 2})) == '["a", "z"]'


def test_call_runs_validated_tools_and_reports_failures_as_tool_errors():
    registry = _registry()
    assert registry.call(ToolCall("add", {"a": 2, "b": 3})) == "5"
    assert registry.call(ToolCall("typed", {"s": "é"})) == '{"s": "é"}'
    with pytest.raises(ToolError, match="missing required argument 'a'; tool 'add': unexpected argument 'x'"):
        registry.call(ToolCall("add", {"x": 1}))
    boom = Tool("boom", "", {"type": "object", "properties": {}}, lambda: 1 / 0)
    registry.register(boom)
    with pytest.raises(ToolError, match="tool 'boom' raised ZeroDivisionError: division by zero") as info:
        registry.call(ToolCall("boom", {}))
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_async_tools_run_through_call_outside_a_loop_and_through_acall_inside_one():
    registry = _registry()
    echo = ToolCall("echo", {"text": "ab", "times": 2})
    assert registry.call(echo) == "abab"  # no loop in this thread: asyncio.run

    async def inside_a_loop():
        results = await asyncio.gather(registry.acall(echo), registry.acall(ToolCall("add", {"a": 1})))
        with pytest.raises(RuntimeError, match="use `await registry.acall\\(call\\)`"):
            registry.call(echo)
        with pytest.raises(ToolError, match="missing required argument 'text'"):
            await registry.acall(ToolCall("echo", {}))
        return results

    assert asyncio.run(inside_a_loop()) == ["abab", "1"]


def test_a_sync_function_returning_a_coroutine_inside_a_loop_is_refused_without_a_never_awaited_warning():
    registry = ToolRegistry([Tool("wrapped", "", {"type": "object", "properties": {}}, lambda: _slow_echo("x"))])
    assert registry.call(ToolCall("wrapped", {})) == "x"

    async def inside_a_loop():
        with pytest.raises(RuntimeError, match="returned an awaitable while an event loop is running"):
            registry.call(ToolCall("wrapped", {}))
        return await registry.acall(ToolCall("wrapped", {}))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert asyncio.run(inside_a_loop()) == "x"
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_async_tool_failures_are_tool_errors_in_call_and_acall():
    async def fails(**_):
        raise KeyError("gone")

    registry = ToolRegistry([Tool("fails", "", {"type": "object", "properties": {}}, fails)])
    with pytest.raises(ToolError, match="tool 'fails' raised KeyError: 'gone'"):
        registry.call(ToolCall("fails", {}))
    with pytest.raises(ToolError, match="tool 'fails' raised KeyError"):
        asyncio.run(registry.acall(ToolCall("fails", {})))


def test_results_and_errors_as_observation_text():
    assert [result_text(r) for r in ("s", None, b"\xffok", {"a": [1, True]}, 2.5, False, ("t",), {1, 2} & {2})] == \
        ["s", "", "\ufffdok", '{"a": [1, true]}', "2.5", "false", '["t"]', "{2}"]
    assert format_result("add", 5) == "5"
    assert format_result("add", ToolError("tool 'add': missing required argument 'a'")) == \
        "error: tool 'add': missing required argument 'a'"
    assert format_result("add", ValueError("bad")) == "error: tool 'add' raised ValueError: bad"
    assert format_result("cat", "x" * 50, max_chars=10) == "x" * 10 + "... [40 more characters cut]"
    assert format_result("cat", "x" * 10, max_chars=10) == "x" * 10


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with Qwen 2.5's tool block: each tool's schema as one line of JSON inside <tools></tools>."""


def test_schemas_render_in_a_transformers_chat_template_and_calls_parse_back(tmp_path):
    import transformers

    registry = _registry()
    tokenizer = transformers.AutoTokenizer.from_pretrained(build_bpe_tokenizer(tmp_path, chat_template=TOOLS_TEMPLATE))
    parser = make_parser("hermes")
    call_text = parser.format("add", {"a": 2, "b": 3})
    messages = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "Adding.\n" + call_text},
                {"role": "tool", "content": registry.call(parser.parse(call_text).calls[0])}]
    rendered = tokenizer.apply_chat_template(messages, tools=registry.schemas(), tokenize=False,
                                             add_generation_prompt=True)
    tools_block = rendered.split("<tools>\n", 1)[1].split("</tools>", 1)[0]
    assert [json.loads(line) for line in tools_block.splitlines()] == registry.schemas()
    for name in registry.names:
        assert f'"name": "{name}"' in rendered
    parsed = parser.parse(rendered)
    assert parsed.calls == [ToolCall("add", {"a": 2, "b": 3}, call_text)] and parsed.errors == []
    assert "<|im_start|>tool\n5<|im_end|>" in rendered
