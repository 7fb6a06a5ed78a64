"""``import rcgrpo_kernels`` stands alone: no rcgrpo, no trl or transformers, no GPU, no Triton until used,
and it is never mistaken for the Hugging Face ``kernels`` hub package."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_without_rcgrpo_or_gpu():
    res = _python(
        "import json, sys, torch\n"
        "import rcgrpo_kernels\n"
        "lp = rcgrpo_kernels.token_logprobs(torch.zeros(2, 5), torch.tensor([0, 4]))\n"
        "print(json.dumps({'rcgrpo': 'rcgrpo' in sys.modules, 'triton': 'triton' in sys.modules,\n"
        "  'trl': 'trl' in sys.modules, 'transformers': 'transformers' in sys.modules,\n"
        "  'cuda': torch.cuda.is_initialized(), 'api': sorted(rcgrpo_kernels.__all__), 'lp': lp.tolist()}))\n"
    )
    assert not res["rcgrpo"]
    # Other GRPO code (the TRL drop-in, rcgrpo_kernels.trl_grpo) imports the kernels, never the reverse.
    assert not res["trl"] and not res["transformers"]
    assert not res["triton"]  # Triton is imported only when the Triton path runs
    assert not res["cuda"]
    assert {"token_logprobs", "fused_linear_logprobs", "group_advantages", "grpo_loss",
            "fused_linear_grpo_loss"} <= set(res["api"])
    assert abs(res["lp"][0] + 1.6094379) < 1e-5  # log(1/5)


def test_not_mistaken_for_hf_kernels_package():
    """transformers probes a top-level ``kernels`` module; without Hugging
    Face's package it must not think the hub package is there (it would then
    call kernels.get_kernel). This holds while the distribution that ships our
    ``kernels.py`` (rcgrpo) has a version outside the hub package's accepted
    range; tests/test_name_clash.py installs their package beside ours."""
    res = _python(
        "import json\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "print(json.dumps({'available': bool(is_kernels_available())}))\n"
    )
    assert res["available"] is False


def test_first_name_gives_the_same_modules_not_copies():
    """``import kernels`` (the first name, the repository root's kernels.py)
    is ``rcgrpo_kernels`` itself, submodules included: a loss type registered
    through one name is seen through the other, and Triton still waits until
    a Triton module is asked for."""
    res = _python(
        "import json, sys, torch\n"
        "import kernels, rcgrpo_kernels\n"
        "import kernels.dispatch, kernels.loss_types\n"
        "from kernels.packing import next_token_targets\n"
        "same = [kernels is rcgrpo_kernels, kernels.dispatch is rcgrpo_kernels.dispatch,\n"
        "        sys.modules['kernels.loss_types'] is rcgrpo_kernels.loss_types,\n"
        "        next_token_targets is rcgrpo_kernels.next_token_targets,\n"
        "        kernels.dispatch.__spec__.name == 'rcgrpo_kernels.dispatch']\n"
        "triton_before = 'triton' in sys.modules\n"
        "import kernels.triton.common as common\n"
        "same.append(common is sys.modules['rcgrpo_kernels.triton.common'])\n"
        "print(json.dumps({'same': same, 'triton_before': triton_before,\n"
        "  'file': kernels.__file__}))\n"
    )
    assert res["same"] == [True] * 6
    assert not res["triton_before"]
    assert res["file"].endswith("rcgrpo_kernels/__init__.py")
