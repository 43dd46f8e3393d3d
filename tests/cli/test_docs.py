"""What the docs tell a user to type works: the built-in model's `--raw` example (docs/running.md) continues the
function it starts, and the install commands name extras that exist, in the local form (hetmoe is not on a package
index), with what bench/demo_model_gguf.py imports."""

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _extras() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    entries = re.finditer(r"^(\w+) = \[(.*?)\]", block, re.M | re.S)  # an extra's list may span lines
    return {m[1]: re.findall(r'"([A-Za-z0-9_.-]+)', m[2]) for m in entries}


def test_the_raw_example_continues_the_function_it_starts(capsys):
    from hetmoe.cli import main

    text = (ROOT / "docs" / "running.md").read_text()
    quoted = re.findall(r"`hetmoe generate --raw --prompt \$'([^']*)'`", text)
    assert len(quoted) == 1, quoted
    prompt = quoted[0].encode().decode("unicode_escape")  # bash's $'...' escapes, as the shell passes them
    assert main(["generate", "--raw", "--prompt", prompt, "--device", "cpu", "--expert-cache", "off",
                 "--max-tokens", "6", "--json"]) == 0
    completion = json.loads(capsys.readouterr().out)["text"]
    assert re.match(r"\n[ \t]+\S", completion), repr(completion)  # the body of read_config, indented


def test_install_commands_use_the_local_form_and_existing_extras():
    extras = _extras()
    for doc in DOCS:
        text = doc.read_text()
        assert not re.search(r"pip install '?hetmoe\[", text), f"{doc}: hetmoe is not on an index: pip install -e"
        for names in re.findall(r"pip install -e '?\.\[([\w,]+)\]", text):
            assert set(names.split(",")) <= set(extras), (doc, names)


def test_the_gguf_extra_installs_what_demo_model_gguf_imports():
    tree = ast.parse((ROOT / "bench" / "demo_model_gguf.py").read_text())
    imported = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [None])}
    base = {"argparse", "json", "sys", "pathlib", "__future__", "gguf_files", "tokenizers", "numpy", "torch"}
    extras = _extras()
    assert imported - base <= set(extras["gguf"]), imported - base
    assert {"gguf", "safetensors"} <= set(extras["gguf"]) and {"gguf", "safetensors"} <= set(extras["test"])
