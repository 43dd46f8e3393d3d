"""``LLM``: a model directory (or the built-in default model) loaded, tokenized and ready to generate — the one
object the CLI commands, the server and Python users share.

    from hetmoe import LLM
    llm = LLM("path/to/DeepSeek-V3", EngineOptions(experts_format="int4"))
    print(llm.generate("Explain MoE in one sentence.", SamplingParams(max_new_tokens=64)).text)
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Callable, Optional, Union

from hetmoe.engine.generation import GenerationResult, SamplingParams, generate
from hetmoe.engine.loader import LoadedModel, check_model_dir, load_model, load_tokenizer
from hetmoe.engine.placement import EngineOptions
from hetmoe.engine.runner import Runner
from hetmoe.engine.tokenizer import Tokenizer


def default_model_path() -> Path:
    """The small MoE checkpoint shipped inside the package (see hetmoe/data/default_model/README.md)."""
    return Path(str(resources.files("hetmoe") / "data" / "default_model"))


class LLM:
    def __init__(self, model: Union[str, Path, None] = None, options: Optional[EngineOptions] = None, *,
                 expert_cache: Optional[str] = "auto", progress: bool = True, log: Optional[Callable] = None,
                 loaded: Optional[LoadedModel] = None, tokenizer: Optional[Tokenizer] = None):
        """``model``: a Hugging Face checkpoint directory (None: the built-in default model). ``loaded`` and
        ``tokenizer`` bypass loading (models built in memory, e.g. synthetic benchmark shapes)."""
        path = Path(model) if model is not None else default_model_path()
        kwargs = {"log": log} if log is not None else {}
        if loaded is None and tokenizer is None:
            # the directory, config.json and the tokenizer files are checked before any weight is read
            tokenizer = load_tokenizer(path, check_model_dir(path), log or (lambda m: print(m, file=sys.stderr)))
        self.loaded = loaded or load_model(path, options, expert_cache=expert_cache, progress=progress, **kwargs)
        self.tokenizer = tokenizer or Tokenizer.from_dir(self.loaded.path or path)
        self.runner = Runner(self.loaded)
        self._reuse: list = []  # tokens in slot 0's cache, for prefix reuse across chat turns (forget_cache)

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    def forget_cache(self) -> None:
        """The next ``generate`` recomputes its whole prompt (nothing in the KV cache is trusted for reuse)."""
        self._reuse = []

    def prompt_ids(self, prompt: Union[str, list], chat: bool) -> list:
        """Token ids of a prompt: a string (wrapped as one user message when ``chat`` and the tokenizer has a
        chat template) or a list of chat messages."""
        if isinstance(prompt, list):
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if chat and self.tokenizer.has_chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def generate(self, prompt: Union[str, list], params: Optional[SamplingParams] = None, *, chat: bool = True,
                 on_text: Optional[Callable[[str], None]] = None) -> GenerationResult:
        """Generate a completion of ``prompt`` (text or a list of {role, content} messages)."""
        return generate(_PrefixReuse(self), self.tokenizer, self.prompt_ids(prompt, chat), params, on_text)


class _PrefixReuse:
    """Runner view for ``generate`` that skips re-computing the part of a new prompt already in the cache
    (a chat's earlier turns): positions past the shared prefix are simply overwritten.

    The record of what the cache holds (``LLM._reuse``) only ever names positions whose step completed: it is
    cleared while a step runs and set once it returns, so a step interrupted (Ctrl-C, an error) leaves nothing
    for the next prompt to trust."""

    def __init__(self, llm: LLM):
        self.llm, self.runner = llm, llm.runner
        self.max_context = self.runner.max_context
        self.cached_tokens = 0  # of the last prefill

    def prefill(self, ids: list):
        old, self.llm._reuse = self.llm._reuse, []
        common = 0
        for a, b in zip(old, ids[:-1]):  # at least the last prompt token is computed, for its logits
            if a != b:
                break
            common += 1
        logits = self.runner.prefill(ids[common:], start=common) if common else self.runner.prefill(ids)
        self.llm._reuse, self.cached_tokens = list(ids), common
        return logits

    def decode(self, token: int):
        done, self.llm._reuse = self.llm._reuse, []
        logits = self.runner.decode(token)
        self.llm._reuse = done + [token]
        return logits
