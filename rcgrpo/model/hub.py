"""The Hugging Face Hub: a hub id read like a folder, a stage's model pushed.

* `is_hub_id` / `split_hub_id`: a hub id is exactly "owner/name", optionally
  "owner/name@revision" (a branch, tag or commit; `@` cannot occur in a repo
  name, so the form is unambiguous); anything else is a path.
* `download`: the repo's files a model folder needs (config, weights as
  safetensors, tokenizer; never the duplicate `.bin`/GGUF copies many repos
  also hold) into the usual Hugging Face cache, via `snapshot_download`; the
  snapshot folder is then read like any local folder. HF_HUB_OFFLINE=1 reads
  the cache only.
* `check_push` / `push_stage`: `run.push_to_hub` uploads each trained stage's
  export (the merged model + tokenizer, and a LoRA run's shareable adapter in
  `adapter/`) with `HfApi.create_repo` + `upload_folder`, one commit on main
  per stage: main is the latest stage, `owner/name@<commit>` an earlier one
  (the run logs each stage's commit and keeps it in stages/<stage>.pushed).

The token is the usual one (HF_TOKEN, or `hf auth login`); HF_ENDPOINT is
read at each call, not only when huggingface_hub is first imported, so that a
mirror set late (or a test's local server) is honoured.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from rcgrpo.base.errors import UserError

__all__ = ["HubError", "is_hub_id", "split_hub_id", "download", "cached", "check_push", "push_stage"]

# What huggingface_hub accepts in one part of a repo id.
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HUB_ID = re.compile(rf"^({_PART}/{_PART})(?:@([^\s@]+))?$")
# A model folder's files; the rest of a repo (other weight formats, images) is not fetched.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "adapter/*"]


class HubError(UserError, RuntimeError):
    """A hub id cannot be fetched, or a push cannot be made (no token, no network, no access)."""


def is_hub_id(text: str) -> bool:
    """Whether `text` names a Hub repo rather than a path (no leading ./, / or ~)."""
    return not text.startswith((".", "/", "~")) and _HUB_ID.match(text) is not None


def split_hub_id(text: str) -> tuple[str, str | None]:
    """("owner/name", revision or None)."""
    m = _HUB_ID.match(text)
    if m is None or text.startswith((".", "/", "~")):
        raise HubError(f"{text!r} is not a hub id (owner/name or owner/name@revision)")
    return m.group(1), m.group(2)


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def download(hub_id: str) -> Path:
    """The snapshot folder of `hub_id` in the Hugging Face cache (fetched now
    if it is not there yet)."""
    from huggingface_hub import snapshot_download

    repo, revision = split_hub_id(hub_id)
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=MODEL_FILES, endpoint=_endpoint()))
    except Exception as e:  # offline, not found, gated, no access: huggingface_hub's many types
        raise HubError(f"cannot fetch {hub_id} from the Hub: {type(e).__name__}: {_first_line(e)}") from e


def cached(hub_id: str) -> Path | None:
    """The snapshot folder of `hub_id` if the Hugging Face cache has it; never fetches."""
    from huggingface_hub import snapshot_download

    repo, revision = split_hub_id(hub_id)
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=MODEL_FILES, local_files_only=True))
    except Exception:  # not in the cache (huggingface_hub raises several types)
        return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=_endpoint())


def check_push(repo_id: str) -> None:
    """Before any training: a token is there and the repo exists or can be
    created with it (a push that fails after hours of training would leave
    the run's models local only). One line on failure."""
    from huggingface_hub import get_token

    if get_token() is None:
        raise HubError(f"run.push_to_hub {repo_id}: no Hugging Face token; set HF_TOKEN or run `hf auth login` "
                       "(or leave run.push_to_hub out)")
    try:
        _api().create_repo(repo_id, exist_ok=True)
    except Exception as e:
        raise HubError(f"run.push_to_hub: cannot create or reach {repo_id}: {type(e).__name__}: {_first_line(e)}"
                       ) from e


def push_stage(repo_id: str, folder: Path, stage: str, run_name: str) -> str:
    """Upload the stage's export `folder` to `repo_id` (main) as one
    commit; returns its id. The local folder is only read: a failed push
    loses nothing."""
    api = _api()
    try:
        api.create_repo(repo_id, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder),
                                   commit_message=f"rcgrpo run {run_name}: stage {stage}")
    except Exception as e:
        raise HubError(f"push of stage {stage} to {repo_id} failed: {type(e).__name__}: {_first_line(e)}; "
                       f"the stage's model is saved in {folder} (rerun with --resume to push it)") from e
    return commit.oid
