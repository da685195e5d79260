"""Per-model hyperparameter profiles: tuned VABS ``(alpha, beta)`` and CAKE ``(tau1, tau2)`` by model and budget.

The SLAKE and CAKE papers tune these exponents per model and budget (SLAKE Table 3, CAKE's ``model2tau.json``) and
give them for a handful of 7-8B models only. ``slake calibrate`` (:mod:`slake.quality.calibrate`) finds them for any
model and writes a profile; this module finds the profile that matches a model and applies it.

Where a method's hyperparameters come from, first match wins:

1. values the user sets (a spec ``slake[alpha=0.3]``, ``--set``, keyword arguments, or a built
   :class:`~slake.methods.base.Method`, which is used as given, with keyword overrides checked as
   :func:`~slake.methods.base.make_method` checks them);
2. a user profile: ``$SLAKE_PROFILE_DIR/<model>.json``, by default ``~/.cache/slake/profiles/<model>.json``
   (written by ``slake calibrate``);
3. a profile shipped with the package (``slake/profile_data/<model>.json``: one per packaged model);
4. the papers' tables for the models they tuned (SLAKE Table 3 for ``slake``, CAKE's reference values for ``cake``);
5. the method's own defaults.

``SLAKE_NO_PROFILE=1`` in the environment skips 2 and 3 (no profile file is read), for runs that must use the
papers' values or the defaults on a model that has a profile.

A profile entry applies to a (method, budget) when the method's name is the entry's, the entry's budget is the
nearest calibrated budget within a factor of 2 (token budgets and ratios are matched separately), and every other
hyperparameter of the method equals the value it was calibrated with (a profile calibrated for
``slake[vabs_split=window]`` does not silently apply to ``slake[linear_cache=false]``; a hyperparameter the entry's
context does not record counts as calibrated at the method's default; a cap on a layer's budget, ``max_layer_budget``,
is not matched: it bounds whatever the profile gives, as vLLM's plugin caps after resolving). A model matches a profile
when its name (normalised: lower case, alphanumerics, hub organisation dropped) is one of the profile's names and
its architecture fingerprint (layers, heads, sizes, vocabulary) is the profile's. A model named by a local path is
matched by its folder's name, so a fine-tune saved under its base's name finds the base's profile; a profile
calibrated on that very path comes first, ``slake calibrate`` on another folder of the same name (two runs'
``checkpoint-500``) writes a file of its own rather than into the other's, and running with another folder's
profile is logged once.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Iterator
from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger("slake")
#: (model, method spec, budget) already told that they run on the method's default values (one notice each)
_TOLD_DEFAULTS: set[tuple[str, str, int | float]] = set()
#: whether :func:`resolve_method` keeps that notice to itself (:func:`defaults_untold`)
_UNTOLD: contextvars.ContextVar[bool] = contextvars.ContextVar("slake_defaults_untold", default=False)
#: (model path, profile file) pairs already told that the profile was calibrated on another folder of the same name
_TOLD_OTHER_FOLDER: set[tuple[str, str]] = set()

__all__ = [
    "PROFILE_FORMAT",
    "SEARCHED",
    "searched_hyperparameters",
    "model_identity",
    "normalise_name",
    "profile_dir",
    "profile_path",
    "profiles_disabled",
    "load_profiles",
    "find_entry",
    "resolve_method",
    "defaults_untold",
    "write_entry",
]

PROFILE_FORMAT = 1
#: hyperparameters a profile may set, per method
SEARCHED: dict[str, tuple[str, ...]] = {"slake": ("alpha", "beta"), "cake": ("tau1", "tau2")}
_FINGERPRINT_KEYS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)


def normalise_name(name: str) -> str:
    """``"HuggingFaceTB/SmolLM2-135M-Instruct"`` -> ``"smollm2135minstruct"``; a path that ends in ``.`` or ``..``
    (a model run from inside its folder: ``--model .``) is named by the folder it stands for, which was ``""``
    and matched no profile, not even the one calibrate had just written."""
    last = str(name).rstrip("/").rsplit("/", 1)[-1]
    if last in (".", "..") or (not last and str(name)):
        last = os.path.basename(os.path.abspath(os.path.expanduser(str(name))))
    return re.sub(r"[^a-z0-9]", "", last.lower())


def model_identity(model_or_config: Any) -> dict:
    """``{"name", "fingerprint"}`` of a model or its config.

    The name is ``config.slake_model_name`` (set by :func:`slake.load_model`: ``"smollm2"`` for the default model,
    otherwise the name it was given), else ``config._name_or_path``.
    """
    config = getattr(model_or_config, "config", model_or_config)
    name = getattr(config, "slake_model_name", None) or getattr(config, "_name_or_path", "") or ""
    fp = {k: getattr(config, k, None) for k in _FINGERPRINT_KEYS}
    if fp["num_key_value_heads"] is None:
        fp["num_key_value_heads"] = fp["num_attention_heads"]
    return {"name": str(name), "fingerprint": fp}


def profile_dir() -> Path:
    """The user profile folder: ``$SLAKE_PROFILE_DIR``, else ``~/.cache/slake/profiles``."""
    env = os.environ.get("SLAKE_PROFILE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "slake" / "profiles"


def profiles_disabled() -> bool:
    """Whether ``$SLAKE_NO_PROFILE`` is set (to anything but ``""`` or ``"0"``): then no profile file applies."""
    return os.environ.get("SLAKE_NO_PROFILE", "") not in ("", "0")


def _shipped_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "profile_data"


def profile_path(identity: dict, folder: Path | None = None) -> Path:
    """Where the profile of a model lives: ``<folder>/<normalised name>.json``."""
    stem = normalise_name(identity["name"]) or "model"
    return (folder or profile_dir()) / f"{stem}.json"


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"unreadable slake profile {path}: {e}") from e
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path} is not a slake profile (format {PROFILE_FORMAT}); delete it or run slake calibrate")
    return data


def _matches(profile: dict, identity: dict) -> bool:
    names = {normalise_name(n) for n in [profile.get("model", "")] + list(profile.get("aliases", []))}
    return normalise_name(identity["name"]) in names and profile.get("fingerprint") == identity["fingerprint"]


def _local_path(name: str) -> str | None:
    """The absolute path of a model named by a local path, None for a hub id or a packaged model's name: as
    :func:`slake.engines.transformers.models.looks_local` tells them apart (``/...``, ``./...``, ``~/...``, more than
    one ``/``), or a name that is a model folder here (with a ``config.json``) or a ``.gguf`` file (an ``--out``
    folder named ``smollm2`` does not make the packaged model a local one)."""
    name = str(name)
    expanded = os.path.expanduser(name)
    looks_local = name.startswith(("/", ".", "~")) or (os.sep != "/" and os.sep in name) or name.count("/") > 1
    is_model = os.path.isfile(os.path.join(expanded, "config.json")) or (
        name.lower().endswith(".gguf") and os.path.isfile(expanded)
    )
    return os.path.abspath(expanded) if name and (looks_local or is_model) else None


def _calibrated_on(profile: dict, identity: dict) -> bool:
    """Whether ``profile`` was calibrated on the model at ``identity``'s own local path."""
    mine = _local_path(identity["name"])
    return mine is not None and _local_path(profile.get("model", "")) == mine


