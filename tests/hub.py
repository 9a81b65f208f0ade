"""A Hugging Face hub without a network: an empty cache in tmp_path, snapshot_download answering from a script.

Every test that could reach the hub uses ``fake_hub``: a real call here would fail anyway (no network), but it must
never be what a test depends on, nor be able to hang.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


class FakeHub:
    """What snapshot_download does when asked to go online: serve a model directory or raise ``raises``."""

    def __init__(self, real, cache: Path):
        self.real, self.cache = real, cache
        self.calls: list[str] = []
        self.bars_during_download: list[bool] = []
        self.raises: BaseException | None = None
        self.serves: Path | None = None

    def __call__(self, repo_id: str, *, local_files_only: bool = False, **kw):
        if local_files_only:  # the cache is real (a temporary folder): look it up the real way
            return self.real(repo_id, local_files_only=True, **kw)
        from huggingface_hub.utils import are_progress_bars_disabled

        self.calls.append(repo_id)
        self.bars_during_download.append(not are_progress_bars_disabled())
        if self.raises is not None:
            raise self.raises
        if self.serves is None:
            pytest.fail(f"unexpected download of {repo_id}")
        return str(put_in_cache(self.cache, repo_id, self.serves))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, online mode (whatever the environment running the tests says)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return cache


@pytest.fixture
def fake_hub(hub_cache, monkeypatch) -> FakeHub:
    import huggingface_hub

    hub = FakeHub(huggingface_hub.snapshot_download, hub_cache)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    return hub


def put_in_cache(cache: Path, repo_id: str, model_dir: Path, commit: str = "0" * 40) -> Path:
    """Lay ``model_dir`` out as the standard cache holds a downloaded repo: refs/main -> snapshots/COMMIT."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    if not snapshot.exists():
        shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def http_error(cls, status: int, repo_id: str, message: str | None = None):
    """A real huggingface_hub HTTP error class, with the response it is always built from."""
    import httpx2

    url = f"https://huggingface.co/api/models/{repo_id}/revision/main"
    response = httpx2.Response(status, request=httpx2.Request("GET", url))
    return cls(message or f"{status} Client Error for url {url}", response=response)
