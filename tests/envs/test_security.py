"""Model output is untrusted: nothing it writes may run except whitelisted
methods with literal arguments."""
import ast
import os
import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rcgrpo.envs.bfcl import Episode
from rcgrpo.envs.calls import MAX_INT_BITS, Call, DecodeError, decode_calls
from tests.hostile import HOSTILE

SAFE_NAMES = {"ls": print, "cd": print, "mkdir": print}

FRAGMENTS = st.sampled_from([
    "[", "]", "(", ")", ",", "=", "'", '"', "ls", "cd", "mkdir", "a", "folder", "x", "1", "-", "2.5",
    "True", "None", "__import__", "os", ".", "system", "lambda", ":", "for", "in", "{", "}", "**", "*",
    "10**10**10", "```", "\n", " ", "#", "\\", "f'", "[0]", "yield", "await", "not", "+", "b'x'", "1j",
    "...", "@", ";", "if", "else",
])


def assert_only_literals(calls):
    for call in calls:
        assert isinstance(call, Call)
        if call.rejected is None:
            assert call.name in SAFE_NAMES
            text = call.canonical()
            node = ast.parse(text, mode="eval").body
            assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
            for kw in node.keywords:
                ast.literal_eval(kw.value)  # only literals survive


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_random_text_never_escapes(text):
    try:
        assert_only_literals(decode_calls(text, SAFE_NAMES))
    except DecodeError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.lists(FRAGMENTS, max_size=30).map("".join))
def test_hostile_fragment_soup_never_escapes(text):
    try:
        assert_only_literals(decode_calls(text, SAFE_NAMES))
    except DecodeError:
        pass


def test_hostile_calls_create_nothing_and_are_reported(by_id, tmp_path):
    entry = by_id["multi_turn_base_0"]
    for template in HOSTILE:
        target = tmp_path / f"pwned_{uuid.uuid4().hex}"
        text = "[" + template.format(p=target) + "]"
        ep = Episode(entry)
        step = ep.step(text)
        if step.calls:
            assert step.decode_error, text
            assert all(m["content"].startswith("Error during execution") for m in step.tool_messages)
        else:
            assert step.turn_ended and step.decode_error, text
        ep.result()  # the official checker runs on what was recorded
        assert not target.exists(), text
    assert not any(p.name.startswith("pwned_") for p in tmp_path.iterdir())
    assert not os.path.exists("pwned")


def test_huge_literals_are_rejected_not_built():
    for text in [
        f"ls(a={2 ** (MAX_INT_BITS + 1)})",
        "ls(a=1e999)",
        "ls(a=" + "[" * 50 + "]" * 50 + ")",
        "ls(a='" + "x" * 200_001 + "')",
        "ls(a=[" + "1," * 20_000 + "])",
        "ls(a=10**10**10)",
        "ls(a='x'*10**9)",
    ]:
        try:
            calls = decode_calls(text, SAFE_NAMES)
        except DecodeError:
            continue
        assert calls[0].rejected, text[:60]


def test_official_decoder_normalisation_is_kept():
    # backticks/newlines stripped, a bare call wrapped in brackets, names as strings
    (call,) = decode_calls("```\nls(a=True)\n```", SAFE_NAMES)
    assert call == Call("ls", {"a": True})
    (call,) = decode_calls("cd(folder=documents)", SAFE_NAMES)
    assert call.kwargs == {"folder": "documents"}
    assert decode_calls("[]", SAFE_NAMES) == []
    for not_calls in ["I cannot do that.", "[1, 2]", "```python\n[ls()]\n```"]:
        try:
            decode_calls(not_calls, SAFE_NAMES)
        except DecodeError:
            continue
        raise AssertionError(not_calls)
