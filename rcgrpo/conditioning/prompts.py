"""Chat rendering of a BFCL episode: system prompt with function docs, reward tag,
and the token ids of exactly the messages added between two model replies.

The structure follows BFCL's default prompting mode (bfcl_eval
constants/default_prompts.py, DEFAULT_SYSTEM_PROMPT_FORMAT = python call
format, no tool-call tag, JSON docs, plaintext, "classic" style): a system
prompt that asks for `[f(a=1), g(b=2)]` and lists the docs; user turns; tool
results as `tool` messages. The default wording below is ours and the docs are
compact JSON, because `json.dumps(indent=4)` docs alone take 3.9k-8.9k tokens
of SmolLM2's 8,192. `doc_style="official"` builds BFCL's own prompt from
bfcl_eval's constants instead.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Sequence

from rcgrpo.conditioning.reward_tokens import REWARD_TOKENS

DOC_STYLES = ("compact", "compact_no_response", "official")

# Our paraphrase of BFCL's default system prompt: same instructions (python
# list of keyword calls, say so when nothing fits or a parameter is missing,
# keep calling until the turn's task is done), fewer words.
SYSTEM_PROMPT = (
    "You are an expert in composing function calls. For each user request, decide which of the "
    "functions below to call. Answer with the calls only, as a Python list in the form "
    "[func_name1(param1=value1, param2=value2), func_name2(param=value)], and no other text. "
    "If no function fits the request, or the request lacks a required parameter, say so in plain "
    "words instead.\n\n"
    "A turn may take several replies: after each list of calls you receive their results. Keep "
    "calling functions until the user's request for this turn is fulfilled; a reply with no call "
    "ends the turn.\n\n"
    "Available functions, in JSON format:\n{functions}\n"
)


def reward_tag(reward_token: str) -> str:
    """The tag RC-GRPO appends to the first user message (the paper, arXiv 2602.03025)."""
    if reward_token not in REWARD_TOKENS:
        raise ValueError(f"not a reward token: {reward_token!r}")
    return f"\n\n[Reward Goal: {reward_token}]"


def format_docs(docs: Sequence[dict[str, Any]], style: str = "compact") -> str:
    if style == "compact":
        return json.dumps(list(docs), separators=(",", ":"), ensure_ascii=False)
    if style == "compact_no_response":
        # The response schema helps a model read results but costs ~1/3 of
        # the prompt; dropping it fits every entry under ~4.2k tokens.
        stripped = [{k: v for k, v in d.items() if k != "response"} for d in docs]
        return json.dumps(stripped, separators=(",", ":"), ensure_ascii=False)
    if style == "official":
        return json.dumps(list(docs), indent=4)  # BFCL's format_function_doc, "json"
    raise ValueError(f"doc style {style!r}: one of {DOC_STYLES}")


def official_system_prompt(docs: Sequence[dict[str, Any]]) -> str:
    """BFCL's default system prompt, assembled from bfcl_eval's own constants.

    bfcl_eval's formulate_system_prompt lives in a module that imports
    tree_sitter; the constants module does not, so the same template is
    filled here from the same pieces.
    """
    from rcgrpo.envs import _bfcl  # noqa: F401  (points bfcl_eval at a scratch folder)

    # isort: split
    from bfcl_eval.constants.default_prompts import (
        OUTPUT_FORMAT_MAPPING,
        PARAM_TYPE_MAPPING,
        PROMPT_STYLE_TEMPLATES,
        PROMPT_TEMPLATE_MAPPING,
    )

    style = PROMPT_STYLE_TEMPLATES["classic"]
    return PROMPT_TEMPLATE_MAPPING["plaintext"].format(
        persona=style["persona"],
        task=style["task"],
        tool_call_format=style["tool_call_no_tag"].format(
            output_format=OUTPUT_FORMAT_MAPPING["python"], param_types=PARAM_TYPE_MAPPING["python"]
        ),
        multiturn_behavior=style["multiturn_behavior"],
        available_tools=style["available_tools"].format(format="json", functions=format_docs(docs, "official")),
    )


def system_prompt(docs: Sequence[dict[str, Any]], style: str = "compact") -> str:
    if style == "official":
        return official_system_prompt(docs)
    return SYSTEM_PROMPT.format(functions=format_docs(docs, style))


# The key of a message that carries the reward tag: where the conditioning
# put it, and so the only place its special token may be encoded as one.
REWARD_GOAL_KEY = "reward_goal"


def with_reward_goal(messages: list[dict[str, str]], reward_token: str | None) -> list[dict[str, str]]:
    """A copy of `messages` with the reward tag on the first user message
    (which also records the token under REWARD_GOAL_KEY; templates ignore it)."""
    messages = copy.deepcopy(messages)
    if reward_token is None:
        return messages
    for m in messages:
        if m["role"] == "user":
            m["content"] += reward_tag(reward_token)
            m[REWARD_GOAL_KEY] = reward_token
            return messages
    raise ValueError("no user message to carry the reward goal")


def initial_messages(episode, reward_token: str | None = None, doc_style: str = "compact") -> list[dict[str, str]]:
    """System prompt + the user message(s) of the episode's first turn. An
    environment under the TRL contract writes its own opening
    (`opening_messages`, rcgrpo.envs.tool_env); BFCL's is built here."""
    own = getattr(episode, "opening_messages", None)
    if own is not None:
        return with_reward_goal(own(), reward_token)
    docs_of = getattr(episode, "initial_function_docs", None) or episode.visible_function_docs
    system = {"role": "system", "content": system_prompt(docs_of(), doc_style)}
    return [system] + with_reward_goal(episode.turn_messages(), reward_token)


