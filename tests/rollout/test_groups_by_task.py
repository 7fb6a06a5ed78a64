"""RC-GRPO's rollouts of one task form one group whatever their reward tags.

The tag is on the prompt, so grouping by prompt tokens would split a task's
rollouts by tag (with a tag drawn per rollout, every prompt can differ: each
rollout its own zero-advantage group, NeMo-RL #4013). The agent loop groups
by the task's position in the call and the packed batch carries that group:
here a policy that succeeds exactly under the high tag gets advantages of
+-1 under RC-GRPO's grouping, and nothing at all under prompt grouping."""
import random

import torch

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, DrawPerRollout
from rcgrpo.data.expert import ScriptedEngine
from rcgrpo.envs.tasks import load_tasks
from rcgrpo.envs.tool_env import ToolEnvironment
from rcgrpo.model.packing import pack
from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes
from rcgrpo.training.rl_update import to_trajectories
from rcgrpo_kernels import group_advantages


class Answer:
    def reset(self, answer=0, **row):
        self.answer, self.given = answer, None

    def submit(self, value: int) -> str:
        """Submit the answer.

        Args:
            value: the answer
        """
        self.given = value
        return "submitted"

    def get_reward(self) -> float:
        return float(self.given == self.answer)


class TagFollower:
    """An engine that answers right exactly when the prompt carries the high tag."""

    name, supports_sleep = "scripted", False

    def __init__(self, tokenizer):
        self.tokenizer, self.high = tokenizer, tokenizer.convert_tokens_to_ids(HIGH_REWARD)

    def generate(self, prompts, sampling):
        out = []
        for prompt, s in zip(prompts, sampling):
            answered = self.tokenizer.decode(prompt).count("submitted")
            answer = self.tokenizer.decode(prompt).split("Answer key: ")[1].split("\n")[0]
            value = int(answer) if self.high in prompt else -1
            reply = f'<tool_call>{{"name": "submit", "arguments": {{"value": {value}}}}}</tool_call>'
            out.append(ScriptedEngine(self.tokenizer, ["done" if answered else reply]).generate([prompt], [s])[0])
        return out


def test_rollouts_group_by_task_not_by_prompt(tokenizer):
    env = ToolEnvironment(environment_factory=Answer).bind(tokenizer)
    tasks = load_tasks([{"prompt": f"Answer key: {a}\nSubmit it.", "answer": a, "id": f"task-{a}"} for a in (3, 7)],
                       env, "train_dataset")
    G = 6
    rollouts = run_episodes(TagFollower(tokenizer), tokenizer, tasks, group_size=G,
                            config=RolloutConfig(progress=False, seed=1), reward_tokens=DrawPerRollout(0.5))
    tags = [r.reward_token for r in rollouts]
    assert all(r.reward == float(r.reward_token == HIGH_REWARD) for r in rollouts)
    for g in range(2):  # the seed draws both tags inside each task's group
        assert len({tags[g * G + k] for k in range(G)}) == 2

    batch = pack(to_trajectories(rollouts))
    assert batch.seq_group.tolist() == [0] * G + [1] * G  # one group per task, whatever the tags
    by_task = group_advantages(batch.rewards, batch.seq_group)
    assert torch.all(by_task.abs() > 0.5)  # every rollout carries signal

    # Grouped by prompt tokens instead, each group holds one tag, so one reward: no signal at all.
    prompts = [tuple(r.token_ids[:r.prompt_len]) for r in rollouts]
    assert len(set(prompts)) == 4
    by_prompt = torch.tensor([sorted(set(prompts)).index(p) for p in prompts])
    assert torch.all(group_advantages(batch.rewards, by_prompt) == 0)


def test_a_task_drawn_twice_in_a_step_is_two_groups(tokenizer):
    # Groups are positions in the step's batch (rcgrpo.training.rl_loop.prompt_schedule can repeat a task
    # across epochs): two draws of one task are two groups of G, never one of 2G.
    env = ToolEnvironment(environment_factory=Answer).bind(tokenizer)
    (task,) = load_tasks([{"prompt": "Answer key: 1\nSubmit it.", "answer": 1}], env, "train_dataset")
    rollouts = run_episodes(TagFollower(tokenizer), tokenizer, [task, task], group_size=3,
                            config=RolloutConfig(progress=False, seed=random.Random(0).randrange(100)),
                            reward_tokens=DrawPerRollout(0.5))
    assert [r.group for r in rollouts] == [0, 0, 0, 1, 1, 1]
