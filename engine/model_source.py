"""Hugging Face hub ids ("Qwen/Qwen3-0.6B") -> a local checkpoint directory in the hub cache.

`huggingface_hub.snapshot_download` does the work, so its cache layout
(`models--org--name/snapshots/<commit>/`), `HF_TOKEN` and offline mode are the library's own.
Two environment variables are read again at each call, not only when huggingface_hub is
imported: `HF_HUB_CACHE` and `HF_HUB_OFFLINE` (transformers imports huggingface_hub long before
a model is named, so a process that sets them later would otherwise be ignored).

Only the files the engine reads are fetched (config, safetensors weights, tokenizer, generation
config), and config.json comes first: an unsupported architecture fails before gigabytes of
weights are downloaded.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import structlog

from engine.models import resolve_architecture

log = structlog.get_logger(__name__)

# org/name, as the hub spells repository ids (letters, digits, '.', '_', '-').
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
CHECKPOINT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_TRUE = {"1", "on", "yes", "true"}


def is_hub_id(model: str | Path) -> bool:
    """Whether `model` names a hub repository: "org/name" that is not an existing local path."""
    if not isinstance(model, str) or not _HUB_ID.fullmatch(model):
        return False
    return not Path(model).expanduser().exists()


def _hub_options() -> dict:
    options: dict = {}
    cache = os.environ.get("HF_HUB_CACHE")
    if cache:
        options["cache_dir"] = cache
    offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if (offline or "").strip().lower() in _TRUE:
        options["local_files_only"] = True
    return options


def download_hub_model(repo_id: str, revision: str | None = None, progress: bool = True) -> Path:
    """The snapshot directory of `repo_id` at `revision` (branch, tag or commit; None: main),
    downloaded into the hub cache if it is not there yet. ValueError, naming the model, for an
    unknown or gated repository, a missing revision, an offline cache miss or an unsupported
    architecture."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    options = _hub_options()
    where = f"{repo_id}@{revision}" if revision else repo_id
    log.info("model.hub.resolve", model=where, offline=options.get("local_files_only", False))
    if not progress:
        disable_progress_bars()
    try:
        config = hf_hub_download(repo_id, "config.json", revision=revision, **options)
        resolve_architecture(json.loads(Path(config).read_text()))
        path = snapshot_download(
            repo_id, revision=revision, allow_patterns=list(CHECKPOINT_PATTERNS), **options
        )
    except ValueError:
        raise
    except Exception as error:  # huggingface_hub's errors: say which model and why
        raise ValueError(
            f"cannot load {where!r} from the hub (it is no local path either): {_explain(error)}"
        ) from error
    finally:
        if not progress:
            enable_progress_bars()
    log.info("model.hub.ready", model=where, path=path)
    return Path(path)


def _explain(error: Exception) -> str:
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, GatedRepoError):
        return "the repository is gated: accept its terms on the hub and set HF_TOKEN"
    if isinstance(error, RepositoryNotFoundError):
        return "no such repository (or it is private: set HF_TOKEN)"
    if isinstance(error, RevisionNotFoundError):
        return "no such revision"
    if isinstance(error, LocalEntryNotFoundError):
        return (
            "not in the hub cache and the hub cannot be reached (HF_HUB_OFFLINE is set, or no "
            f"network); cache: {os.environ.get('HF_HUB_CACHE') or 'the default'}"
        )
    if isinstance(error, EntryNotFoundError):
        return "the repository has no config.json (not a transformers checkpoint)"
    return f"{type(error).__name__}: {error}"
