"""``slake.generate``: compressed-cache generation through ``model.generate`` with timings and cache statistics."""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import get_layer_types_and_kwargs

from slake.budgets.budget import Budget
from slake.cache.chunked import check_chunkable, first_chunk_end
from slake.engines.context import check_context, context_limit
from slake.engines.result import GenerationResult
from slake.engines.transformers.attention import prepare_model
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.compile_options import (
    compile_kwargs,
    make_room_for_graphs,
    recompile_limit_error,
    uncompilable_reason,
)
from slake.engines.transformers.grad_mode import no_grad_here
from slake.engines.transformers.layer_layout import BOUNDED_TYPES, attention_layout, text_config
from slake.engines.transformers.python_options import check_count, check_generate_options
from slake.methods.base import Method
from slake.methods.profiles import resolve_method

#: ``model.generate`` options :func:`generate` sets whatever the checkpoint's ``generation_config`` says: one sequence
#: per prompt (no beam search, no ``num_return_sequences``), returned as a tensor, with no per-step scores or
#: hidden states: a checkpoint's ``generation_config`` asking for beam search, several sequences or a dict output
#: would otherwise change what :func:`generate` returns (or fail inside it).
PINNED_GENERATION: dict[str, Any] = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "return_dict_in_generate": False,
    "output_scores": False,
    "output_logits": False,
    "output_attentions": False,
    "output_hidden_states": False,
}


class _StepClock(LogitsProcessor):
    """Records the wall time of every sampling step (the first one marks the end of prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.is_cuda:
            torch.cuda.synchronize(scores.device)
        self.times.append(time.perf_counter())
        return scores


def format_prompt(tokenizer, prompt: str, chat_template: bool = True) -> str:
    """Wrap a user prompt in the tokenizer's chat template (a single user turn) when it has one."""
    if uses_chat_template(tokenizer, chat_template):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return prompt


def uses_chat_template(tokenizer, chat_template: bool = True) -> bool:
    """Whether :func:`format_prompt` wraps the prompt in the tokenizer's chat template: asked for, and the tokenizer
    has one. The text is then tokenised without the tokenizer's special tokens (the template writes its own, BOS
    included); a plain prompt gets them (``add_special_tokens=not uses_chat_template(...)``)."""
    return bool(chat_template and getattr(tokenizer, "chat_template", None))


def prefill_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded prompt, as ``model.generate`` computes them (padding gets 1)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


