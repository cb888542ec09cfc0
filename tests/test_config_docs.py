"""Every setting of kv_connector_extra_config has its row in the README's configuration
table, so a setting added in code cannot go undocumented."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_draft_offload.config import DraftOffloadConfig, L3Config

README = Path(__file__).resolve().parents[1] / "README.md"
# Documented under another name: l3.lmcache's keys are given as top-level lmcache.<key>.
DOCUMENTED_AS = {"l3.lmcache": "lmcache.<key>"}


def test_every_setting_has_a_readme_row() -> None:
    rows = set(re.findall(r"^\| `([^`]+)` \|", README.read_text(), re.MULTILINE))
    names = [field.alias or name for name, field in DraftOffloadConfig.model_fields.items()]
    names = [name for name in names if name != "l3"]
    names += [f"l3.{name}" for name in L3Config.model_fields]
    missing = [name for name in names if DOCUMENTED_AS.get(name, name) not in rows]
    assert missing == []
