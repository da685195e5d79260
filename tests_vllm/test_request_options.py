"""A request that names slake options of its own (``SamplingParams.extra_args``, the OpenAI server's ``vllm_xargs``)
is refused at admission with one ``slake:`` line; it was answered at the engine's configuration (or uncompressed on
a plain engine) with nothing said (docs/vllm.md, "Configuration")."""

from __future__ import annotations

import pytest

from conftest import BUDGET
from slake.engines.vllm.plugin.requests import refusal, slake_keys
from slake.engines.vllm.runner import engine_kwargs


@pytest.mark.parametrize(
    "extra, keys",
    [
        ({"slake": {"method": "h2o"}}, ["slake"]),
        ({"SLAKE": "x", "slake_budget": 64, "temperature_boost": 1}, ["SLAKE", "slake_budget"]),
        ({"slake.method": "tova"}, ["slake.method"]),
        ({"slakey": 1, "kv_transfer_params": {}}, []),
        (None, []),
        ("slake", []),
    ],
)
def test_slake_keys(extra, keys):
    assert slake_keys(extra) == keys


def test_the_check_runs_before_vllms_own_validation():
    """The wrapped ``_validate_params`` refuses before it reads anything of the input processor, once however often
    vLLM loads the plugin."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    from slake.engines.vllm import plugin

    plugin.register()
    plugin.register()
    wrapped = InputProcessor._validate_params
    assert getattr(wrapped, "_slake", False) and not getattr(wrapped.__wrapped__, "_slake", False)
    with pytest.raises(VLLMValidationError, match="per engine") as err:
        wrapped(None, SamplingParams(extra_args={"slake": {"budget": 32}}), ("generate",))
    assert str(err.value).startswith(refusal(["slake"]))


def _generate(llm, prompt: list[int], extra_args: dict | None) -> list[int]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False, extra_args=extra_args)
    return list(llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids)


@pytest.mark.parametrize("slake", [{"method": "snapkv", "budget": BUDGET}, None], ids=["snapkv-engine", "plain"])
def test_a_request_with_slake_options_is_refused(tiny_dir, prompts, slake):
    """On a slake engine and on a plain one: the request with a ``slake`` entry raises before it runs; the same
    prompt with other extra_args, or none, is served as before."""
    from vllm import LLM
    from vllm.exceptions import VLLMValidationError

    llm = LLM(**engine_kwargs(tiny_dir, slake=slake, block_size=32, dtype="float32", max_model_len=512))
    prompt = prompts[0]
    with pytest.raises(VLLMValidationError, match=r"^slake: a request cannot choose its own slake options"):
        _generate(llm, prompt, {"slake": {"method": "h2o", "budget": 16}})
    plain = _generate(llm, prompt, None)
    assert len(plain) == 4 and _generate(llm, prompt, {"unrelated": 1}) == plain
    if slake is not None:  # beam search ran as plain vLLM's on a slake engine, without a word (2026-11-30)
        from vllm.sampling_params import BeamSearchParams

        with pytest.raises(ValueError, match=r"^slake: beam search is not compressed"):
            llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=2))


@pytest.mark.parametrize("configured", [True, False])
def test_online_beam_search_is_refused_on_a_slake_engine_only(monkeypatch, configured):
    """The OpenAI server's ``use_beam_search``: refused before its first step on a slake engine; a plain engine's
    reaches vLLM's own beam search (which fails here on the fake server's missing parts)."""
    import asyncio
    from types import SimpleNamespace

    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
    from vllm.exceptions import VLLMValidationError

    from slake.engines.vllm import plugin

    monkeypatch.delenv("SLAKE_VLLM", raising=False)
    plugin.register()
    search = BeamSearchOnlineMixin.beam_search
    assert getattr(search, "_slake", False) and not getattr(search.__wrapped__, "_slake", False)
    config = {"slake": {"method": "snapkv", "budget": BUDGET} if configured else None}
    server = SimpleNamespace(engine_client=SimpleNamespace(vllm_config=SimpleNamespace(additional_config=config)))

    async def first_output():
        return await search(server, prompt=None, request_id="r", params=None).__anext__()

    with pytest.raises(VLLMValidationError if configured else AttributeError) as err:
        asyncio.run(first_output())
    assert str(err.value).startswith("slake: beam search is not compressed") == configured
