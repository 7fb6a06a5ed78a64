import pytest

from rcgrpo.models import load_policy, resolve_model_folder


@pytest.fixture(scope="session")
def model_dir():
    return resolve_model_folder(None)  # the embedded SmolLM2 (converted once, cached)


@pytest.fixture(scope="session")
def policy(model_dir):
    return load_policy(model_dir)


@pytest.fixture(scope="session")
def tokenizer(policy):
    return policy.tokenizer


def chat_record(tokenizer, user: str, reply: str, token: str | None, reward: float, entry_id="tiny"):
    """A short tagged conversation in the RCTP record layout."""
    from rcgrpo.data.rctp import Record
    from rcgrpo.prompts import ChatTokens, with_reward_goal

    chat = ChatTokens(tokenizer)
    messages = [{"role": "system", "content": "Answer with function calls."}]
    messages += with_reward_goal([{"role": "user", "content": user}], token)
    prompt = chat.prompt_ids(messages)
    reply_ids = list(tokenizer(reply, add_special_tokens=False)["input_ids"]) + [chat.eot_id]
    return Record(entry_id, "expert", reward, reward, reward, bool(reward), token,
                  prompt + reply_ids, [0] * len(prompt) + [1] * len(reply_ids), "completed")