def load_profiles(identity: dict) -> list[tuple[str, dict]]:
    """``[(source, profile)]`` matching the model: the user's first (a profile calibrated on the model's own local
    path before one calibrated on another folder of the same name), then the shipped one (none under
    ``$SLAKE_NO_PROFILE``)."""
    if profiles_disabled():
        return []
    out = []
    for source, folder in (("user", profile_dir()), ("shipped", _shipped_dir())):
        found = [(f"{source}:{path}", data) for path, data in _profiles_in(folder) if _matches(data, identity)]
        found.sort(key=lambda item: not _calibrated_on(item[1], identity))  # stable: file order otherwise
        out += found
    return out


def _profiles_in(folder: Path) -> list[tuple[Path, dict]]:
    """Every slake profile in ``folder``, in file-name order."""
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        data = _read(path)
        if data is not None:
            out.append((path, data))
    return out


def _budget_distance(a: float, b: float) -> float:
    return abs(math.log(a) - math.log(b))


#: hyperparameters a profile entry never matches on: a cap on a layer's budget bounds memory, applied to whatever the
#: profile gives (vLLM's plugin adds its cap after resolving the profile, so both engines must resolve alike)
_NOT_MATCHED = frozenset({"max_layer_budget"})


def _defaults(method: Any) -> dict[str, Any]:
    """The hyperparameters of ``method``'s class at their defaults (those without a default left out)."""
    out = {}
    for f in fields(method):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def searched_hyperparameters(method: Any) -> tuple[str, ...]:
    """The hyperparameters of ``method`` (a built Method) that a profile sets (:data:`SEARCHED`) and that it reads:
    none for SLAKE without VABS (``vabs=False``), whose layers' budgets follow CAKE's preference, not alpha and beta
    (it was told that it ran on the default alpha and beta, and to calibrate them, which ``slake calibrate``
    refuses)."""
    if method.name == "slake" and not getattr(method, "vabs", True):
        return ()
    return SEARCHED.get(method.name, ())


