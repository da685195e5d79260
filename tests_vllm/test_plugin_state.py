"""The plugin keeps its state in the objects vLLM makes per engine, none in its modules: two engines with different
slake configurations in one process each give their own results."""

from __future__ import annotations
import __future__

import ast
import enum
import importlib
import inspect
import logging
import pkgutil
import re
import types
from dataclasses import fields, is_dataclass

from conftest import BUDGET, hf_generate
from slake.engines.vllm.runner import engine_kwargs

#: module-level caches of constant values, shared by engines harmlessly: (module, name) -> why
EXEMPT: dict[tuple[str, str], str] = {}


def _immutable(value: object) -> bool:
    """True for a value that nobody can change in place: constants, immutable containers of such, frozen
    dataclasses, and definitions (modules, classes, functions, loggers)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, re.Pattern, enum.Enum)):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_immutable(v) for v in value)
    if isinstance(value, types.MappingProxyType):
        return all(_immutable(k) and _immutable(v) for k, v in value.items())
    if is_dataclass(value) and not isinstance(value, type):
        return bool(type(value).__dataclass_params__.frozen) and all(  # type: ignore[attr-defined]
            _immutable(getattr(value, f.name)) for f in fields(value)
        )
    if isinstance(value, logging.Logger):  # vLLM's loggers, as every vLLM module has one
        return True
    if value is __future__.annotations or hasattr(value, "__origin__"):  # a type alias such as Callable[..., T]
        return True
    return inspect.ismodule(value) or inspect.isclass(value) or inspect.isroutine(value)


def _vllm_modules() -> list[types.ModuleType]:
    """Every module of the vLLM engine package: the plugin vLLM loads and the driver that starts vLLM."""
    import slake.engines.vllm as package

    names = [package.__name__] + [
        m.name for m in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + ".")
    ]
    return [importlib.import_module(n) for n in names]


def test_the_plugin_and_driver_modules_hold_no_mutable_state():
    modules = _vllm_modules()
    assert "slake.engines.vllm.plugin.backend" in {m.__name__ for m in modules}
    mutable = [
        f"{m.__name__}.{name} ({type(value).__name__})"
        for m in modules
        for name, value in vars(m).items()
        if not (name.startswith("__") and name.endswith("__"))
        and (m.__name__, name) not in EXEMPT
        and not _immutable(value)
    ]
    assert not mutable, f"mutable module-level state: {mutable}"
    rebinds = [
        f"{m.__name__}: global {', '.join(node.names)}"
        for m in modules
        for node in ast.walk(ast.parse(inspect.getsource(m)))
        if isinstance(node, ast.Global)
    ]
    assert not rebinds, f"module globals rebound at run time: {rebinds}"


def test_the_check_sees_mutable_state():
    """The check above would catch what the plugin used to hold (a registry dict, a flag rebound by ``global``)."""
    assert not _immutable({}) and not _immutable([]) and not _immutable(object())
    assert not _immutable((1, [2])) and not _immutable(types.MappingProxyType({"a": []}))
    assert _immutable(("snapkv", 1)) and _immutable(types.MappingProxyType({"fp32": "float32"}))


def _tokens(llm, prompt: list[int], n: int) -> list[int]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
    return list(llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids)


def test_two_engines_with_different_configurations_in_one_process(tiny_dir, prompts):
    """Three engines alive at once, used in turn: SnapKV, SLAKE and plain vLLM each give their own tokens (the
    transformers engine's for the same method and budget), and each engine's state is its own."""
    from vllm import LLM

    from slake.engines.vllm.plugin import worker

    def engine(slake: dict | None) -> LLM:
        return LLM(**engine_kwargs(tiny_dir, slake=slake, block_size=32, dtype="float32", max_model_len=512))

    snapkv = engine({"method": "snapkv", "budget": BUDGET})
    slake = engine({"method": "slake", "budget": BUDGET})
    plain = engine(None)
    prompt, n = prompts[0], 12
    assert len(prompt) > BUDGET
    first = _tokens(snapkv, prompt, n)
    assert _tokens(slake, prompt, n) == hf_generate(tiny_dir, prompt, "slake", BUDGET, n)
    assert _tokens(plain, prompt, n) == hf_generate(tiny_dir, prompt, None, BUDGET, n)
    assert first == _tokens(snapkv, prompt, n) == hf_generate(tiny_dir, prompt, "snapkv", BUDGET, n)
    reports = [llm.collective_rpc(worker.report)[0] for llm in (snapkv, slake, plain)]
    assert [r["method"] for r in reports[:2]] == ["snapkv", "slake"] and reports[2] is None
    assert reports[0]["pool_rows"] >= 1 and reports[1]["pool_rows"] >= 1


def test_the_runner_hook_wraps_one_method_once():
    """The only runner method the plugin wraps is ``_update_states``, once however often vLLM loads the plugin."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from slake.engines.vllm import plugin

    plugin.register()
    plugin.register()
    wrapped = GPUModelRunner._update_states
    assert getattr(wrapped, "_slake", False) and not getattr(wrapped.__wrapped__, "_slake", False)