def prefill(
    model,
    cache: SlakeCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    prefill_chunk: int | None = None,
    trailing_tokens: int = 0,
) -> torch.Tensor:
    """Run a prompt through ``model`` into ``cache``, exactly or in chunks; return the last position's logits.

    Parameters
    ----------
    model
        A causal LM prepared with :func:`slake.prepare_model`.
    cache : SlakeCache
        An empty cache.
    input_ids, attention_mask : torch.Tensor
        ``(B, S)`` left-padded prompt (mask 1 = real token; all ones when None).
    prefill_chunk : int | None
        Chunk size; defaults to ``cache.prefill_chunk``. None, or a chunk of at least ``S`` tokens, is the exact
        prefill. Otherwise the first chunk is prefilled exactly and compressed (for a layer-preference method, whose
        layer split it sets, it reaches past the budget by a chunk: :func:`slake.cache.chunked.first_chunk_end`),
        and every later chunk attends over
        the compressed past (plus the linear term) and itself, after which each layer is evicted back to its budget
        with the method's scores from the chunk's last ``window`` queries
        (:meth:`slake.cache.compressed.CompressedKV.begin_chunked_prefill`). A method with a second pass over the
        prompt (KVzip) is prefilled exactly, scored by its pass, then compressed
        (:func:`slake.engines.transformers.reconstruction.prefill_with_second_pass`); it cannot be chunked.
    trailing_tokens : int
        Prompt tokens that the caller will feed as decode steps after this prefill of the rest (``slake.generate``
        feeds none since 2026-11-30: it prefills the whole prompt and ``model.generate`` continues from the logits
        returned). The budget and the compress decision count them, so that they are the whole prompt's, as in an
        exact prefill of it: a prompt of ``budget + 1`` tokens is compressed either way.

    Notes
    -----
    Called outside ``torch.inference_mode()`` it runs under ``torch.no_grad()``, so that a plain ``model.generate``
    (which runs under ``torch.no_grad()``) can continue the cache: inference tensors cannot be updated in place
    outside inference mode. Called inside it (``slake.generate``, ``slake bench``), it stays there, so that every
    tensor of the cache is an inference tensor, as those of the decode steps that follow (a compiled step guards on
    it).

    Returns
    -------
    torch.Tensor
        ``(B, vocab)`` float32 logits at the last prompt position (only that position's logits are computed). They
        also stay on the cache, once: a ``model.generate`` given exactly this prompt next continues from them (its
        prefill reads nothing again, and the first token comes from these logits); given more tokens (the prompt's
        last one, fed after ``trailing_tokens=1``), it reads those as usual.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"prefill needs a (batch, tokens) prompt of at least one token, got shape {tuple(input_ids.shape)} (a "
            f"one-token prompt has nothing to prefill before its last token: give it to model.generate directly)"
        )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    chunk = check_count("prefill_chunk", prefill_chunk, optional=True)
    if chunk is None:
        chunk = getattr(cache, "prefill_chunk", None)
    if trailing_tokens:
        cache.compressor.expect_trailing_prompt_tokens(trailing_tokens)
    if chunk is not None and chunk < input_ids.shape[1]:
        check_chunkable(cache.method)  # KVzip's second pass, SAGE-KV's one-shot selection
    if cache.method.second_pass is not None:
        from slake.engines.transformers.reconstruction import prefill_with_second_pass

        return _leave_for_generate(
            cache, prefill_with_second_pass(model, cache, input_ids, attention_mask), input_ids, attention_mask
        )
    S = input_ids.shape[1]
    pos = prefill_position_ids(attention_mask)
    with no_grad_here():
        if chunk is None or chunk >= S:
            cache.exact_prefill = True  # asked for (a chunk of at least the prompt): not the cache's prefill_chunk
            try:
                out = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=pos,
                    **with_cache(model, cache),
                    use_cache=True,
                    logits_to_keep=1,
                )
            finally:
                cache.exact_prefill = False
        else:
            cache.begin_chunked_prefill(attention_mask)
            first = first_chunk_end(cache.method, cache.compressor.budget, attention_mask == 0, chunk, trailing_tokens)
            try:
                for start, end in [(0, first)] + [(a, min(a + chunk, S)) for a in range(first, S, chunk)]:
                    out = model(
                        input_ids=input_ids[:, start:end],
                        attention_mask=attention_mask[:, :end],
                        position_ids=pos[:, start:end],
                        **with_cache(model, cache),
                        use_cache=True,
                        logits_to_keep=1,
                    )
            except BaseException:
                cache.end_chunked_prefill(check=False)  # the chunk's own error, not "ended early", reaches the caller
                raise
            cache.end_chunked_prefill()
    cache.check_routed()
    return _leave_for_generate(cache, out.logits[:, -1].float(), input_ids, attention_mask)


def _leave_for_generate(
    cache: SlakeCache, logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """``logits``, with a copy left on ``cache`` for a ``model.generate`` of exactly this prompt
    (:func:`slake.engines.transformers.attention._handed_over`): a caller who edits the returned tensor changes
    nothing there."""
    cache.prefilled_logits = logits.clone()
    cache.prefilled_input = (input_ids.clone(), attention_mask.clone())
    return logits


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """End-of-sequence ids from the tokenizer and the model's generation config."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(gen, "eos_token_id", None)):
        for i in src if isinstance(src, (list, tuple)) else [src]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def generate(
    model,
    tokenizer,
    prompt: str | list[str],
    *,
    method: str | Method = "snapkv",
    budget: int | float | str = 128,
    max_new_tokens: int = 64,
    chat_template: bool = True,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    charge_linear_state: bool = False,
    prefill_chunk: int | None = None,
    allow_long_context: bool = False,
    kv_dtype: str | None = None,
    compile: bool = False,
    kernels: str = "auto",
    **hyperparameters,
) -> GenerationResult:
    """Generate with a compressed KV cache.

    Parameters
    ----------
    model, tokenizer
        From :func:`slake.load_model` (or any transformers causal LM of a supported architecture).
    prompt : str | list[str]
        One prompt or a batch (left-padded).
    method : str | Method
        Compression method name (``slake methods``) or object.
    budget : int | float | str
        Average cached tokens per layer and KV head, window included; or a ratio in (0, 1).
    max_new_tokens : int
        Tokens to generate at most (stops at EOS).
    chat_template : bool
        Wrap each prompt in the model's chat template as one user turn.
    do_sample, temperature, top_p, top_k, seed
        Sampling options (greedy by default).
    charge_linear_state : bool
        Charge SLAKE's linear state against the budget.
    prefill_chunk : int | None
        Prefill the whole prompt in chunks of this many tokens, compressing after each chunk (bounded prefill
        memory; see :func:`prefill`); ``model.generate`` then takes the first token from the last chunk's logits, as
        ``slake eval`` and ``slake bench`` do. None (default), or a chunk of at least the prompt: exact prefill.
    allow_long_context : bool
        Run even when the prompt plus ``max_new_tokens`` exceeds the model's context (``max_position_embeddings``);
        by default that raises ValueError, because the answer degrades silently past the trained positions.
    kv_dtype : str | None
        ``"int8"`` or ``"fp8_e4m3"``: store the kept keys and values in 8 bits (:mod:`slake.cache.quant`);
        None (default): the model's dtype.
    compile : bool
        Decode with fixed shapes and no host read-back (a ``SlakeCache`` with ``max_cache_len``) and run every decode
        step as one compiled graph (transformers' ``compile_config``: ``torch.compile(fullgraph=True)``, CUDA graphs
        on CUDA; ``docs/compile.md``). The first decode step compiles (seconds to minutes): its time is
        ``result.extra["compile_s"]``, left out of ``decode_ms_per_token``; a method that cannot decode with fixed
        shapes raises ValueError.
    kernels : str
        The decode step's implementation (:class:`SlakeCache`'s ``kernels``): ``"auto"``, ``"torch"`` or
        ``"triton"``; ``result.extra["kernels"]`` says which ran (``SlakeCache.statistics()["kernels"]``, e.g.
        ``"triton"``, ``"sdpa"`` for an uncompressed prompt's eager steps, ``"torch (fallback: why)"``).
    **hyperparameters
        Method hyperparameter overrides (e.g. ``window=16``). Hyperparameters that are not set here, in the method
        spec or on a Method object come from the model's profile when one matches (:mod:`slake.methods.profiles`: a
        ``slake calibrate`` result, the default model's shipped profile, or the papers' tables).

    Returns
    -------
    GenerationResult
        Generation stops at any of :func:`eos_token_ids` (the tokenizer's and the generation config's);
        ``new_tokens`` counts each row up to its first. ``decode_ms_per_token`` is 0.0 when no decode step was timed
        (one new token, or two with ``compile``). ``kv_bytes["full"]`` is what an uncompressed cache would hold at
        the end: each row's prompt tokens and the generated tokens fed back after them, every step but the last
        (whose token is never fed back), padding after a row's early end token included, as plain transformers holds
        them, but for the left padding of a batch's shorter prompts (plain transformers holds it too): the same real
        tokens the compressed cache is counted for. ``extra["kv_dtype"]``: the kept entries' 8-bit storage, when
        ``kv_dtype`` was given.

    Raises
    ------
    ValueError
        Before the model runs, for an empty prompt or one that is not a string or a list of strings, an option of
        the wrong type or out of range
        (:func:`~slake.engines.transformers.python_options.check_generate_options`), a sequence past the model's
        context (unless ``allow_long_context``), or one that outgrows the window of a model whose every layer slides
        (:func:`check_sliding_window`), or with ``compile`` a model whose step cannot be compiled (quantized by a
        method torch.compile does not take, or offloaded by accelerate: :func:`refuse_uncompilable`).

    Notes
    -----
    The prompts are padded on the left (with the tokenizer's end token where it has no padding token) without
    changing the tokenizer (:func:`left_padded`): several threads may share it.

    The model's ``generation_config`` supplies what these options leave open (its end tokens, a repetition penalty),
    but not the search or the output (:data:`PINNED_GENERATION`): one greedy or sampled sequence per prompt, even
    where a checkpoint asks for beam search, several sequences or a dict output. Beam search over a ``SlakeCache`` is
    ``model.generate(..., num_beams=n)`` with the cache.
    """
    if not isinstance(prompt, (str, list, tuple)) or any(not isinstance(p, str) for p in prompt):
        raise ValueError(f"the prompt must be a string or a list of strings, got {_kind_of(prompt)}")
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts or any(not p.strip() for p in prompts):
        raise ValueError("the prompt is empty")
    check_generate_options(
        max_new_tokens=max_new_tokens,
        chat_template=chat_template,
        do_sample=do_sample,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        charge_linear_state=charge_linear_state,
        prefill_chunk=prefill_chunk,
        allow_long_context=allow_long_context,
        compile=compile,
    )
    if compile:
        refuse_uncompilable(model)
    budget_obj = Budget(budget)
    m, profile = resolve_method(method, budget_obj, model, **hyperparameters)
    prepare_model(model)
    texts = [format_prompt(tokenizer, p, chat_template) for p in prompts]
    enc, pad_token_id = left_padded(
        tokenizer, texts, add_special_tokens=not uses_chat_template(tokenizer, chat_template)
    )
    enc = {k: v.to(model.device) for k, v in enc.items()}
    prompt_lens = enc["attention_mask"].sum(-1).tolist()
    if min(prompt_lens) == 0:
        raise ValueError("the prompt is empty after tokenisation")
    check_context_length(model, enc["input_ids"].shape[1], max_new_tokens, allow_long_context)
    check_sliding_window(model.config, enc["input_ids"].shape[1], max_new_tokens)
    max_len = enc["input_ids"].shape[1] + max_new_tokens + 1 if compile else None
    cache = SlakeCache(
        m,
        budget_obj,
        config=model.config,
        charge_linear_state=charge_linear_state,
        prefill_chunk=prefill_chunk,
        kv_dtype=kv_dtype,
        max_cache_len=max_len,
        kernels=kernels,
    )
    cache.compressor.expect_decode_steps(max_new_tokens)  # an append-only layer holds room for these, not 256
    chunked = prefill_chunk is not None and prefill_chunk < enc["input_ids"].shape[1]
    if not chunked:
        cache.prefill_chunk = None  # the prompt fits one chunk: model.generate prefills it whole, as asked
    second_pass = m.second_pass is not None  # prefilled here, its pass between the prompt and the first token
    if second_pass:
        from slake.engines.transformers.reconstruction import ReconstructionPrompt

        cache.reconstruction = ReconstructionPrompt.from_tokenizer(tokenizer)
    clock = _StepClock()
    ends = eos_token_ids(model, tokenizer)
    gen_kwargs: dict = {
        "max_new_tokens": max_new_tokens,
        "do_sample": do_sample,
        "pad_token_id": pad_token_id,
        "eos_token_id": ends or None,  # stop on every end token that ends the count below
        # a checkpoint's generation_config may ask for its own cache (cache_implementation="static", ...), which
        # transformers refuses beside a cache object, or for none (use_cache=False): the SlakeCache is the cache
        "cache_implementation": None,
        "use_cache": True,
        # nor its own chunked prefill (prefill_chunk_size), which a SlakeCache would take for turns: slake's own
        # is prefill_chunk (below)
        "prefill_chunk_size": None,
        # nor another search or output (:data:`PINNED_GENERATION`): one greedy or sampled sequence per prompt, as
        # documented and counted below
        **PINNED_GENERATION,
    }
    if compile:
        gen_kwargs["compile_config"] = compile_config(model.device)
        make_room_for_graphs()  # one graph per cache shape: dynamo's default of 8 would fail the ninth of a process
    else:
        gen_kwargs["disable_compile"] = True  # never compiled behind the user's back
    if do_sample:
        gen_kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
        if seed is not None:
            torch.manual_seed(seed)
    else:
        gen_kwargs.update(temperature=None, top_p=None, top_k=None)
    start = time.perf_counter()
    # inside inference mode, as model.generate below: every tensor of the cache an inference tensor (a compiled step
    # guards on it)
    with torch.inference_mode():
        if second_pass or chunked:
            # the whole prompt here (exactly, then the pass and the compression; or in chunks), and model.generate
            # chooses the first token from the prefill's last logits, as slake eval and slake bench do
            prefill(model, cache, enc["input_ids"], enc["attention_mask"], prefill_chunk=prefill_chunk)
    with torch.inference_mode():
        processors = LogitsProcessorList([clock])
        try:
            out = model.generate(**enc, **with_cache(model, cache), logits_processor=processors, **gen_kwargs)
        except Exception as exc:
            explained = recompile_limit_error(exc) if compile else None
            if explained is not None:
                raise explained from exc
            raise
    end = time.perf_counter()
    cache.check_routed()
    new = out[:, enc["input_ids"].shape[1] :]
    new_counts = _count_new_tokens(new, ends)
    decoded = [tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(new, new_counts)]
    stats = cache.statistics()
    prefill_s = (clock.times[0] - start) if clock.times else end - start
    # compiled: the first decode step traces and compiles it (seconds to minutes), reported apart as compile_s and
    # left out of the decode time, as slake bench does
    first = 1 if compile and len(clock.times) > 1 else 0
    steps = len(clock.times) - 1 - first
    decode_ms = ((end - clock.times[first]) / steps * 1e3) if steps > 0 else 0.0
    # as the cache's report says it (compiled: each layer's plan, worked out before the steps were captured)
    ran = stats["kernels"]
    # the text decoder's shapes: a multimodal config (Gemma3Config) keeps them in its text part
    cfg = text_config(model.config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads  # None: multi-head attention
    # what an uncompressed cache would hold at the end: in each compressed layer, every prompt token and every
    # generated token fed back, which is all of a row's steps but the last (a row that ended early is fed its end
    # token and then padding, as plain transformers does); the sliding layers of a hybrid model as they are
    # (bounded by their window in either cache)
    fed = max(new.shape[1] - 1, 0)
    full_bytes = (
        2
        * len(cache.layout.compressed)
        * kv_heads
        * head_dim
        * model.dtype.itemsize
        * sum(p + fed for p in prompt_lens)
    )
    kv_bytes = {"full": int(full_bytes) + stats["kv_bytes"].get("sliding", 0), **stats["kv_bytes"]}
    return GenerationResult(
        texts=[t.strip() for t in decoded],
        prompt_tokens=[int(p) for p in prompt_lens],
        new_tokens=new_counts,
        method=m.name,
        budget=budget_obj.value,
        kv_bytes=kv_bytes,
        kept_tokens_per_layer=stats["kept_tokens_per_layer"],
        compressed=stats["compressed"],
        prefill_s=prefill_s,
        decode_ms_per_token=decode_ms,
        layer_budgets=stats["layer_budgets"],
        sequences=out,
        hyperparameters=m.hyperparameters(),
        profile=profile,
        extra={"kernels": ran}
        | ({"kv_dtype": stats["kv_dtype"]} if stats.get("kv_dtype") else {})
        | ({"compile_s": round(clock.times[1] - clock.times[0], 5)} if first else {})
        | ({} if cache.second_pass_s is None else {"second_pass_s": round(cache.second_pass_s, 5)}),
    )


def refuse_uncompilable(model: Any) -> None:
    """Raise ValueError when ``model``'s decode step cannot be compiled
    (:func:`~slake.engines.transformers.compile_options.uncompilable_reason`): transformers would decode it eagerly
    with a warning, and the run would be reported as compiled."""
    why = uncompilable_reason(model)
    if why is not None:
        raise ValueError(f"compiled decoding cannot compile this model's step: {why}; decode it without compile")


def compile_config(device: torch.device, *, lean_guards: bool = True):
    """transformers' ``CompileConfig`` for compiled decoding with a static ``SlakeCache``: one graph per step
    (``fullgraph=True``), fixed shapes, CUDA graphs on CUDA (``mode="reduce-overhead"``), the guards on the model's
    modules left out unless ``lean_guards=False``
    (:func:`~slake.engines.transformers.compile_options.compile_kwargs`: a compiled step then assumes the model's
    modules do not change while it is used), and allowed on CPU."""
    from transformers import CompileConfig

    kwargs = compile_kwargs(device, lean_guards=lean_guards)
    cfg = CompileConfig(fullgraph=kwargs["fullgraph"], dynamic=kwargs["dynamic"], options=kwargs.get("options"))
    # None where the options carry the mode's settings: torch.compile takes a mode or options, not both
    cfg.mode = kwargs.get("mode")  # type: ignore[assignment]
    setattr(cfg, "_compile_all_devices", True)  # noqa: B010 (typed None in transformers); CUDA only unless asked
    return cfg


def left_padded(tokenizer: Any, texts: list[str], *, add_special_tokens: bool) -> tuple[dict, int | None]:
    """``texts`` tokenised one by one and padded on the left to the longest, with the tokenizer's padding token (its
    end token where it has none); returns ``{"input_ids", "attention_mask"}`` (``(B, S)`` tensors) and the padding id.

    The tokenizer is only called, never changed: setting its ``padding_side`` and lending it a padding token for the
    call (as before 2026-11-30) raced with other threads using the same tokenizer, which then padded on the right or
    found no padding token, and a concurrent ``slake.generate`` failed on its own padding.

    Raises
    ------
    ValueError
        Prompts of different lengths and a tokenizer with neither a padding nor an end token.
    """
    rows = [
        torch.as_tensor(
            tokenizer([t], return_tensors="pt", padding=False, add_special_tokens=add_special_tokens)["input_ids"][0]
        ).view(-1)
        for t in texts
    ]
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    width = max(len(r) for r in rows)
    if pad is None and any(len(r) < width for r in rows):
        raise ValueError(
            "the prompts have different lengths and the tokenizer has neither a padding token nor an end token to "
            "pad them with: set tokenizer.pad_token, or give the prompts one at a time"
        )
    ids = torch.full((len(rows), width), 0 if pad is None else int(pad), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r) :] = r
            mask[i, width - len(r) :] = 1
    return {"input_ids": ids, "attention_mask": mask}, pad


