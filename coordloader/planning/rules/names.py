"""The architecture presets' names (``presets.py`` defines them), apart so that the rule
file parser can check a file's preset without importing the presets."""
from __future__ import annotations

import difflib

PRESETS = ("llama", "qwen2", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "bert",
           "phi3", "gemma3", "glm4_moe",
           "gpt_oss", "llama4", "qwen3_next")


def near_preset(name) -> str:
    """"; did you mean 'x'?" for a name close to a preset's, else ""."""
    near = difflib.get_close_matches(name, PRESETS, n=1) if isinstance(name, str) else []
    return f"; did you mean {near[0]!r}?" if near else ""
