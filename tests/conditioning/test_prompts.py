"""prompts.py: system prompt, doc formats, reward tag, continuation ids."""
import json

import pytest

from rcgrpo.conditioning.prompts import (
    ChatTokens,
    format_docs,
    initial_messages,
    reward_tag,
    system_prompt,
    with_reward_goal,
)
from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.envs.bfcl import Episode


def test_reward_tag_goes_on_the_first_user_message_only():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    tagged = with_reward_goal(msgs, LOW_REWARD)
    assert tagged[1]["content"] == "a\n\n[Reward Goal: <|low_reward|>]"
    assert tagged[2]["content"] == "b" and msgs[1]["content"] == "a"  # input untouched
    assert with_reward_goal(msgs, None) == msgs
    assert reward_tag(HIGH_REWARD) == "\n\n[Reward Goal: <|high_reward|>]"
    with pytest.raises(ValueError):
        reward_tag("<|medium_reward|>")


def test_doc_styles(entries, tokenizer):
    docs = Episode(entries[0]).visible_function_docs()
    compact, lean = format_docs(docs, "compact"), format_docs(docs, "compact_no_response")
    assert json.loads(compact) == docs and "\n" not in compact
    assert all("response" not in d for d in json.loads(lean))
    sizes = {s: len(tokenizer(system_prompt(docs, s))["input_ids"]) for s in ("compact", "compact_no_response", "official")}
    assert sizes["compact_no_response"] < sizes["compact"] < sizes["official"]
    from bfcl_eval.constants.default_prompts import PROMPT_STYLE_TEMPLATES

    official = system_prompt(docs, "official")
    assert official.startswith(PROMPT_STYLE_TEMPLATES["classic"]["persona"])
    assert json.dumps(docs, indent=4) in official


def test_initial_messages_and_chatml_prompt(entries, tokenizer):
    ep = Episode(next(e for e in entries if e.category == "miss_func"))
    msgs = initial_messages(ep, HIGH_REWARD)
    assert [m["role"] for m in msgs][:2] == ["system", "user"]
    hidden = {n for names in ep.entry.missed_function.values() for n in names}
    assert not any(f'"name":"{n}"' in msgs[0]["content"] for n in hidden)  # held out until revealed
    ids = ChatTokens(tokenizer).prompt_ids(msgs)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert len(ids) < 8192


def test_continuation_closes_a_cut_reply(tokenizer):
    chat = ChatTokens(tokenizer)
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
               {"role": "assistant", "content": "[ls()]"}]
    new = [{"role": "tool", "name": "ls()", "content": "{}"}]
    closed = chat.continuation_ids(history, new, reply_closed=True)
    assert tokenizer.decode(closed) == "\n<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"
    cut = chat.continuation_ids(history, new, reply_closed=False)
    assert cut == [tokenizer.eos_token_id] + closed
    with pytest.raises(ValueError):
        chat.continuation_ids(history[:2], new, reply_closed=True)
