"""How a model writes tool calls, and how its replies are read back: the
tool-call formats of an environment under the TRL contract (BFCL keeps its own
Python-call prompting, rcgrpo.envs.calls).

* ``template``: the chat template renders the tools itself
  (``apply_chat_template(..., tools=...)``, Qwen2.5 / Llama-3.1 style).
  Replies are parsed by transformers' own parser (``tokenizer.parse_response``)
  where the tokenizer defines one (a ``response_template``); otherwise by the
  ``<tool_call>{json}</tool_call>`` convention the Qwen and Hermes templates
  use. An expert's reply is written by the template itself: the rendering of
  an assistant message with ``tool_calls``.
* ``json_tags``, the one fallback for a template without tools (the embedded
  SmolLM2's): the tools' JSON schemas go into a system prompt that asks for
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` replies.

``auto`` picks ``template`` when the template renders a whole tool exchange
(the call's name and arguments and the tool result all appear), else
``json_tags``. Model text is parsed as JSON, never evaluated; a call that
cannot be read is kept as a `ToolCall` with its `error`, so that the episode
can feed the reason back instead of running anything.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

TOOL_FORMATS = ("auto", "template", "json_tags")

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_TAGGED = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)

# The fallback's system prompt. Plain words, the same tags as Qwen's and
# Hermes' templates, so that a model tuned on either reads it naturally.
FALLBACK_SYSTEM_PROMPT = (
    "You can call tools to solve the user's task. To call a tool, reply with one or more blocks of the form\n"
    '<tool_call>{{"name": "tool_name", "arguments": {{"param": value}}}}</tool_call>\n'
    "and nothing else; each call's result comes back to you in a tool message. When the task is done, reply "
    "without a tool call.\n\nTools (JSON schemas):\n{tools}"
)


@dataclass
class ToolCall:
    """One call as the model wrote it. `error` says why it cannot run (the
    text did not parse, the name or arguments are missing or of the wrong
    kind); such a call is never executed."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def message(self) -> dict:
        """TRL's conversational form of the call (an assistant message's `tool_calls` item)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    content: str  # the reply's text outside the calls
    calls: list[ToolCall]


def read_call(obj: Any) -> ToolCall:
    """A ToolCall from a decoded JSON object, a parser's dict or a reference's `tool_calls` item: {"name", "arguments"}
    (OpenAI's {"function": {...}} nesting and Llama's "parameters" accepted)."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict):
        return ToolCall("?", error=f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            return ToolCall(str(name), error=f"arguments are not valid JSON: {exc}")
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or not name:
        return ToolCall("?", error="a tool call needs a \"name\" string")
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f"\"arguments\" must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, dict(arguments))


def parse_tagged(text: str) -> ParsedReply:
    """`<tool_call>{json}</tool_call>` blocks (an unclosed last block too: the
    reply may have been cut); the text outside them is the content."""
    calls = []
    for match in _TAGGED.finditer(text):
        body = match.group(1).strip()
        try:
            calls.append(read_call(json.loads(body)))
        except ValueError as exc:
            calls.append(ToolCall("?", error=f"the tool call is not valid JSON ({exc}): {body[:200]!r}"))
    return ParsedReply(_TAGGED.sub("", text).strip(), calls)


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template renders a whole tool exchange: the tools
    passed in, an assistant call's name and arguments, and a tool result all
    appear in its text (a template that drops any of them cannot carry
    tool calling)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    name, key, value, result = "rcgrpo_probe_tool", "rcgrpo_probe_key", "rcgrpo_probe_value", "rcgrpo_probe_result"
    schema = {"type": "function", "function": {"name": name, "description": "probe", "parameters": {
        "type": "object", "properties": {key: {"type": "string"}}, "required": [key]}}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [ToolCall(name, {key: value}).message()]},
                {"role": "tool", "name": name, "content": result}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False)
    except Exception:  # a template that refuses the roles or the tools
        return False
    return all(s in text for s in (name, key, value, result)) and text.count(name) >= 2


