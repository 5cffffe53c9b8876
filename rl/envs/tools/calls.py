"""Tool calls: the model's text parsed into `ToolCall`s, and a `ToolRegistry` that validates and runs them.

Words: a *call* is one `{name, arguments}` request found in the model's text; its *span* (`ToolCall.text`)
is the exact substring it was parsed from, tags included; *content* is the text outside every span.

Parsers are registered by name (`PARSERS`, `make_parser`):
- `json_tags` (default) and its alias `hermes`: a JSON object per call between tags (Qwen / Hermes).
- `python_tag`: `<tool>name: argument text</tool>`, one free-text argument, for tiny models.
A parser never raises on the model's text: each malformed call becomes one line of `ParsedCalls.errors`.

Tool schemas follow OpenAI's function-calling format, which transformers' `apply_chat_template(tools=...)`
hands to the chat template as is.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

EXCERPT_CHARS = 40
"""Longest excerpt of the model's text quoted in an error line (repr'd, so it stays on one line)."""


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's `name`, its `arguments` (JSON-decoded, keyword -> value) and `text`, the
    exact span of the model's text it was parsed from (tags included; "" when built by hand)."""
    name: str
    arguments: dict
    text: str = ""


@dataclass
class ParsedCalls:
    """What a parser found in one text: the well-formed `calls` in order, one `errors` line per malformed
    call (what was wrong, quoting a short excerpt), and `content`: the text with every call's span,
    well-formed or not, cut out (the pieces joined as they are, nothing stripped)."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""


@runtime_checkable
class ToolCallParser(Protocol):
    """Turns model text into calls, and calls back into the text the model is taught to write."""

    def parse(self, text: str) -> ParsedCalls:
        """The calls, errors and content of `text`; never raises on malformed calls."""

    def format(self, name: str, arguments: dict) -> str:
        """The text of one call, such that `parse(format(n, a)).calls == [ToolCall(n, a, <that text>)]`."""


PARSERS: dict[str, Callable[..., ToolCallParser]] = {}


def register_parser(name: str) -> Callable:
    """Decorator: register a parser factory (usually the class) under `name`."""
    def wrap(factory: Callable[..., ToolCallParser]) -> Callable[..., ToolCallParser]:
        if name in PARSERS:
            raise ValueError(f"tool-call parser {name!r} is already registered")
        PARSERS[name] = factory
        return factory

    return wrap


def make_parser(name: str = "json_tags", **options: Any) -> ToolCallParser:
    """The parser registered as `name`, built with `options` (its tags, ...)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}, expected one of {sorted(PARSERS)}")
    try:
        return PARSERS[name](**options)
    except TypeError as err:
        raise ValueError(f"tool-call parser {name!r}: bad options {sorted(options)} ({err})") from None


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text` cut to `limit` characters (an ellipsis marks the cut), repr'd so it stays on one line."""
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


def _check_tags(open_tag: str, close_tag: str) -> None:
    for key, tag in (("open_tag", open_tag), ("close_tag", close_tag)):
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"{key} must be a non-empty string, got {tag!r}")
    if open_tag == close_tag:  # a span ends at the first close tag, unless an open tag comes first
        raise ValueError(f"open_tag and close_tag are both {open_tag!r}, expected two different tags")


@dataclass(frozen=True)
class _Span:
    """A tagged span of the text: [start, end) with `body` between the tags; `closed` False when the
    close tag is missing (the span then runs to the next open tag or the end of the text)."""
    start: int
    end: int
    body: str
    closed: bool


def _tagged_spans(text: str, open_tag: str, close_tag: str) -> Iterator[_Span]:
    """Every span that starts at an open tag, in order. A span ends at the first close tag after it,
    unless another open tag comes first: then it is unclosed and ends where that next call begins
    (a model that forgot one close tag loses that call only, not the ones after it)."""
    pos = 0
    while (start := text.find(open_tag, pos)) >= 0:
        body_start = start + len(open_tag)
        close = text.find(close_tag, body_start)
        next_open = text.find(open_tag, body_start)
        if close >= 0 and (next_open < 0 or close < next_open):
            pos = close + len(close_tag)
            yield _Span(start, pos, text[body_start:close], closed=True)
        else:
            pos = next_open if next_open >= 0 else len(text)
            yield _Span(start, pos, text[body_start:pos], closed=False)


def _parse_tagged(text: str, open_tag: str, close_tag: str,
                  decode: Callable[[str], tuple[str, dict] | str]) -> ParsedCalls:
    """Split `text` into spans and content; `decode(body)` gives (name, arguments) or an error line."""
    out, pieces, pos = ParsedCalls(), [], 0
    for span in _tagged_spans(text, open_tag, close_tag):
        pieces.append(text[pos:span.start])
        pos = span.end
        span_text = text[span.start:span.end]
        if not span.closed:
            out.errors.append(f"unclosed {open_tag}: no {close_tag} after {excerpt(span_text)}")
            continue
        decoded = decode(span.body)
        if isinstance(decoded, str):
            out.errors.append(decoded)
        else:
            out.calls.append(ToolCall(decoded[0], decoded[1], span_text))
    pieces.append(text[pos:])
    out.content = "".join(pieces)
    return out


def _decode_json_call(body: str) -> tuple[str, dict] | str:
    """`{"name": str, "arguments": {...} or a JSON string of one}` -> (name, arguments), else an error line.
    A missing `arguments` means none; Llama 3's key `parameters` is read as `arguments`."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return f"bad JSON in tool call ({err.msg} at char {err.pos}): {excerpt(body.strip())}"
    if not isinstance(obj, dict):
        return f"tool call is a JSON {type(obj).__name__}, expected an object with 'name': {excerpt(body.strip())}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        got = "missing" if name is None else f"{name!r}"
        return f"tool call 'name' is {got}, expected a non-empty string: {excerpt(body.strip())}"
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI's wire format: the arguments object as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return f"tool call {name!r}: arguments string is not JSON ({err.msg}): {excerpt(arguments)}"
    if not isinstance(arguments, dict):
        return (f"tool call {name!r}: arguments is a JSON {type(arguments).__name__}, expected an object: "
                f"{excerpt(json.dumps(arguments))}")
    return name, arguments


@register_parser("json_tags")
@dataclass(frozen=True)
class JsonTagsParser:
    """Calls as JSON objects between tags, any number per text:

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    `arguments` may be an object or a JSON string of one (OpenAI style); missing means none. Errors
    (one line each): an open tag without its close tag, bad JSON, a non-object, a missing or empty
    `name`, non-object `arguments`. Limitation (shared with vLLM's hermes parser): a JSON string that
    contains the close tag ends the call early.
    """
    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"

    def __post_init__(self) -> None:
        _check_tags(self.open_tag, self.close_tag)

    def parse(self, text: str) -> ParsedCalls:
        return _parse_tagged(text, self.open_tag, self.close_tag, _decode_json_call)

    def format(self, name: str, arguments: dict) -> str:
        """Qwen 2.5's layout: the tags on their own lines around one line of JSON."""
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.open_tag}\n{call}\n{self.close_tag}"


register_parser("hermes")(JsonTagsParser)  # Qwen 2.5 / Hermes 2 Pro: json_tags with the default tags

TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
"""A tool name in the `python_tag` format: an identifier, dots and dashes allowed after the first character."""


@register_parser("python_tag")
@dataclass(frozen=True)
class PythonTagParser:
    """One free-text argument per call, cheap for tiny models to learn:

        <tool>python_exec: print(2 + 3)</tool>   -> ToolCall("python_exec", {arg_key: "print(2 + 3)"})
        <tool>python_exec:
        for i in range(3):
            print(i)
        </tool>                                  -> the argument is the three lines of code
        <tool>clock</tool> or <tool>clock:</tool> -> ToolCall("clock", {})

    The body is `name`, then optionally `:` and the argument text; whitespace around the name and
    around the argument text is stripped (so code may start on the line after the colon); an empty
    argument means no arguments. The argument cannot contain the close tag. Errors (one line each):
    an open tag without its close tag, a body that does not start with a tool name, or text after
    the name without a colon.
    """
    open_tag: str = "<tool>"
    close_tag: str = "</tool>"
    arg_key: str = "input"
    """The keyword the argument text is passed as (e.g. "code" for a Python tool)."""

    def __post_init__(self) -> None:
        _check_tags(self.open_tag, self.close_tag)
        if not isinstance(self.arg_key, str) or not self.arg_key:
            raise ValueError(f"arg_key must be a non-empty string, got {self.arg_key!r}")

    def parse(self, text: str) -> ParsedCalls:
        return _parse_tagged(text, self.open_tag, self.close_tag, self._decode)

    def _decode(self, body: str) -> tuple[str, dict] | str:
        head, colon, argument = body.partition(":")
        name = head.strip()
        if not TOOL_NAME.fullmatch(name):
            expected = f"'name: argument' inside {self.open_tag}{self.close_tag}"
            if not colon:
                return f"tool call has no 'name:' prefix, expected {expected}: {excerpt(body.strip())}"
            return f"tool name {excerpt(name)} is not a name, expected {expected}: {excerpt(body.strip())}"
        argument = argument.strip()
        return name, ({self.arg_key: argument} if argument else {})

    def format(self, name: str, arguments: dict) -> str:
        """`<tool>name: text</tool>`; `arguments` must be {} or {arg_key: str} (the only shapes parse gives)."""
        if not TOOL_NAME.fullmatch(name):
            raise ValueError(f"tool name {name!r} cannot be written as {self.open_tag}name: ...{self.close_tag}")
        if not arguments:
            return f"{self.open_tag}{name}{self.close_tag}"
        value = arguments.get(self.arg_key)
        if set(arguments) != {self.arg_key} or not isinstance(value, str) or value != value.strip() \
                or self.close_tag in value:
            raise ValueError(f"python_tag writes one stripped string argument {self.arg_key!r} without "
                             f"{self.close_tag!r}, got {excerpt(json.dumps(arguments))}")
        if "\n" in value:  # code on its own lines, as a model writes a block
            return f"{self.open_tag}{name}:\n{value}\n{self.close_tag}"
        return f"{self.open_tag}{name}: {value}{self.close_tag}"


class ToolError(ValueError):
    """A call that cannot be run (unknown tool, invalid arguments) or whose tool raised; the message
    names the tool and says what was wrong, ready to show the model as the observation."""


JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list, tuple), "object": (dict,), "null": (type(None),),
}
"""JSON-schema type name -> the Python types json.loads gives for it (bool is never an integer or number)."""


def matches_json_type(value: Any, type_name: str) -> bool:
    """Whether `value` is of JSON-schema type `type_name` (one of JSON_TYPES)."""
    if isinstance(value, bool) and type_name in ("integer", "number"):
        return False
    return isinstance(value, JSON_TYPES[type_name])


def _json_type_of(value: Any) -> str:
    return next((t for t in JSON_TYPES if matches_json_type(value, t)), type(value).__name__)


def _check_parameters(tool_name: str, parameters: Any) -> None:
    """Raise ValueError unless `parameters` is an object schema whose property types are known and whose
    required names are properties."""
    where = f"tool {tool_name!r}: parameters"
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ValueError(f"{where} must be a JSON schema {{'type': 'object', ...}}, got {parameters!r}")
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        raise ValueError(f"{where}['properties'] must be a dict, got {properties!r}")
    for key, schema in properties.items():
        types = schema.get("type", []) if isinstance(schema, dict) else None
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or any(t not in JSON_TYPES for t in types):
            raise ValueError(f"{where}: property {key!r} has schema {schema!r}, expected a dict whose 'type' "
                             f"is one of {list(JSON_TYPES)} (or a list of them)")
    required = parameters.get("required", [])
    if not isinstance(required, list) or any(k not in properties for k in required):
        raise ValueError(f"{where}['required'] = {required!r}, expected a list of {sorted(properties)}")


@dataclass
class Tool:
    """A function the model may call. `parameters` is a JSON-schema object
    {"type": "object", "properties": {key: {"type": ..., "description": ...}}, "required": [...]};
    `fn` takes the arguments as keyword arguments and may be `async def`; its result becomes the
    observation text (`result_text`)."""
    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TOOL_NAME.fullmatch(self.name):
            raise ValueError(f"tool name {self.name!r}: expected a name matching {TOOL_NAME.pattern}")
        if not callable(self.fn):
            raise ValueError(f"tool {self.name!r}: fn must be callable, got {self.fn!r}")
        _check_parameters(self.name, self.parameters)

    @property
    def schema(self) -> dict:
        """OpenAI's function-tool entry, as chat templates take it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def result_text(result: Any) -> str:
    """A tool's return value as observation text: a str as is, None as "", bytes decoded (UTF-8,
    bad bytes replaced), JSON values (dict, list, numbers, bools) as JSON, anything else via str()."""
    if isinstance(result, str):
        return result
    if result is None:
        return ""
    if isinstance(result, bytes):
        return result.decode("utf-8", errors="replace")
    if isinstance(result, (dict, list, tuple, int, float, bool)):
        return json.dumps(result, ensure_ascii=False, default=str)
    return str(result)


def format_result(name: str, result_or_error: Any, max_chars: int | None = None) -> str:
    """The observation for a call of tool `name`: its result as text (`result_text`), or for an
    exception "error: ..." (a ToolError's message already names the tool; any other exception is
    reported as raised by `name`). With `max_chars`, a longer text is cut and says how much was cut."""
    if isinstance(result_or_error, ToolError):
        text = f"error: {result_or_error}"
    elif isinstance(result_or_error, BaseException):
        text = f"error: tool {name!r} raised {type(result_or_error).__name__}: {result_or_error}"
    else:
        text = result_text(result_or_error)
    if max_chars is not None and len(text) > max_chars:
        text = f"{text[:max_chars]}... [{len(text) - max_chars} more characters cut]"
    return text


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _guarded(name: str, fn: Callable[..., Any], arguments: dict) -> Any:
    """`fn(**arguments)`, any exception raised again as a ToolError naming tool `name` (chained to it)."""
    try:
        return fn(**arguments)
    except Exception as err:
        raise ToolError(f"tool {name!r} raised {type(err).__name__}: {err}") from err


class ToolRegistry:
    """The tools one environment offers, by name. Calls are validated against each tool's schema before
    its function runs; `call` runs sync and async tools from plain code, `acall` from a running loop
    (sync tools then run inline and block the loop: wrap a slow one as `async def` with asyncio.to_thread)."""

    def __init__(self, tools: list[Tool] | tuple[Tool, ...] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> Tool:
        """Add `tool`; a second tool of the same name is refused (ValueError)."""
        if not isinstance(tool, Tool):
            raise ValueError(f"expected a Tool, got {type(tool).__name__} {tool!r}")
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    @property
    def names(self) -> list[str]:
        """The tools' names in registration order."""
        return list(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def get(self, name: str) -> Tool:
        """The tool called `name` (ValueError naming the known tools if there is none)."""
        if name not in self._tools:
            raise ValueError(f"unknown tool {name!r}, expected one of {self.names}")
        return self._tools[name]

    def schemas(self) -> list[dict]:
        """OpenAI-style tool list for `tokenizer.apply_chat_template(messages, tools=...)`."""
        return [tool.schema for tool in self._tools.values()]

    def validate(self, call: ToolCall) -> list[str]:
        """One line per problem with `call` (empty: it may run): an unknown tool, a missing required
        argument, an unexpected argument (unless the schema sets additionalProperties), a value of the
        wrong JSON type or outside the property's `enum`. Nested array items and objects are not checked."""
        tool = self._tools.get(call.name)
        if tool is None:
            return [f"unknown tool {call.name!r}, expected one of {self.names}"]
        if not isinstance(call.arguments, dict):
            return [f"tool {call.name!r}: arguments must be a dict, got {type(call.arguments).__name__}"]
        properties = tool.parameters.get("properties", {})
        extra_ok = tool.parameters.get("additionalProperties", False) not in (False, None)
        errors = [f"tool {call.name!r}: missing required argument {key!r}"
                  for key in tool.parameters.get("required", []) if key not in call.arguments]
        for key, value in call.arguments.items():
            if key not in properties:
                if not extra_ok:
                    errors.append(f"tool {call.name!r}: unexpected argument {key!r}, expected one of "
                                  f"{list(properties)}")
                continue
            errors.extend(self._value_errors(call.name, key, value, properties[key]))
        return errors

    @staticmethod
    def _value_errors(tool_name: str, key: str, value: Any, schema: dict) -> list[str]:
        shown = excerpt(json.dumps(value, ensure_ascii=False, default=repr))
        types = schema.get("type", [])
        types = [types] if isinstance(types, str) else types
        if types and not any(matches_json_type(value, t) for t in types):
            expected = " or ".join(types)
            return [f"tool {tool_name!r}: argument {key!r} is {_json_type_of(value)} {shown}, expected {expected}"]
        if "enum" in schema and value not in schema["enum"]:
            return [f"tool {tool_name!r}: argument {key!r} is {shown}, expected one of {schema['enum']}"]
        return []

    def _checked(self, call: ToolCall) -> Tool:
        errors = self.validate(call)
        if errors:
            raise ToolError("; ".join(errors))
        return self._tools[call.name]

    def call(self, call: ToolCall) -> str:
        """Validate `call`, run its tool and return the result as text (`result_text`). A coroutine result
        is run to completion with asyncio.run; inside a running event loop that is impossible and raises
        RuntimeError (use `await acall(call)` there). Raises ToolError for an invalid call or a tool
        that raised (chained to the tool's exception)."""
        tool = self._checked(call)
        if inspect.iscoroutinefunction(tool.fn) and _loop_running():
            raise RuntimeError(f"tool {tool.name!r} is async and an event loop is running in this thread: "
                               f"use `await registry.acall(call)` instead of registry.call(call)")
        result = _guarded(tool.name, tool.fn, call.arguments)
        if inspect.isawaitable(result):
            if _loop_running():
                if inspect.iscoroutine(result):
                    result.close()  # never awaited: close it so Python does not warn
                raise RuntimeError(f"tool {tool.name!r} returned an awaitable while an event loop is "
                                   f"running in this thread: use `await registry.acall(call)`")
            result = _guarded(tool.name, lambda: asyncio.run(_await(result)), {})
        return result_text(result)

    async def acall(self, call: ToolCall) -> str:
        """`call` for code inside an event loop: an async tool is awaited, a sync one runs inline."""
        tool = self._checked(call)
        result = _guarded(tool.name, tool.fn, call.arguments)
        if inspect.isawaitable(result):
            try:
                result = await result
            except Exception as err:
                raise ToolError(f"tool {tool.name!r} raised {type(err).__name__}: {err}") from err
        return result_text(result)
