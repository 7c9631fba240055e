"""docs/SETTINGS.md is what the settings classes generate: a setting added, renamed or given a
new default without regenerating the file fails here. Regenerate with
`python -m worker.service.settings_doc > docs/SETTINGS.md`."""

from __future__ import annotations

from pathlib import Path

from worker.service.settings import WorkerSettings
from worker.service.settings_doc import render

ROOT = Path(__file__).resolve().parents[3]


def test_settings_md_is_up_to_date() -> None:
    committed = (ROOT / "docs" / "SETTINGS.md").read_text()
    assert committed == render(), (
        "docs/SETTINGS.md is stale: python -m worker.service.settings_doc > docs/SETTINGS.md"
    )


def test_every_setting_has_a_row() -> None:
    text = render()
    assert "`MINI_INFER_KAFKA__BOOTSTRAP_SERVERS` | `--bootstrap-servers`" in text
    assert "`MINI_INFER_ENGINE__MAX_NUM_SEQS` | `--max-num-seqs`" in text
    assert "`MINI_INFER_KAFKA__REPLY_TOPICS__MAX_CREATED`" in text  # a group in a group
    assert "`MINI_INFER_OBSERVABILITY__HEALTH_PORT`" in text
    num_rows = text.count("\n| `MINI_INFER_")
    assert num_rows >= len(WorkerSettings.model_fields) + 60  # ~80 settings in all
