"""A checkpoint directory with the built-in model's weights and a tokenizer whose tool-call and reasoning markers are
special tokens, as in Kimi-K2's: the last ids of the built-in vocabulary (merges that nothing builds on) become
``<|tool_calls_section_begin|>`` ... ``<think>``, ``</think>`` and a special token no parser reads, and the chat
template writes Kimi-K2's tool-call syntax (so the server picks the kimi_k2 parser) and ``<think>`` blocks (so it
picks a reasoning parser)."""

import json
import os
from pathlib import Path

from hetmoe.engine.llm import default_model_path

MARKERS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>", "<|hidden|>"]
FIRST = 8192 - len(MARKERS)
IDS = {m: FIRST + k for k, m in enumerate(MARKERS)}

TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message.get('reasoning_content') %}<think>{{ message['reasoning_content'] }}</think>{% endif %}"
    "{% if message.get('tool_calls') %}<|tool_calls_section_begin|>"
    "{% for c in message['tool_calls'] %}<|tool_call_begin|>functions.{{ c['function']['name'] }}:{{ loop.index0 }}"
    "<|tool_call_argument_begin|>{{ c['function']['arguments'] }}<|tool_call_end|>{% endfor %}"
    "<|tool_calls_section_end|>{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_marker_model(path: Path) -> Path:
    """The directory at ``path``: the built-in model's files linked, its tokenizer rewritten."""
    src = default_model_path()
    path.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            os.symlink(f, path / f.name)
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    gone = {t for t, i in vocab.items() if i >= FIRST}
    assert not any(a in gone or b in gone for a, b in spec["model"]["merges"])  # nothing builds on them
    spec["model"]["vocab"] = {t: i for t, i in vocab.items() if i < FIRST}
    spec["model"]["merges"] = [[a, b] for a, b in spec["model"]["merges"] if a + b not in gone]
    spec["added_tokens"] += [{"id": IDS[m], "content": m, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for m in MARKERS]
    (path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = json.loads((src / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path
