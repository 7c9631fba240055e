"""`schemas` is the contract and nothing else: a producer can depend on it alone."""

from __future__ import annotations

import subprocess
import sys


def test_schemas_import_nothing_of_ours_nor_kafka() -> None:
    code = (
        "import sys, schemas, schemas.gen_json_schema; "
        "bad = [m for m in ('engine', 'worker', 'aiokafka', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
