"""``LLM``: a model directory (or the built-in default model) loaded, tokenized and ready to generate — the one
object the CLI commands and Python users share. Every call goes through the engine's scheduler
(engine/scheduler.py), the loop the server runs too: continuous batching, prefix reuse, stop handling.

    from hetmoe import LLM
    from hetmoe.config.options import EngineOptions
    from hetmoe.engine.sampler import SamplingParams
    llm = LLM("path/to/DeepSeek-V3", EngineOptions(experts_format="int4", max_batch=4))
    print(llm.generate("Explain MoE in one sentence.", SamplingParams(max_tokens=64)).text)
    outs = llm.generate(["First prompt", "Second prompt"])           # a list: generated together, in order
    reply = llm.chat([{"role": "user", "content": "Hi!"}])             # the chat template applied
    llm.chat(messages, tools=[...], chat_template_kwargs={"enable_thinking": False})  # template variables
    llm.generate({"prompt_token_ids": [9, 12, 7]})                      # token ids as they are
    for piece in (s := llm.stream("Once upon a time")): print(piece, end="")
    print(s.result.timings.decode_tok_s)
"""

from __future__ import annotations

import sys
from collections import deque
from importlib import resources
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from hetmoe.config.options import EngineOptions
from hetmoe.engine.runner import Runner
from hetmoe.engine.sampler import SamplingParams
from hetmoe.engine.scheduler import Request, Scheduler
from hetmoe.engine.sequence import GenerationResult
from hetmoe.load.loader import LoadedModel, check_model_dir, load_model, load_tokenizer
from hetmoe.models import MODEL_TYPES
from hetmoe.tokenizer import Tokenizer

Prompt = Union[str, list, dict]  # text, a conversation (a list of {"role", "content"} messages), or token ids:
# {"prompt_token_ids": [int, ...]}
TOKEN_IDS_KEY = "prompt_token_ids"
Params = Union[SamplingParams, Sequence[SamplingParams], None]


def default_model_path() -> Path:
    """The small MoE checkpoint shipped inside the package (see hetmoe/data/default_model/README.md)."""
    return Path(str(resources.files("hetmoe") / "data" / "default_model"))


def _is_conversation(prompt) -> bool:
    """A list of message dicts (a list of token-id prompts is not one: several prompts)."""
    return (isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
            and not any(TOKEN_IDS_KEY in m for m in prompt))


def _template_variables(tools, chat_template_kwargs) -> dict:
    """``tools`` and ``chat_template_kwargs`` checked -> the template variables they set (names the template gets
    otherwise are refused)."""
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"tools must be a list of tool definitions (dicts), got {tools!r:.80}")
    kwargs = chat_template_kwargs or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs must be a dict of template variable names to values, got "
                         f"{chat_template_kwargs!r:.80}")
    reserved = sorted(set(kwargs) & {"messages", "add_generation_prompt", "tools"})
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} (give messages and tools as "
                         "arguments)")
    return {**kwargs, "tools": tools} if tools is not None else dict(kwargs)


