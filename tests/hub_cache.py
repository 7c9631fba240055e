"""A directory laid out as huggingface_hub's cache, built from a local checkpoint, so hub ids
load in tests with HF_HUB_OFFLINE=1 and no network:

    <root>/models--<org>--<name>/snapshots/<commit>/<files>
    <root>/models--<org>--<name>/refs/<branch or tag>   (holds the commit hash)

The hub's own cache stores files as links into blobs/; snapshot_download reads the snapshot
folder only, so plain copies serve as well.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def commit_hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()  # 40 hex digits, like a git commit


def add_to_hub_cache(
    root: Path, repo_id: str, source: Path, refs: tuple[str, ...] = ("main",), commit: str = ""
) -> Path:
    """Copy checkpoint `source` into the cache as `repo_id` at `commit` (derived from the repo
    id if empty), point each of `refs` at it, and return the snapshot folder."""
    commit = commit or commit_hash(repo_id)
    repo = Path(root) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
