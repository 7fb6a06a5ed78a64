"""Helpers shared by the training tests and others (imported as
`tests.training.conftest`); the fixtures are in tests/conftest.py."""


def chat_record(tokenizer, user: str, reply: str, token: str | None, reward: float, entry_id="tiny"):
    """A short tagged conversation in the RCTP record layout."""
    from rcgrpo.conditioning.prompts import ChatTokens, with_reward_goal
    from rcgrpo.data.rctp import Record

    chat = ChatTokens(tokenizer)
    messages = [{"role": "system", "content": "Answer with function calls."}]
    messages += with_reward_goal([{"role": "user", "content": user}], token)
    prompt = chat.prompt_ids(messages)
    reply_ids = list(tokenizer(reply, add_special_tokens=False)["input_ids"]) + [chat.eot_id]
    return Record(entry_id, "expert", reward, reward, reward, bool(reward), token,
                  prompt + reply_ids, [0] * len(prompt) + [1] * len(reply_ids), "completed")


def save_tiny_llama(folder, tokenizer, seed: int = 0):
    """A tiny random Llama (2 layers, hidden 64, tied) with the real
    token-extended tokenizer, saved as a model folder: the trainer's
    mechanics on real BFCL token ids, at a fraction of the 135M model's cost."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