class LLM:
    def __init__(self, model: Union[str, Path, None] = None, options: Optional[EngineOptions] = None, *,
                 expert_cache: Optional[str] = "auto", progress: bool = True, log: Optional[Callable] = None,
                 loaded: Optional[LoadedModel] = None, tokenizer: Optional[Tokenizer] = None):
        """``model``: a Hugging Face checkpoint directory (None: the built-in default model). ``loaded`` and
        ``tokenizer`` bypass loading (models built in memory, e.g. synthetic benchmark shapes). Up to
        ``options.max_batch`` prompts run at once."""
        path = Path(model) if model is not None else default_model_path()
        kwargs = {"log": log} if log is not None else {}
        say = log or (lambda m: print(m, file=sys.stderr))
        runner = None
        if loaded is None:
            # the directory, config.json and the tokenizer files are checked before any weight is read
            cfg = check_model_dir(path)
            tokenizer = tokenizer or load_tokenizer(path, cfg, say)
            if cfg.get("model_type") not in MODEL_TYPES:  # no hetmoe model file: Transformers' own, if it has one
                from hetmoe.transformers.runner import open_transformers, transformers_class

                name = transformers_class(cfg.get("model_type"))
                if name is not None:
                    say(f"hetmoe: model_type {cfg.get('model_type')!r} has no hetmoe model file: running {name} "
                        "through Transformers with the hetmoe experts backend (eager decode: no CUDA graphs or "
                        "Expert Deferral)")
                    loaded, runner = open_transformers(path, options, say)
        self.loaded = loaded or load_model(path, options, expert_cache=expert_cache, progress=progress, **kwargs)
        self.tokenizer = tokenizer or Tokenizer.from_dir(self.loaded.path or path)
        self.runner = runner or Runner(self.loaded)
        self.scheduler = Scheduler(self.runner, self.tokenizer, log=log)
        self.default_params: Optional[SamplingParams] = None  # what params=None means (else SamplingParams())

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    def forget_cache(self) -> None:
        """The next prompts are computed whole (nothing in the KV cache is trusted for reuse)."""
        self.scheduler.forget_cache()

    def prompt_ids(self, prompt: Prompt, chat: bool, *, tools: Optional[list] = None,
                   chat_template_kwargs: Optional[dict] = None) -> list:
        """Token ids of a prompt: a string (wrapped as one user message when ``chat`` and the tokenizer has a
        chat template), a list of chat messages (``tools`` and ``chat_template_kwargs`` reach the template), or
        ``{"prompt_token_ids": [...]}``: those ids as they are (a non-empty list of integers in the model's
        vocabulary; any other dict is refused)."""
        if isinstance(prompt, dict):
            return self._token_ids(prompt)
        variables = _template_variables(tools, chat_template_kwargs)
        if isinstance(prompt, list):
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, **variables)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt is a string, a list of chat messages or {{{TOKEN_IDS_KEY!r}: [token ids]}}, "
                             f"got {type(prompt).__name__}")
        if chat and self.tokenizer.has_chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                      **variables)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def _token_ids(self, prompt: dict) -> list:
        if set(prompt) != {TOKEN_IDS_KEY}:
            raise ValueError(f"a prompt given as a dict must be {{{TOKEN_IDS_KEY!r}: [token ids]}} and nothing else, "
                             f"got the keys {sorted(map(str, prompt))}")
        ids = prompt[TOKEN_IDS_KEY]
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError(f"{TOKEN_IDS_KEY} must be a non-empty list of token ids, got {ids!r:.80}")
        vocab = self.runner.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{TOKEN_IDS_KEY} must hold integers in [0, {vocab}) (the vocabulary), got {bad[0]!r}")
        return list(ids)

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], params: Params = None, *, chat: bool = True,
                 on_text: Optional[Callable[[str], None]] = None):
        """Complete ``prompts``: one prompt (text; a conversation, as ``chat`` takes it; or
        ``{"prompt_token_ids": [...]}``) -> a GenerationResult; a list of them -> a list of results, in order,
        generated together (up to ``max_batch`` at a time).

        ``params``: one SamplingParams for all, or one per prompt (None: ``default_params``). ``chat``: wrap a
        text prompt as one user message when the model has a chat template (False: the text as it is).
        ``on_text(piece)`` (one prompt only) receives the text as it completes, between engine steps; an
        exception it raises stops the generation there (what is cached stays reusable)."""
        if isinstance(prompts, (str, dict)) or _is_conversation(prompts) or not isinstance(prompts, (list, tuple)):
            return self._run([self.prompt_ids(prompts, chat)], params, on_text)[0]
        if on_text is not None:
            raise ValueError("on_text streams one prompt; for several, call stream() for each or generate them "
                             "without it")
        return self._run([self.prompt_ids(p, chat) for p in prompts], params)

    def chat(self, messages: list, params: Params = None, tools: Optional[list] = None,
             chat_template_kwargs: Optional[dict] = None, *, on_text: Optional[Callable[[str], None]] = None):
        """Reply to a conversation (a list of {role, content} messages, the chat template applied) ->
        a GenerationResult; to a list of conversations -> a list of results. Earlier turns still in the KV cache
        are not recomputed. An assistant message's content may be None (a turn of tool calls only).

        ``tools``: a list of tool definitions (OpenAI's ``{"type": "function", "function": {...}}``) handed to the
        chat template as its ``tools`` variable; ``chat_template_kwargs``: further template variables (e.g.
        ``{"enable_thinking": False}``). Both apply to every conversation of a list."""
        _template_variables(tools, chat_template_kwargs)  # refused before anything runs
        variables = {"tools": tools, "chat_template_kwargs": chat_template_kwargs}
        if messages and all(isinstance(m, list) for m in messages):
            return self._run([self.prompt_ids(m, chat=True, **variables) for m in messages], params)
        if not isinstance(messages, list):
            raise ValueError(f"messages must be a list of {{role, content}} messages, got {type(messages).__name__}")
        return self._run([self.prompt_ids(messages, chat=True, **variables)], params, on_text)[0]

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, chat: bool = True) -> "Stream":
        """Iterate over the text of ``prompt``'s completion as it is generated (``generate``'s pieces); once the
        iteration ends, ``.result`` is the GenerationResult (timings included). Leaving the loop early (or
        ``close()``) frees the sequence's slot at the next engine step."""
        return Stream(self.scheduler, self.prompt_ids(prompt, chat), self._params(params, 1)[0])

    def _params(self, params: Params, n: int) -> list:
        if params is None:
            params = self.default_params or SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"params must be one SamplingParams or one per prompt ({n}), got {len(params)} items")
        return params

    def _run(self, prompt_ids: list, params: Params, on_text: Optional[Callable[[str], None]] = None) -> list:
        params = self._params(params, len(prompt_ids))
        return self.scheduler.run([Request(ids, p, on_text) for ids, p in zip(prompt_ids, params)])


class Stream:
    """``LLM.stream``'s iterator: text pieces, then ``result`` (None until the completion has ended)."""

    def __init__(self, scheduler: Scheduler, prompt_ids: list, params: SamplingParams):
        self._scheduler, self._pieces, self._req = scheduler, deque(), None
        self.result: Optional[GenerationResult] = None
        self._req = scheduler.add(Request(prompt_ids, params, on_text=self._pieces.append))  # ValueError: refused

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        req = self._req
        while not self._pieces:
            if req.finished or req.cancelled:
                if req.finished and req.error is None and self.result is None:
                    self.result = req.result()
                raise StopIteration
            try:
                self._scheduler.step()  # every running sequence moves on, this one among them
                req.drain()
            except BaseException:
                req.cancel()
                raise
        return self._pieces.popleft()

    def close(self) -> None:
        """Stop the completion (its slot is freed at the next engine step); the iteration ends."""
        self._pieces.clear()
        if self._req is not None and not self._req.finished:
            self._req.cancel()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
