"""``import rcgrpo_kernels`` stands alone: no rcgrpo, no trl or transformers, no GPU, no Triton until used,
and it is never mistaken for the Hugging Face ``kernels`` hub package."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # what a fresh interpreter imports is the subject (~2 s)
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


@pytest.mark.slow  # what a fresh interpreter imports is the subject (~2 s)
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


@pytest.mark.slow  # pip builds the distribution (~5 s)
def test_the_kernels_install_alone(tmp_path):
    """`pip install ./rcgrpo_kernels` is the kernels and the TRL drop-in, needing
    torch only (Triton and TRL are extras), importable without the repository."""
    source = tmp_path / "source"
    shutil.copytree(ROOT / "rcgrpo_kernels", source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                          "--target", str(target), str(source)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    (dist_info,) = target.glob("rcgrpo_kernels-*.dist-info")
    requires = [line.split(":", 1)[1].strip() for line in (dist_info / "METADATA").read_text().splitlines()
                if line.startswith("Requires-Dist:")]
    assert [r for r in requires if "extra ==" not in r] == ["torch>=2.6"]
    assert {p.name for p in target.iterdir()} == {"rcgrpo_kernels", dist_info.name}  # nothing of the trainer
    env = dict(os.environ, PYTHONPATH=str(target), CUDA_VISIBLE_DEVICES="")
    code = ("import json, importlib.util, torch, rcgrpo_kernels\n"
            "lp = rcgrpo_kernels.token_logprobs(torch.zeros(2, 5), torch.tensor([0, 4]))\n"
            "print(json.dumps({'file': rcgrpo_kernels.__file__, 'lp': lp.tolist(),\n"
            "  'trl_grpo': importlib.util.find_spec('rcgrpo_kernels.trl_grpo').origin}))\n")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["file"] == str(target / "rcgrpo_kernels" / "__init__.py")
    assert got["trl_grpo"] == str(target / "rcgrpo_kernels" / "trl_grpo.py")
    assert abs(got["lp"][0] + 1.6094379) < 1e-5