def _text(tokenizer, messages, add_generation_prompt: bool, tools: Sequence[dict] | None = None) -> str:
    if tools:  # only then: a template that takes no tools must render exactly as before
        return tokenizer.apply_chat_template(list(messages), tools=list(tools), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def _encode(tokenizer, text: str) -> list[int]:
    """Ids of text the chat template wrote: its special tokens are real ones.
    (The template writes every special token it wants, BOS included; the
    tokenizer must not add its own.)"""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode_plain(tokenizer, text: str) -> list[int]:
    """Ids of text that did not come from the template (tool results, user
    and system text, docs): `<|im_end|>` written there is seven characters,
    never the control token, so no tool output can forge chat structure."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _encode_content(tokenizer, message: dict[str, str]) -> list[int]:
    """A message's content as plain text, except the reward tag that
    `with_reward_goal` put on it, whose token is the real special token."""
    content = message["content"]
    token = message.get(REWARD_GOAL_KEY)
    if token is None:
        return _encode_plain(tokenizer, content)
    tag = reward_tag(token)
    if not content.endswith(tag):
        raise ValueError(f"a message marked with {token} does not end with its reward tag")
    before, after = tag.split(token)
    return (_encode_plain(tokenizer, content[: -len(tag)] + before)
            + [tokenizer.convert_tokens_to_ids(token)] + _encode_plain(tokenizer, after))


def _sentinel(i: int) -> str:
    # Private-use code points: text the template passes through untouched
    # and no BFCL content contains.
    return f"\ue000rcgrpo-content-{i}\ue001"


def _render_ids(tokenizer, messages: Sequence[dict[str, str]], first_new: int, add_generation_prompt: bool,
                before: str = "", lead: str = "", tools: Sequence[dict] | None = None) -> list[int]:
    """Ids of `lead` + the template's rendering of `messages` after the text
    `before` (the rendering of messages[:first_new]): template text encoded
    with its special tokens, each message's content from first_new on plain.

    The content is swapped for a sentinel, the template rendered, and the
    rendering cut at the sentinels; a template that does not insert content
    verbatim (trims, escapes, rewrites it) is refused rather than guessed at.
    """
    masked = [dict(m) for m in messages]
    for i in range(first_new, len(masked)):
        masked[i]["content"] = _sentinel(i)
    text = _text(tokenizer, masked, add_generation_prompt, tools)
    if not text.startswith(before):
        raise ValueError(
            "this chat template re-renders earlier messages when new ones are added; "
            "incremental token ids would drift from the full rendering"
        )
    template_text, pos = [], len(before)  # template_text[i] precedes new message i's content
    for i in range(first_new, len(messages)):
        at = text.find(_sentinel(i), pos)
        if at < 0 or text.count(_sentinel(i)) != 1:
            raise ValueError("this chat template does not insert message content verbatim; its ids cannot be built")
        template_text.append(text[pos:at])
        pos = at + len(_sentinel(i))
    template_text.append(text[pos:])
    new = messages[first_new:]
    if before + "".join(t + m["content"] for t, m in zip(template_text, new)) + template_text[-1] != _text(
        tokenizer, messages, add_generation_prompt, tools
    ):
        raise ValueError("this chat template does not insert message content verbatim; its ids cannot be built")
    ids = _encode(tokenizer, lead + template_text[0])
    for m, following in zip(new, template_text[1:]):
        ids += _encode_content(tokenizer, m) + _encode(tokenizer, following)
    return ids


class ChatTokens:
    """Token ids of a conversation's pieces, rendered by the model's chat template
    (with `tools`, the JSON schemas a template that renders tools itself gets)."""

    def __init__(self, tokenizer, tools: Sequence[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.eot_id = tokenizer.eos_token_id  # the template's end-of-message token
        self.eot_text = tokenizer.convert_ids_to_tokens(self.eot_id)

    def prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The opening prompt, ending where the assistant starts to write.
        Special tokens come only from the template and the reward tag."""
        return _render_ids(self.tokenizer, messages, 0, add_generation_prompt=True, tools=self.tools)

    def decode_reply(self, sampled_ids: Sequence[int]) -> str:
        """The assistant text the environment sees (special tokens dropped)."""
        return self.tokenizer.decode(list(sampled_ids), skip_special_tokens=True)

    def continuation_ids(
        self,
        history: Sequence[dict[str, str]],
        new_messages: Sequence[dict[str, str]],
        reply_closed: bool,
    ) -> list[int]:
        """Ids to append after the model's last reply so the model sees `new_messages`
        and is prompted to answer again.

        `history` ends with that reply as an assistant message. The template
        renders history + new messages; the part after the rendering of history
        alone is what is new. To it we prepend the template's glue after the
        assistant's end-of-message token (ChatML: a newline), and that token
        itself when the reply was cut before the model wrote it.
        """
        if not history or history[-1]["role"] != "assistant":
            raise ValueError("history must end with the assistant reply")
        before = _text(self.tokenizer, history, add_generation_prompt=False, tools=self.tools)
        end = before.rfind(self.eot_text)
        if end < 0:
            raise ValueError(f"the chat template does not close assistant messages with {self.eot_text!r}")
        glue = before[end + len(self.eot_text) :]
        prefix = glue if reply_closed else self.eot_text + glue
        # New messages' content (tool results, the next user turn) is plain text.
        return _render_ids(self.tokenizer, list(history) + list(new_messages), len(history),
                           add_generation_prompt=True, before=before, lead=prefix, tools=self.tools)