def find_entry(profiles: list[tuple[str, dict]], method: Any, budget: int | float) -> tuple[str, dict] | None:
    """The first profile entry that applies to ``method`` (a built Method) at ``budget``, with its source."""
    searched = SEARCHED.get(method.name)
    if not searched:
        return None
    for source, prof in profiles:
        near = _entries_near(prof, method, budget)
        cands = [(d, b, -i, e) for i, (d, b, e, differs) in enumerate(near) if not differs]
        if cands:  # the nearest budget, the lower of two as near, the latest written of equals
            return source, min(cands, key=lambda c: c[:3])[3]
    return None


def _entries_near(profile: dict, method: Any, budget: int | float) -> list[tuple[float, float, dict, dict]]:
    """``(distance, budget, entry, differs)`` for each of ``profile``'s entries for ``method``'s name within a factor
    of 2 of ``budget`` (token budgets and ratios apart), ``differs`` the hyperparameters the entry was calibrated
    with where ``method`` sets another value (empty: the entry applies). A key the entry's context lacks was calibrated
    at the method's default (profiles written before the hyperparameter existed): a variant that sets it otherwise
    is not what the entry was calibrated for."""
    hyper = method.hyperparameters()
    defaults = _defaults(method)
    skip = _NOT_MATCHED.union(SEARCHED.get(method.name, ()))
    is_ratio = isinstance(budget, float) and budget < 1
    near = []
    for e in profile["entries"]:
        b = e.get("budget")
        if e.get("method") != method.name or not isinstance(b, (int, float)) or b <= 0:
            continue
        if (isinstance(b, float) and b < 1) != is_ratio:
            continue
        d = _budget_distance(float(b), float(budget))
        if d > math.log(2) + 1e-9:
            continue
        ctx = e.get("context", {})
        differs = {k: v for k, v in ctx.items() if k not in skip and hyper.get(k) != v}
        differs.update(
            {k: defaults[k] for k, v in hyper.items() if k not in skip and k not in ctx and v != defaults.get(k, v)}
        )
        near.append((d, float(b), e, differs))
    return near


def _paper_values(method_name: str, identity: dict, budget: int | float) -> dict | None:
    """SLAKE Table 3 / CAKE reference values for the papers' models (token budgets only)."""
    if isinstance(budget, float) and budget < 1:
        return None
    if method_name == "slake":
        from slake.methods.cake import match_family
        from slake.methods.slake import _ALPHA_BETA, slake_alpha_beta

        if match_family(identity["name"], list(_ALPHA_BETA)) is None:
            return None
        a, b = slake_alpha_beta(identity["name"], int(budget))
        return {"alpha": a, "beta": b}
    if method_name == "cake":
        from slake.methods.cake import _MODEL2TAU, match_family

        fam = match_family(identity["name"], list(_MODEL2TAU))
        if fam is None or int(budget) not in _MODEL2TAU[fam]:
            return None
        t1, t2 = _MODEL2TAU[fam][int(budget)]
        return {"tau1": t1, "tau2": t2}
    return None