class ToolCallFormat:
    """How the tools reach the prompt, how replies are read, and how a
    reference call is written as the model would write it."""

    name = ""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def system_prompt(self, schemas: Sequence[dict]) -> str | None:
        """A system message to open the conversation with, if the format needs one."""
        return None

    def template_tools(self, schemas: Sequence[dict]) -> list[dict] | None:
        """What `apply_chat_template(tools=...)` gets (None: nothing)."""
        return None

    def parse(self, text: str, reply_ids: Sequence[int] | None = None, prefix_ids: Sequence[int] | None = None,
              schemas: Sequence[dict] | None = None) -> ParsedReply:
        return parse_tagged(text)

    def reply_text(self, content: str, calls: Sequence[ToolCall]) -> str:
        """The text of an assistant reply making `calls` (after `content`)."""
        blocks = [CALL_OPEN + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False) + CALL_CLOSE
                  for c in calls]
        return "\n".join(([content] if content else []) + blocks)


class JsonTagsFormat(ToolCallFormat):
    """The fallback: schemas in the system prompt, `<tool_call>` JSON replies."""

    name = "json_tags"

    def system_prompt(self, schemas: Sequence[dict]) -> str | None:
        tools = "\n".join(json.dumps(s, separators=(",", ":"), ensure_ascii=False) for s in schemas)
        return FALLBACK_SYSTEM_PROMPT.format(tools=tools)


class TemplateFormat(ToolCallFormat):
    """The chat template's own tool calling."""

    name = "template"

    def template_tools(self, schemas: Sequence[dict]) -> list[dict] | None:
        return list(schemas)

    def parse(self, text: str, reply_ids: Sequence[int] | None = None, prefix_ids: Sequence[int] | None = None,
              schemas: Sequence[dict] | None = None) -> ParsedReply:
        if getattr(self.tokenizer, "response_template", None) is not None and reply_ids is not None:
            try:
                parsed = self.tokenizer.parse_response(list(reply_ids), prefix=list(prefix_ids or []),
                                                       tools=list(schemas or []) or None)
            except Exception:  # transformers' parser refuses malformed calls; read them ourselves to say why
                parsed = None
            if isinstance(parsed, dict):
                calls = [read_call(c) for c in parsed.get("tool_calls") or []]
                content = parsed.get("content") or ""
                # The parser's reading stands unless it missed calls the text plainly opens.
                if calls or CALL_OPEN not in text:
                    return ParsedReply(str(content).strip(), calls)
        return parse_tagged(text)

    def reply_text(self, content: str, calls: Sequence[ToolCall]) -> str:
        """The template's rendering of an assistant message with these calls,
        cut from the text of the conversation before it and its end of message."""
        tok = self.tokenizer
        user = [{"role": "user", "content": "x"}]
        before = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.message() for c in calls]
        full = tok.apply_chat_template(user + [message], tokenize=False)
        if not full.startswith(before):
            return super().reply_text(content, calls)
        reply = full[len(before):]
        end = reply.rfind(tok.eos_token) if tok.eos_token else -1
        return reply[:end] if end >= 0 else reply


def tool_call_format(name: str, tokenizer) -> ToolCallFormat:
    """The format `name` (one of TOOL_FORMATS) for `tokenizer`'s chat template."""
    if name not in TOOL_FORMATS:
        raise ValueError(f"tool format {name!r}: one of {TOOL_FORMATS}")
    if name == "auto":
        name = "template" if template_supports_tools(tokenizer) else "json_tags"
    if name == "template" and not template_supports_tools(tokenizer):
        raise ValueError("env.tool_format template: this tokenizer's chat template does not render tool calls "
                         "(use json_tags, the documented fallback)")
    return TemplateFormat(tokenizer) if name == "template" else JsonTagsFormat(tokenizer)
