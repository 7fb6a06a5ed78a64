"""Hugging Face's `kernels` package (PyPI `kernels`: hub kernels, imported by
transformers and TRL) installed beside ours, for real: rcgrpo's CLI,
transformers' model loading and TRL's import all work, rcgrpo's kernels are
reachable by their stable name `rcgrpo_kernels`, and `import kernels` gives
their package, whichever of the two Python finds first. Without their package,
tests/kernels/test_kernels_import.py checks that `import kernels` gives ours.

Their package is installed once, without its dependencies (it imports none
that transformers does not bring), into a folder of the repository's
git-ignored .cache, and put on PYTHONPATH."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Inside the range transformers 5.19 accepts (KERNELS_MIN/MAX_VERSION: >= 0.17, < 0.18).
HF_KERNELS = "kernels==0.17.2"


@pytest.fixture(scope="session")
def hf_kernels_dir() -> Path:
    target = ROOT / ".cache" / "hf-kernels" / HF_KERNELS.split("==")[1]
    if not (target / "kernels" / "__init__.py").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=target.parent))
        out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                              "--target", str(scratch), HF_KERNELS], capture_output=True, text=True)
        if out.returncode != 0:
            shutil.rmtree(scratch, ignore_errors=True)
            pytest.fail(f"could not install Hugging Face's {HF_KERNELS}: {(out.stderr or out.stdout).strip()[-300:]}")
        shutil.rmtree(target, ignore_errors=True)
        scratch.rename(target)  # whole or not at all: a failed install never looks installed
    return target


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A tiny random Llama saved as a model folder: what from_pretrained loads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


# Run as `python -c`: the CLI's help exactly as `python -m rcgrpo.train --help`
# runs it (runpy is what -m uses), then what transformers and TRL do with `kernels`.
SCRIPT = r"""
import contextlib, io, json, runpy, sys
help_text = io.StringIO()
sys.argv = ["rcgrpo.train", "--help"]
with contextlib.redirect_stdout(help_text):
    try:
        runpy.run_module("rcgrpo.train", run_name="__main__", alter_sys=True)
        cli_exit = None
    except SystemExit as e:
        cli_exit = 0 if e.code is None else e.code  # the exit status: SystemExit(None) is 0
import torch
import rcgrpo_kernels
lp = rcgrpo_kernels.token_logprobs(torch.zeros(2, 5), torch.tensor([0, 4]))
import kernels
from transformers import AutoModelForCausalLM
from transformers.utils.import_utils import is_kernels_available
model = AutoModelForCausalLM.from_pretrained(sys.argv_model)
logits = model(torch.tensor([[1, 2, 3]])).logits
from kernels import get_kernel  # what TRL's tree attention and transformers' hub kernels import
grpo_trainer = None
if sys.with_trl:
    from trl import GRPOTrainer
    import trl.experimental.async_grpo.packing  # the TRL module that imports `kernels`
    grpo_trainer = GRPOTrainer.__name__
print(json.dumps({
    "cli_exit": cli_exit, "help_has_usage": "usage" in help_text.getvalue().lower(),
    "stable": abs(lp[0].item() + 1.6094379) < 1e-5, "kernels_file": kernels.__file__,
    "transformers_sees_hub_kernels": bool(is_kernels_available()),
    "logits_finite": bool(torch.isfinite(logits).all()), "grpo_trainer": grpo_trainer,
}))
"""


def _start(pythonpath: list[Path], cwd: Path, model: Path, with_trl: bool, logs: Path) -> subprocess.Popen:
    """SCRIPT in a fresh interpreter with `pythonpath`, its output into files
    in `logs` (not pipes: an unread pipe could block it while the other order runs)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, pythonpath)), CUDA_VISIBLE_DEVICES="")
    code = SCRIPT.replace("sys.argv_model", repr(str(model))).replace("sys.with_trl", repr(with_trl))
    with open(logs / "stdout", "w") as stdout, open(logs / "stderr", "w") as stderr:
        return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=cwd, stdout=stdout, stderr=stderr,
                                text=True)


def _finish(proc: subprocess.Popen, logs: Path) -> tuple[dict, str]:
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = (logs / "stderr").read_text()
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    return json.loads((logs / "stdout").read_text().strip().splitlines()[-1]), stderr


@pytest.fixture(scope="module")
def orders(request, hf_kernels_dir, model_folder, tmp_path_factory):
    """The subprocess of each path order whose test will run, all started at
    once so that the short one runs beside the long one (the machine has two
    cores). One interpreter per order: an order is what `import kernels`
    resolves to at a process's start, and their package cannot be imported
    twice in one process (its Rust extension, PyO3, initialises only once)."""
    selected = {item.name for item in request.session.items}
    plans = {"test_their_package_found_first": ([hf_kernels_dir, ROOT], tmp_path_factory.mktemp("outside"), False),
             "test_ours_found_first": ([ROOT, hf_kernels_dir], ROOT, True)}
    started = {}
    for test, (pythonpath, cwd, with_trl) in plans.items():
        if test in selected:
            logs = tmp_path_factory.mktemp("order")
            started[test] = (_start(pythonpath, cwd, model_folder, with_trl, logs), logs)
    yield started
    for proc, _ in started.values():  # a test that failed before finishing its own
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _check_all_work(res: dict, hf_kernels_dir: Path) -> None:
    assert res["cli_exit"] == 0 and res["help_has_usage"], res
    assert res["stable"], "rcgrpo_kernels.token_logprobs gave the wrong value"
    assert Path(res["kernels_file"]).parent == hf_kernels_dir / "kernels", "import kernels is not Hugging Face's"
    assert res["transformers_sees_hub_kernels"] and res["logits_finite"], res


@pytest.mark.slow  # a subprocess imports transformers and loads a model (~6 s, beside the next test's)
def test_their_package_found_first(hf_kernels_dir, orders):
    """Their package first on the path: how an install into one site-packages
    resolves (a package folder wins over our one-file kernels.py there) and how
    an editable install of ours resolves (its finder comes after the path).
    Our kernels.py never runs, so TRL is imported only in the next test."""
    res, stderr = _finish(*orders["test_their_package_found_first"])
    _check_all_work(res, hf_kernels_dir)
    assert "rcgrpo_kernels" not in stderr  # our kernels.py never ran: nothing to say


@pytest.mark.slow  # a subprocess imports transformers and TRL and loads a model (~15 s, started with the one above)
def test_ours_found_first(hf_kernels_dir, orders):
    """Ours first (a checkout's root on the path, as when running from it):
    kernels.py hands `kernels` to their package and says so in one line."""
    res, stderr = _finish(*orders["test_ours_found_first"])
    _check_all_work(res, hf_kernels_dir)
    assert res["grpo_trainer"] == "GRPOTrainer"
    said = [line for line in stderr.splitlines() if "rcgrpo_kernels" in line]
    assert len(said) == 1 and "Hugging Face's `kernels` package is installed" in said[0], stderr[-2000:]