def resolve_method(method: Any, budget: Any, model_or_config: Any = None, **overrides: Any) -> tuple[Any, dict | None]:
    """Build ``method`` (a name, a spec or a Method) with the model's profile applied where the user set nothing.

    Parameters
    ----------
    method : str | Method
        A registry name or spec (``"slake"``, ``"slake[vabs_split=window]"``); a built Method is returned as is, with
        ``overrides`` applied (checked as :func:`slake.methods.make_method` checks them) and no profile.
    budget : int | float | str | Budget
        The budget the cache will use (profiles are per budget).
    model_or_config : model, config or None
        The model (or its config) whose profile to use; None applies no profile.
    **overrides
        Hyperparameters set by the user (never replaced by a profile).

    Raises
    ------
    ValueError
        As :func:`slake.methods.make_method`: an unknown hyperparameter, a value of the wrong type, or one the method
        refuses.

    Returns
    -------
    (Method, dict | None)
        The method, and ``{"source", "values", "budget"}`` of the profile applied (None when none was).
    """
    from slake.budgets.budget import Budget
    from slake.methods.base import Method, check_hyperparameters, make_method
    from slake.methods.spec import parse_method_spec

    if isinstance(method, Method):
        if not overrides:
            return method, None
        # validated as make_method validates them: a replace() alone would take vabs="false" as given
        return replace(method, **check_hyperparameters(type(method), overrides, label=repr(method.name))), None
    built = make_method(method, **overrides)
    searched = searched_hyperparameters(built)
    if model_or_config is None or not searched:
        return built, None
    _, from_spec = parse_method_spec(str(method))
    user_set = set(from_spec) | set(overrides)
    free = [k for k in searched if k not in user_set]
    if not free:
        return built, None
    value = Budget(budget).value
    identity = model_identity(model_or_config)
    held = load_profiles(identity)
    found = find_entry(held, built, value)
    if found is not None:
        source, entry = found
        values, at = {k: entry["values"][k] for k in free if k in entry["values"]}, entry["budget"]
        _tell_other_folder(identity, source)
    else:
        paper = _paper_values(built.name, identity, value) or {}
        # the paper's pair too gives only what the user left unset: ``cake[tau1=0.5]`` keeps its tau1
        values, source, at = {k: v for k, v in paper.items() if k in free}, "paper", value
    if not values:
        if not _UNTOLD.get():
            # entries of this method near this budget calibrated with other hyperparameters: said, so that a user
            # of slake[linear_cache=false] is not told the model has no profile for slake
            otherwise = [differs for _, prof in held for *_, differs in _entries_near(prof, built, value) if differs]
            variant = _variant(str(method), built, [*from_spec, *overrides])
            nearest = min(otherwise, key=len) if otherwise else None  # the entry that differs in the fewest values
            _tell_defaults(identity["name"], variant, built, free, value, nearest)
        return built, None
    valid = {f.name for f in fields(built)}
    values = {k: v for k, v in values.items() if k in valid}
    return replace(built, **values), {"source": source, "values": values, "budget": at}


def _tell_other_folder(identity: dict, source: str) -> None:
    """Log once per model and profile file when a model named by a local path runs with a user profile calibrated on
    another local folder of the same name (a fine-tune uses its base's profile by name: docs/profiles.md; two
    unrelated checkpoints of one folder name, such as ``checkpoint-500``, are told so)."""
    mine = _local_path(identity["name"])
    if mine is None or not source.startswith("user:"):
        return
    path = Path(source.removeprefix("user:"))
    try:
        other = _local_path(json.loads(path.read_text(encoding="utf-8")).get("model", ""))
    except (OSError, ValueError):
        return
    key = (mine, str(path))
    if other is None or other == mine or key in _TOLD_OTHER_FOLDER:
        return
    _TOLD_OTHER_FOLDER.add(key)
    logger.warning(
        "%s uses the profile calibrated on %s (%s), another folder of the same name; `slake calibrate` this model "
        "for its own (docs/profiles.md)",
        mine,
        other,
        path,
    )


@contextlib.contextmanager
def defaults_untold() -> Iterator[None]:
    """Within the block, :func:`resolve_method` does not log that a method runs on its default values for want of a
    profile or paper values (``slake calibrate`` resolves what is in force before it calibrates those values: telling
    it to calibrate them says nothing)."""
    token = _UNTOLD.set(True)
    try:
        yield
    finally:
        _UNTOLD.reset(token)


def _variant(spec: str, built: Any, user_set: list[str]) -> str:
    """The method as it runs: the spec of ``built`` with every hyperparameter the user set, in the spec or beside it
    (``--no-linear-cache``, ``--set``), at the value the method holds (as
    :func:`slake.methods.base.canonical_method_spec` writes a spec): ``slake[linear_cache=false]``."""
    from slake.methods.spec import format_method_spec

    values = {k: getattr(built, k) for k in user_set}
    try:
        return format_method_spec(built.name, values)
    except ValueError:  # a value no spec can write: named beside the spec
        return f"{spec} with " + ", ".join(f"{k}={v!r}" for k, v in sorted(values.items()))


