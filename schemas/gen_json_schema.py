"""Write the JSON Schema of every wire message to schemas/json/ (`python -m schemas.gen_json_schema`).

The files are checked in so that producers in other languages can validate against them;
a test fails when they drift from the models.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel

from schemas.messages import Cancel, FinalReply, Request, TokenReply

JSON_DIR = Path(__file__).parent / "json"
MODELS: dict[str, type[BaseModel]] = {
    "request": Request,
    "token_reply": TokenReply,
    "final_reply": FinalReply,
    "cancel": Cancel,
}


def render_all() -> dict[str, str]:
    """File name -> file text. Validation-mode schemas: what a reader accepts."""
    return {
        f"{name}.json": json.dumps(
            model.model_json_schema(mode="validation"), indent=2, sort_keys=True
        )
        + "\n"
        for name, model in MODELS.items()
    }


def main() -> int:
    JSON_DIR.mkdir(exist_ok=True)
    for file_name, text in render_all().items():
        (JSON_DIR / file_name).write_text(text)
        print(JSON_DIR / file_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
