"""Each torchrun rank holds its own in-process vLLM engine on the job's
process group (vLLM's external launcher): the engines start, generate
independently, take a weight swap streamed from the rank's FSDP shards, and
the job ends cleanly (vLLM's groups are torn down before ours)."""
import json
import re

import pytest

from tests.distributed.conftest import torchrun
from tests.required import require

pytestmark = pytest.mark.slow  # torchrun: 2 ranks, each with the 135M model and a vLLM engine (~33 s)

SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from rcgrpo.base import distributed
from rcgrpo.model.loading import load_policy
from rcgrpo.rollout import make_engine
from rcgrpo.rollout.engine import SamplingConfig
from rcgrpo.model.policy import TrainablePolicy

with distributed.guarded():
    distributed.init("cpu", 300)
    policy = load_policy()
    engine = make_engine("vllm", policy.path, dtype="float32", max_model_len=1024, seed=0, kv_cache_gib=1,
                         distributed_executor_backend="external_launcher", tensor_parallel_size=1)
    ids = policy.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    greedy = SamplingConfig(max_tokens=6, temperature=0.0)
    # Ranks make different numbers of calls: the engines must not pair them up.
    for _ in range(1 + distributed.rank()):
        before = engine.generate([ids], greedy)[0][0].token_ids
    model = distributed.shard_model(policy.model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # every rank scales its shard: the engines must see the whole change
    engine.load_weights(TrainablePolicy(model).rollout_weights())
    after = engine.generate([ids], greedy)[0][0].token_ids
    out = {"rank": distributed.rank(), "before": before, "after": after}
    with open(os.path.join(sys.argv[1], f"rank{distributed.rank()}.json"), "w") as f:
        json.dump(out, f)
    distributed.shutdown()
"""


def test_each_rank_runs_its_own_vllm_engine(tmp_path):
    require("vllm", "cpu")
    script = tmp_path / "engines.py"
    script.write_text(SCRIPT)
    out = torchrun(2, [str(script), str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["before"] == r1["before"] and len(r0["before"]) > 0  # same weights, greedy: same reply
    assert r0["after"] == r1["after"] and r0["after"] != r0["before"]  # both engines got the full swap
    assert "Invalid process group" not in out.stderr and "Traceback" not in out.stderr
    # vLLM's INFO lines (19 of an engine start's 43) stay out of a run's log; its warnings stay in.
    vllm_info = re.findall(r".*INFO \d\d-\d\d [\d:]{8} \[.*", out.stdout + out.stderr)
    assert vllm_info == [], vllm_info[:5]