def _tell_defaults(
    model: str,
    spec: str,
    built: Any,
    free: list[str],
    budget: int | float,
    calibrated_with: dict[str, Any] | None = None,
) -> None:
    """Log once per model, method spec and budget that no calibrated profile or paper value exists for it, so its
    searched hyperparameters keep the method's defaults (SLAKE's are Llama-2-7B's; the calibrations of this project's
    models moved far from them). The budget is named: a profile covers some budgets of a model and not others.
    ``calibrated_with``: the values a profile entry of the method near this budget was calibrated with where the
    spec sets others (the entry exists, for another variant)."""
    model = model or "this model (it has no name)"
    key = (model, spec, budget)
    if key in _TOLD_DEFAULTS:
        return
    _TOLD_DEFAULTS.add(key)
    shown = ", ".join(f"{k}={getattr(built, k)}" for k in free)
    at = f"ratio {budget:g}" if isinstance(budget, float) and budget < 1 else str(budget)
    if profiles_disabled():  # the user turned the profiles off: they were not missing, and calibrating changes nothing
        logger.warning(
            "%s: profiles are off (SLAKE_NO_PROFILE is set) and %s has no paper values for it at budget %s: %s runs "
            "on its defaults (%s)",
            model,
            spec,
            at,
            spec,
            shown,
        )
        return
    why = " (a ratio budget has no paper values)" if isinstance(budget, float) and budget < 1 else ""
    other = (
        f"; its profile's entry for {built.name} near this budget was calibrated with "
        + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(calibrated_with.items()))
        + " and applies only to that variant"
        if calibrated_with
        else ""
    )
    logger.warning(
        "%s has no calibrated profile for %s at budget %s and no paper values%s: %s runs on its defaults (%s)%s; "
        "`slake calibrate` fits them to this model (docs/profiles.md)",
        model,
        spec,
        at,
        why,
        spec,
        shown,
        other,
    )


def _entry_key(entry: dict) -> tuple:
    """What an entry is calibrated for, as :func:`find_entry` matches it: the method, the budget and the context with
    the keys never matched left out and those it lacks at the method's defaults. A new entry replaces an old one of
    the same key: an entry written before a hyperparameter existed, or with another ``max_layer_budget``, had stayed
    beside the new one and, first in the file, kept being applied."""
    from slake.methods.base import available_methods

    context = {k: v for k, v in entry.get("context", {}).items() if k not in _NOT_MATCHED}
    cls = available_methods().get(str(entry.get("method")))
    if cls is not None:
        searched = SEARCHED.get(cls.name, ())
        defaults = {k: v for k, v in _defaults(cls).items() if k not in _NOT_MATCHED and k not in searched}
        context = {**defaults, **context}
    return entry.get("method"), entry.get("budget"), json.dumps(context, sort_keys=True, default=str)


def write_entry(identity: dict, entry: dict, folder: Path | None = None, aliases: list[str] | None = None) -> Path:
    """Add (or replace) one (method, budget, context) entry in the model's profile and return its path.

    ``aliases`` (other names the model answers to) are added to the profile, whether it exists or not.
    """
    path = profile_path(identity, folder)
    held = _read(path)
    local = _local_path(identity["name"])
    if held is None and local is None:
        # the profile that already answers to this name as an alias: a second file of the same model, read after
        # it (file order), was never applied
        held, path = next(
            ((data, p) for p, data in _profiles_in(path.parent) if _matches(data, identity)), (None, path)
        )
    if held is not None and local is not None and _local_path(held.get("model", "")) not in (None, local):
        # another local model of the same folder name (two runs' checkpoint-500): a file of this model's own
        digest = hashlib.sha256(local.encode()).hexdigest()[:8]
        path = path.with_name(f"{path.stem}-{digest}.json")
        held = _read(path)
    data = held or {
        "format": PROFILE_FORMAT,
        "model": local or identity["name"],
        "aliases": [],
        "fingerprint": identity["fingerprint"],
        "entries": [],
    }
    if data.get("fingerprint") != identity["fingerprint"]:
        raise ValueError(f"{path} holds the profile of another architecture; choose another --out-dir")
    known = {normalise_name(n) for n in [data.get("model", "")] + list(data.get("aliases", []))}
    for alias in aliases or []:
        if normalise_name(alias) not in known:
            data["aliases"] = list(data.get("aliases", [])) + [alias]
            known.add(normalise_name(alias))
    key = _entry_key(entry)
    data["entries"] = [e for e in data["entries"] if _entry_key(e) != key]
    data["entries"].append(entry)
    data["entries"].sort(key=lambda e: (e["method"], float(e["budget"])))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
