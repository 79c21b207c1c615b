"""router.request_path.request.parse_request: a body becomes a RoutableRequest once, or a clear 4xx."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from multidict import CIMultiDict

from router.config import TenancyConfig
from router.errors import OpenAIError
from router.request_path.endpoints import EMBEDDINGS, RERANK, RESPONSES, TRANSCRIPTIONS
from router.request_path.request import CHAT, COMPLETIONS, RoutableRequest, parse_request

TENANCY = TenancyConfig()
SESSION_HEADER = "x-session-id"


def parse(
    body: Any,
    endpoint: str = CHAT,
    headers: dict[str, str] | None = None,
    tenancy: TenancyConfig = TENANCY,
) -> RoutableRequest:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    # aiohttp hands the handler a case-insensitive multidict; so do the tests.
    return parse_request(endpoint, raw, CIMultiDict(headers or {}), tenancy, SESSION_HEADER)


def chat(messages: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": "llama", "messages": messages, **extra}


def msg(role: str, content: Any) -> dict[str, Any]:
    return {"role": role, "content": content}


def prompt_of(messages: list[Any], **extra: Any) -> bytes:
    return parse(chat(messages, **extra)).prompt


def completion_prompt(prompt: Any) -> bytes:
    return parse({"model": "llama", "prompt": prompt}, endpoint=COMPLETIONS).prompt


def expect_error(body: Any, endpoint: str = CHAT, headers: dict[str, str] | None = None) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(body, endpoint=endpoint, headers=headers)
    return info.value


# --- the happy path ---------------------------------------------------------------------------


def test_chat_request_fields() -> None:
    raw = orjson.dumps(chat([msg("user", "hello")], stream=True, max_tokens=64))
    routable = parse(raw)
    assert routable.endpoint == CHAT
    assert routable.model == "llama"
    assert routable.stream is True
    assert routable.max_tokens == 64
    assert routable.body is raw  # forwarded exactly as received
    assert b"hello" in routable.prompt
    assert b"user" in routable.prompt


def test_defaults_when_optional_fields_are_absent() -> None:
    routable = parse(chat([msg("user", "hi")]))
    assert routable.stream is False
    assert routable.max_tokens is None
    assert routable.session_key is None
    assert routable.tenant == "default"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"max_tokens": 0}, 0),
        ({"max_completion_tokens": 7}, 7),
        ({"max_completion_tokens": 7, "max_tokens": 3}, 7),
    ],
)
def test_max_tokens(extra: dict[str, Any], expected: int) -> None:
    assert parse(chat([msg("user", "hi")], **extra)).max_tokens == expected


def test_explicit_null_max_completion_tokens_falls_back_to_max_tokens() -> None:
    # SOURCE BUG (router/request_path/request.py parse_request):
    # get("max_completion_tokens", get("max_tokens"))
    # returns the explicit null instead of falling back to max_tokens.
    assert parse(chat([msg("user", "hi")], max_completion_tokens=None, max_tokens=5)).max_tokens == 5


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON", "a/b+json"]
)
def test_json_content_types_are_accepted(content_type: str) -> None:
    assert parse(chat([msg("user", "hi")]), headers={"Content-Type": content_type}).model == "llama"


def test_the_parsed_request_is_immutable() -> None:
    routable = parse(chat([msg("user", "hi")]))
    with pytest.raises(AttributeError):
        routable.model = "other"  # type: ignore[misc]


# --- chat flattening --------------------------------------------------------------------------


def test_swapping_roles_changes_the_prompt_where_joined_contents_would_not() -> None:
    one = [msg("user", "Is it safe?"), msg("assistant", "Yes.")]
    two = [msg("assistant", "Is it safe?"), msg("user", "Yes.")]
    joined = [b"".join(m["content"].encode() for m in conv) for conv in (one, two)]
    assert joined[0] == joined[1]  # contents alone cannot tell these apart ...
    assert prompt_of(one) != prompt_of(two)  # ... the flattened prompt does


def test_message_order_matters() -> None:
    assert prompt_of([msg("user", "a"), msg("user", "b")]) != prompt_of([msg("user", "b"), msg("user", "a")])


@pytest.mark.parametrize("other_role", ["system", "assistant", "tool", "developer"])
def test_role_alone_changes_the_prompt(other_role: str) -> None:
    assert prompt_of([msg("user", "x")]) != prompt_of([msg(other_role, "x")])


def test_message_boundaries_matter() -> None:
    assert prompt_of([msg("user", "ab")]) != prompt_of([msg("user", "a"), msg("user", "b")])


def test_a_longer_conversation_extends_the_shorter_ones_prompt() -> None:
    """Multi-turn locality: turn n+1's prompt starts with turn n's, so their chains share blocks."""
    turns = [
        msg("system", "You are terse."),
        msg("user", "Hi"),
        msg("assistant", "Hello"),
        msg("user", "Bye"),
    ]
    tools = [{"type": "function", "function": {"name": "f"}}]
    for n in range(1, len(turns)):
        assert prompt_of(turns[: n + 1]).startswith(prompt_of(turns[:n]))
        assert prompt_of(turns[: n + 1], tools=tools).startswith(prompt_of(turns[:n], tools=tools))


def test_single_text_part_equals_string_content() -> None:
    as_string = prompt_of([msg("user", "hello world")])
    as_parts = prompt_of([msg("user", [{"type": "text", "text": "hello world"}])])
    assert as_parts == as_string


def test_text_parts_keep_their_order() -> None:
    ab = prompt_of([msg("user", [{"type": "text", "text": "alpha"}, {"type": "text", "text": "beta"}])])
    ba = prompt_of([msg("user", [{"type": "text", "text": "beta"}, {"type": "text", "text": "alpha"}])])
    assert ab != ba
    assert ab.index(b"alpha") < ab.index(b"beta")


def test_null_content_is_accepted_and_tool_calls_are_part_of_the_prompt() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    other = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    base = [msg("user", "find it")]
    with_call = prompt_of([*base, {"role": "assistant", "content": None, "tool_calls": [call]}])
    with_other = prompt_of([*base, {"role": "assistant", "content": None, "tool_calls": [other]}])
    without = prompt_of([*base, {"role": "assistant", "content": None}])
    assert len({with_call, with_other, without}) == 3


def _image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def test_image_parts_are_part_of_the_key() -> None:
    def with_image(url: str) -> bytes:
        return prompt_of([msg("user", [{"type": "text", "text": "what is this?"}, _image(url)])])

    cat, dog = with_image("data:image/png;base64,Y2F0"), with_image("data:image/png;base64,ZG9n")
    assert cat != dog
    assert cat == with_image("data:image/png;base64,Y2F0")
    assert cat != prompt_of([msg("user", [{"type": "text", "text": "what is this?"}])])


def test_image_part_key_order_does_not_matter() -> None:
    a = {"type": "image_url", "image_url": {"url": "u", "detail": "low"}}
    b = {"image_url": {"detail": "low", "url": "u"}, "type": "image_url"}
    assert prompt_of([msg("user", [a])]) == prompt_of([msg("user", [b])])


def test_tools_change_the_prompt() -> None:
    messages = [msg("user", "weather?")]
    weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    time = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    plain, with_weather, with_time = (
        prompt_of(messages),
        prompt_of(messages, tools=weather),
        prompt_of(messages, tools=time),
    )
    assert len({plain, with_weather, with_time}) == 3


def test_tools_key_order_does_not_matter() -> None:
    messages = [msg("user", "weather?")]
    a = [{"type": "function", "function": {"name": "f", "description": "d"}}]
    b = [{"function": {"description": "d", "name": "f"}, "type": "function"}]
    assert prompt_of(messages, tools=a) == prompt_of(messages, tools=b)


# --- completions prompt forms -----------------------------------------------------------------


def test_string_prompt_is_its_utf8_bytes() -> None:
    assert completion_prompt("Once upon a time, 東京") == "Once upon a time, 東京".encode()


def test_list_of_strings() -> None:
    ab = completion_prompt(["first", "second"])
    assert ab != completion_prompt(["second", "first"])
    assert ab != completion_prompt("firstsecond")
    assert b"first" in ab and b"second" in ab


def test_token_ids() -> None:
    ids = completion_prompt([101, 2023, 2003])
    assert ids == completion_prompt([101, 2023, 2003])
    assert ids != completion_prompt([101, 2023, 2004])
    assert len(ids) > 0


def test_list_of_token_id_lists() -> None:
    nested = completion_prompt([[1, 2], [3]])
    assert nested != completion_prompt([[1], [2, 3]])
    assert nested != completion_prompt([[3], [1, 2]])
    assert nested == completion_prompt([[1, 2], [3]])


def test_completions_fields() -> None:
    routable = parse(
        {"model": "llama", "prompt": "hi", "stream": True, "max_tokens": 3, "user": "u1"},
        endpoint=COMPLETIONS,
    )
    assert (routable.endpoint, routable.stream, routable.max_tokens, routable.session_key) == (
        COMPLETIONS,
        True,
        3,
        "u1",
    )


# --- errors -----------------------------------------------------------------------------------

CHAT_OK = [msg("user", "hi")]


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        pytest.param(CHAT, b"{not json", None, id="invalid-json"),
        pytest.param(CHAT, b"", None, id="empty-body"),
        pytest.param(CHAT, b'{"model": "m", "messages": [}', None, id="truncated-json"),
        pytest.param(CHAT, b"[1, 2]", None, id="array-body"),
        pytest.param(CHAT, b'"text"', None, id="string-body"),
        pytest.param(CHAT, b"null", None, id="null-body"),
        pytest.param(CHAT, {"messages": CHAT_OK}, "model", id="missing-model"),
        pytest.param(CHAT, {"model": "", "messages": CHAT_OK}, "model", id="empty-model"),
        pytest.param(CHAT, {"model": 7, "messages": CHAT_OK}, "model", id="int-model"),
        pytest.param(CHAT, {"model": None, "messages": CHAT_OK}, "model", id="null-model"),
        pytest.param(CHAT, {"model": "m"}, "messages", id="missing-messages"),
        pytest.param(CHAT, {"model": "m", "messages": []}, "messages", id="empty-messages"),
        pytest.param(CHAT, {"model": "m", "messages": "hi"}, "messages", id="string-messages"),
        pytest.param(CHAT, {"model": "m", "messages": ["hi"]}, "messages[0]", id="message-not-object"),
        pytest.param(
            CHAT, {"model": "m", "messages": [*CHAT_OK, 5]}, "messages[1]", id="second-message-not-object"
        ),
        pytest.param(CHAT, {"model": "m", "messages": [{"content": "x"}]}, "messages[0].role", id="no-role"),
        pytest.param(CHAT, {"model": "m", "messages": [msg("", "x")]}, "messages[0].role", id="empty-role"),
        pytest.param(CHAT, {"model": "m", "messages": [msg(3, "x")]}, "messages[0].role", id="int-role"),
        pytest.param(
            CHAT, {"model": "m", "messages": [msg("user", 5)]}, "messages[0].content", id="int-content"
        ),
        pytest.param(
            CHAT,
            {"model": "m", "messages": [msg("user", {"a": 1})]},
            "messages[0].content",
            id="dict-content",
        ),
        pytest.param(
            CHAT,
            {"model": "m", "messages": [msg("user", ["x"])]},
            "messages[0].content[0]",
            id="content-part-not-object",
        ),
        pytest.param(CHAT, {"model": "m", "messages": CHAT_OK, "stream": "yes"}, "stream", id="stream-str"),
        pytest.param(CHAT, {"model": "m", "messages": CHAT_OK, "stream": 1}, "stream", id="stream-int"),
        pytest.param(CHAT, {"model": "m", "messages": CHAT_OK, "max_tokens": -1}, "max_tokens", id="mt-neg"),
        pytest.param(
            CHAT, {"model": "m", "messages": CHAT_OK, "max_tokens": True}, "max_tokens", id="mt-bool"
        ),
        pytest.param(CHAT, {"model": "m", "messages": CHAT_OK, "max_tokens": "5"}, "max_tokens", id="mt-str"),
        pytest.param(
            CHAT, {"model": "m", "messages": CHAT_OK, "max_tokens": 1.5}, "max_tokens", id="mt-float"
        ),
        pytest.param(COMPLETIONS, {"model": "m"}, "prompt", id="missing-prompt"),
        pytest.param(COMPLETIONS, {"model": "m", "prompt": None}, "prompt", id="null-prompt"),
        pytest.param(COMPLETIONS, {"model": "m", "prompt": 5}, "prompt", id="int-prompt"),
        pytest.param(COMPLETIONS, {"model": "m", "prompt": []}, "prompt", id="empty-list-prompt"),
        pytest.param(COMPLETIONS, {"model": "m", "prompt": ["a", 1]}, "prompt", id="mixed-prompt"),
        pytest.param(COMPLETIONS, {"model": "m", "prompt": [1, True]}, "prompt", id="bool-token"),
        pytest.param(COMPLETIONS, {"model": "m", "prompt": {"text": "a"}}, "prompt", id="dict-prompt"),
        pytest.param(COMPLETIONS, {"prompt": "hi"}, "model", id="completions-missing-model"),
    ],
)
def test_bad_requests_get_400_naming_the_param(endpoint: str, body: Any, param: str | None) -> None:
    error = expect_error(body, endpoint=endpoint)
    assert error.status == 400
    assert error.param == param
    assert error.message
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_bool_token_ids_in_nested_lists_are_rejected_like_flat_ones() -> None:
    # SOURCE BUG (router/request_path/request.py _completion_prompt): the list-of-lists branch checks
    # isinstance(t, int) without excluding bool, so [[1, true]] is accepted while [1, true] is not.
    error = expect_error({"model": "m", "prompt": [[1, True]]}, endpoint=COMPLETIONS)
    assert (error.status, error.param) == (400, "prompt")


def test_invalid_max_completion_tokens_is_reported_under_its_own_name() -> None:
    # SOURCE BUG (router/request_path/request.py parse_request): the error always says param='max_tokens'.
    error = expect_error(chat(CHAT_OK, max_completion_tokens=-1))
    assert (error.status, error.param) == (400, "max_completion_tokens")


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_non_json_content_type_gets_415(content_type: str) -> None:
    error = expect_error(chat(CHAT_OK), headers={"Content-Type": content_type})
    assert error.status == 415


def test_invalid_utf8_gets_400() -> None:
    body = b'{"model": "llama", "messages": [{"role": "user", "content": "caf\xe9 \xff"}]}'
    error = expect_error(body)
    assert error.status == 400


@pytest.mark.parametrize("depth", [5000, 100_000])
def test_deeply_nested_json_gets_400_not_a_crash(depth: int) -> None:
    error = expect_error(b"[" * depth + b"]" * depth)
    assert error.status == 400


def test_deeply_nested_message_content_gets_400() -> None:
    nested = b"[" * 5000 + b"]" * 5000
    error = expect_error(b'{"model": "m", "messages": [{"role": "user", "content": ' + nested + b"}]}")
    assert error.status == 400


def _nested_in_chat(where: str, depth: int) -> bytes:
    nested = b"[" * depth + b"]" * depth
    if where == "tools":
        return b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": ' + nested + b"}"
    if where == "tool_calls":
        return b'{"model": "m", "messages": [{"role": "assistant", "tool_calls": ' + nested + b"}]}"
    assert where == "content_part"
    part = b'{"type": "image_url", "image_url": ' + nested + b"}"
    return b'{"model": "m", "messages": [{"role": "user", "content": [' + part + b"]}]}"


@pytest.mark.parametrize("where", ["tools", "tool_calls", "content_part"])
def test_nesting_that_parses_but_cannot_be_re_serialised_gets_400(where: str) -> None:
    # SOURCE BUG (router/request_path/request.py _canonical): orjson.loads accepts 1024 levels but
    # orjson.dumps
    # stops at 255 and raises TypeError ("Recursion limit reached"), which escapes as a 500.
    error = expect_error(_nested_in_chat(where, 300))
    assert error.status == 400


# --- tenant and session -----------------------------------------------------------------------

KEY = "sk-test-0123456789abcdef"


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({"X-KVRoute-Tenant": "acme"}, id="from-the-trusted-header"),
        pytest.param(
            {"x-kvroute-tenant": "acme", "Authorization": f"Bearer {KEY}"}, id="wins-over-the-api-key"
        ),
    ],
)
def test_tenant_header(headers: dict[str, str]) -> None:
    assert parse(chat(CHAT_OK), headers=headers).tenant == "acme"


def test_tenant_from_a_configured_header_name() -> None:
    tenancy = TenancyConfig(header="x-org")
    assert parse(chat(CHAT_OK), headers={"x-org": "org1"}, tenancy=tenancy).tenant == "org1"
    assert parse(chat(CHAT_OK), headers={"x-kvroute-tenant": "acme"}, tenancy=tenancy).tenant == "default"


def test_tenant_from_the_bearer_key_is_a_hash_not_the_key() -> None:
    def tenant(key: str) -> str:
        return parse(chat(CHAT_OK), headers={"Authorization": f"Bearer {key}"}).tenant

    mine = tenant(KEY)
    assert KEY not in mine
    assert KEY[3:] not in mine
    assert mine not in ("", "default")
    assert tenant(KEY) == mine  # stable across requests
    assert tenant(KEY + "x") != mine  # and distinct per key


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer "},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"x-kvroute-tenant": ""},
    ],
)
def test_default_tenant(headers: dict[str, str]) -> None:
    assert parse(chat(CHAT_OK), headers=headers).tenant == "default"


def test_api_key_is_ignored_when_disabled() -> None:
    tenancy = TenancyConfig(from_api_key=False)
    headers = {"Authorization": f"Bearer {KEY}"}
    assert parse(chat(CHAT_OK), headers=headers, tenancy=tenancy).tenant == "default"


@pytest.mark.parametrize(
    ("headers", "user", "expected"),
    [
        ({"X-Session-Id": "s1"}, None, "s1"),
        ({}, "alice", "alice"),
        ({"x-session-id": "s1"}, "alice", "s1"),
        ({"x-session-id": ""}, "alice", "alice"),
        ({}, None, None),
        ({}, "", None),
        ({}, 42, None),
    ],
)
def test_session_key(headers: dict[str, str], user: Any, expected: str | None) -> None:
    body = chat(CHAT_OK) if user is None else chat(CHAT_OK, user=user)
    assert parse(body, headers=headers).session_key == expected


def test_a_message_that_extends_another_shares_its_leading_blocks():
    """A long document, then the same document with a question appended, must share blocks."""
    from router.index.keys import PrefixHasher, chain_seed
    from router.request_path.request import parse_request as parse

    tenancy = TenancyConfig()
    document = "Paragraph of a long document. " * 100
    short, long = (
        parse(
            "chat",
            orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}),
            {},
            tenancy,
            "x-session-id",
        )
        for text in (document, document + " Question: what does it say?")
    )
    hasher = PrefixHasher(256)
    seed = chain_seed("default", "m")
    a, b = hasher.chain(short.prompt, seed), hasher.chain(long.prompt, seed)
    assert len(a) >= 10
    assert b[: len(a)] == a


# --- the other endpoints (router/request_path/endpoints.py) ------------------------------------


def test_a_response_is_keyed_as_the_chat_it_renders_into() -> None:
    as_chat = prompt_of([msg("system", "be brief"), msg("user", "hello")])
    as_string = parse({"model": "llama", "instructions": "be brief", "input": "hello"}, endpoint=RESPONSES)
    items = [msg("user", [{"type": "input_text", "text": "hel"}, {"type": "input_text", "text": "lo"}])]
    as_items = parse({"model": "llama", "instructions": "be brief", "input": items}, endpoint=RESPONSES)
    assert as_string.prompt == as_items.prompt == as_chat
    capped = parse({"model": "llama", "input": "x", "max_output_tokens": 9}, endpoint=RESPONSES)
    assert capped.max_tokens == 9


def test_response_items_without_a_role_are_keyed_by_their_content() -> None:
    call = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    other = {**call, "output": "43"}
    first = parse({"model": "m", "input": [msg("user", "q"), call]}, endpoint=RESPONSES).prompt
    second = parse({"model": "m", "input": [msg("user", "q"), other]}, endpoint=RESPONSES).prompt
    assert first != second and first.startswith(second[:5])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"model": "m"}, "input", id="missing-input"),
        pytest.param({"model": "m", "input": []}, "input", id="empty-input"),
        pytest.param({"model": "m", "input": 5}, "input", id="int-input"),
        pytest.param({"model": "m", "input": ["x"]}, "input[0]", id="item-not-object"),
        pytest.param({"model": "m", "input": [{"content": "x"}]}, "input[0]", id="item-without-role-or-type"),
        pytest.param({"model": "m", "input": "x", "instructions": 3}, "instructions", id="int-instructions"),
        pytest.param(
            {"model": "m", "input": "x", "max_output_tokens": -1}, "max_output_tokens", id="neg-max"
        ),
    ],
)
def test_bad_responses_name_the_field(body: dict[str, Any], param: str) -> None:
    error = expect_error(body, endpoint=RESPONSES)
    assert (error.status, error.param) == (400, param)


def test_an_embedding_input_is_keyed_like_a_completion_prompt() -> None:
    for value in ("text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert parse({"model": "m", "input": value}, endpoint=EMBEDDINGS).prompt == completion_prompt(value)
    assert expect_error({"model": "m", "input": {"a": 1}}, endpoint=EMBEDDINGS).param == "input"


def test_load_balanced_endpoints_carry_no_prompt() -> None:
    routable = parse({"model": "m", "query": "q", "documents": ["d"]}, endpoint=RERANK)
    assert (routable.model, routable.prompt) == ("m", b"")


def test_a_forms_model_is_read_wherever_it_stands() -> None:
    def part(name: str, value: bytes, filename: str = "") -> bytes:
        extra = f'; filename="{filename}"' if filename else ""
        return (
            f'--b0undary\r\nContent-Disposition: form-data; name="{name}"{extra}\r\n\r\n'.encode()
            + value
            + b"\r\n"
        )

    # The audio holds bytes that look like a delimiter's start and a model field: only whole
    # delimiters end a part.
    audio = b'--b0und\r\nname="model"\r\n\r\nfake' * 100
    body = (
        part("file", audio, "a.wav")
        + part("stream", b"true")
        + part("model", b"whisper-1")
        + b"--b0undary--\r\n"
    )
    headers = {"Content-Type": 'multipart/form-data; boundary="b0undary"'}
    routable = parse(body, endpoint=TRANSCRIPTIONS, headers=headers)
    assert (routable.model, routable.stream, routable.prompt, routable.body) == ("whisper-1", True, b"", body)
    bad_stream = part("model", b"w") + part("stream", b"yes") + b"--b0undary--\r\n"
    assert expect_error(bad_stream, endpoint=TRANSCRIPTIONS, headers=headers).param == "stream"