def _kind_of(value: Any) -> str:
    """``int``, or ``a list holding int`` for a sequence with a non-string item."""
    if isinstance(value, (list, tuple)):
        bad = next((p for p in value if not isinstance(p, str)), None)
        return f"a {type(value).__name__} holding {type(bad).__name__}"
    return type(value).__name__


def check_sliding_window(config: Any, prompt_tokens: int, max_new_tokens: int) -> None:
    """Raise ValueError, before any work, when every attention layer of the model is bounded (a sliding window or
    a chunk: Mistral or Phi-3 with ``sliding_window`` set) and the sequence would outgrow the window.

    Such a model has no full-attention layer to compress, so slake compresses its layers as full layers while the
    sequence fits in the window, where the two are the same, and the attention function refuses a longer one
    (:mod:`slake.engines.transformers.attention`). That refusal comes at the step that crosses the window, after the
    prefill and the decode steps before it, and their output is lost; this check raises the same refusal up front.

    Parameters
    ----------
    config
        The model's config (a multimodal config's text part is read).
    prompt_tokens : int
        The prompt's length, padding included (the cache holds the padded prompt).
    max_new_tokens : int
        Tokens to generate at most. The cache ends with ``prompt_tokens + max_new_tokens - 1`` tokens (the last new
        token is never fed back), the length the attention function checks against the window; a run that stops
        early at an end token is refused all the same, as its length is not known before it runs.
    """
    layer_types = attention_layout(config).layer_types
    if not layer_types or any(t not in BOUNDED_TYPES for t in layer_types):
        return  # a full layer to compress: the bounded layers keep transformers' own caches, any length
    _, kwargs = get_layer_types_and_kwargs(text_config(config))
    per_layer = [kwargs] * len(layer_types) if isinstance(kwargs, dict) else list(kwargs)  # 5.17: one dict for all
    windows = [w for kw in per_layer if isinstance(w := kw.get("sliding_window"), int) and w > 0]
    if not windows:
        return
    window = min(windows)
    cached = prompt_tokens + max_new_tokens - 1
    if cached > window:
        kind = "sliding-window" if "sliding_attention" in layer_types else "chunked"
        raise ValueError(
            f"every layer of this model uses {kind} attention ({window} tokens) and the sequence would be longer "
            f"({prompt_tokens} prompt tokens + max_new_tokens={max_new_tokens} - 1 = {cached}); slake compresses "
            f"full-attention layers only, and the model has none: shorten the prompt or max_new_tokens so that the "
            f"prompt plus max_new_tokens - 1 fits in {window} tokens"
        )


def check_context_length(model, prompt_tokens: int, max_new_tokens: int, allow_long_context: bool = False) -> None:
    """Raise ValueError when ``prompt_tokens + max_new_tokens`` exceeds the model's ``max_position_embeddings``
    (unless ``allow_long_context``); models without that field pass (:func:`slake.engines.context.check_context`)."""
    check_context(context_limit(model.config), prompt_tokens, max_new_tokens, allow_long_context=allow_long_context)


def _count_new_tokens(new: torch.Tensor, eos_ids: list[int]) -> list[int]:
    """Tokens each row generated, up to and including its first end token (``eos_ids``, every id that stops
    ``model.generate``: :func:`eos_token_ids`); the padding after it is not counted (a pad id that is no end token
    is counted only before the row's end, where the model generated it)."""
    ends = set(eos_ids)
    counts = []
    for row in new.tolist():
        n = len(row)
        for i, tok in enumerate(row):
            if tok in ends:
                n = i + 1
                break
        counts.append(n)
    return counts
