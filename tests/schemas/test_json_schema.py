from __future__ import annotations

import json

from schemas.gen_json_schema import JSON_DIR, render_all


def test_checked_in_json_schemas_are_current() -> None:
    rendered = render_all()
    on_disk = {p.name: p.read_text() for p in JSON_DIR.glob("*.json")}
    assert on_disk == rendered, "run `python -m schemas.gen_json_schema` and commit schemas/json/"


def test_request_schema_states_the_contract() -> None:
    schema = json.loads(render_all()["request.json"])
    assert set(schema["required"]) == {"id", "reply_to"}
    assert schema["properties"]["reply_to"]["pattern"] == "^[a-zA-Z0-9._-]{1,249}$"
    assert schema["properties"]["max_tokens"]["minimum"] == 1
