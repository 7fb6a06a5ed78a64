"""Tool-call formats (rcgrpo/envs/tool_calls.py) on real chat templates: the
embedded SmolLM2's (no tools: the json_tags fallback) and the Qwen2.5 and
Llama-3.1 templates TRL ships (trl/chat_templates), on the same vocabulary,
with transformers' own response parser set as TRL sets it."""
import copy
import json
from pathlib import Path

import pytest

from rcgrpo.envs.tool_calls import (
    CALL_OPEN,
    JsonTagsFormat,
    TemplateFormat,
    ToolCall,
    parse_tagged,
    template_supports_tools,
    tool_call_format,
)
from tests.required import require

ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALLS = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 10, "b": -4})]


def _trl_template(name: str) -> str:
    trl = require("trl", "trl")
    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def qwen(tokenizer):
    """SmolLM2's vocabulary (ChatML tokens, as Qwen's) under Qwen2.5's template."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = _trl_template("qwen2_5")
    return tok


@pytest.fixture(scope="module")
def qwen_parsing(qwen):
    """The same, with transformers' response parser set for it (TRL's add_response_schema)."""
    from trl.chat_template_utils import add_response_schema

    tok = copy.deepcopy(qwen)
    add_response_schema(tok)
    assert tok.response_template is not None
    return tok


@pytest.fixture(scope="module")
def llama(tokenizer):
    """Llama-3.1's template and control tokens, parser set as TRL sets it."""
    from trl.chat_template_utils import add_response_schema

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>",
        "<|eom_id|>"]})
    tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tok.chat_template = _trl_template("llama3_1")
    add_response_schema(tok)
    return tok


def test_which_templates_render_tools(tokenizer, qwen, llama):
    assert not template_supports_tools(tokenizer)  # SmolLM2's ChatML template has no tools
    assert template_supports_tools(qwen) and template_supports_tools(llama)
    assert isinstance(tool_call_format("auto", tokenizer), JsonTagsFormat)
    assert isinstance(tool_call_format("auto", qwen), TemplateFormat)
    with pytest.raises(ValueError, match="does not render tool calls"):
        tool_call_format("template", tokenizer)


def _round_trip(fmt, tok, calls, content=""):
    """The calls written as the format writes them, sampled as ids, read back."""
    text = fmt.reply_text(content, calls)
    reply_ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    prefix = tok(tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[ADD], tokenize=False,
                                         add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    decoded = tok.decode(reply_ids, skip_special_tokens=True)
    return text, fmt.parse(decoded, reply_ids, prefix, [ADD])


@pytest.mark.parametrize("which", ["smollm2-json_tags", "qwen2.5-parser", "qwen2.5-tags", "llama3.1-parser"])
def test_calls_round_trip_through_each_format(which, tokenizer, qwen, qwen_parsing, llama):
    fmt, tok = {
        "smollm2-json_tags": (JsonTagsFormat(tokenizer), tokenizer),
        "qwen2.5-parser": (TemplateFormat(qwen_parsing), qwen_parsing),
        "qwen2.5-tags": (TemplateFormat(qwen), qwen),
        "llama3.1-parser": (TemplateFormat(llama), llama),
    }[which]
    calls = CALLS[:1] if which.startswith("llama") else CALLS  # Llama-3.1's template takes one call per reply
    text, parsed = _round_trip(fmt, tok, calls)
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [(c.name, c.arguments, None) for c in calls]
    if which.startswith("qwen"):  # the template's own rendering of a call: Qwen's tags, one block per call
        assert text.count(CALL_OPEN) == 2 and '"name": "add"' in text


def test_the_template_renders_the_tools_into_the_prompt(qwen, tokenizer):
    fmt = TemplateFormat(qwen)
    prompt = qwen.apply_chat_template([{"role": "user", "content": "hi"}], tools=fmt.template_tools([ADD]),
                                      tokenize=False, add_generation_prompt=True)
    assert "<tools>" in prompt and '"name": "add"' in prompt
    fallback = JsonTagsFormat(tokenizer).system_prompt([ADD])
    assert json.dumps(ADD, separators=(",", ":")) in fallback and CALL_OPEN in fallback


@pytest.mark.parametrize("text,error", [
    ("<tool_call>{not json</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "needs a \"name\""),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>["add"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": "{bad"}</tool_call>', "not valid JSON"),
])
def test_a_malformed_call_is_kept_with_its_reason(text, error):
    (call,) = parse_tagged(text).calls
    assert error in call.error


def test_text_is_never_evaluated(qwen_parsing):
    # Python that a parser with eval would run: here it is only a string that fails to parse.
    text = '<tool_call>{"name": __import__("os").system("false"), "arguments": {}}</tool_call>'
    (call,) = parse_tagged(text).calls
    assert call.error is not None
    ids = qwen_parsing(text, add_special_tokens=False)["input_ids"]
    (call,) = TemplateFormat(qwen_parsing).parse(text, ids, [], [ADD]).calls
    assert call.error is not None


def test_plain_text_and_a_cut_reply():
    parsed = parse_tagged("The answer is 5.")
    assert parsed.calls == [] and parsed.content == "The answer is 5."
    # A reply cut mid-call (the token budget) still reads as a call, and a broken one.
    (call,) = parse_tagged('ok <tool_call>{"name": "add", "arguments": {"a": 1').calls
    assert call.error is not None
