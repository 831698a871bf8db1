"""Load a Config from YAML plus dotted overrides, turning OmegaConf errors into ConfigErrors.

OmegaConf stops here: callers get a frozen `hybridrl.config.Config`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Iterable, List

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from hybridrl.config import Config, ConfigError
from hybridrl.config.algorithm import ASYNC_ROLLOUT_IS
from hybridrl.config.verl_sections import MOVED_KEYS, drop_not_read, to_hybridrl_sections


def all_keys(cls=Config, prefix: str = "") -> List[str]:
    """Every dotted leaf and section key of the config tree."""
    keys = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        keys.append(name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys.extend(all_keys(type(default), name + "."))
    return keys


def nearest_key(key: str) -> str:
    """The valid key a typo most likely meant: same leaf name first, else the closest spelling."""
    keys = all_keys()
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf and "." not in key:  # a bare leaf names no section: the first in the tree (actor)
        return same_leaf[0]
    candidates = same_leaf or keys
    return difflib.get_close_matches(key, candidates, n=1, cutoff=0.0)[0]


def field_type(key: str) -> str:
    """The declared type of a dotted key, as written in config.py."""
    cls, ftype = Config, "?"
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return ftype
        ftype = fields[part].type
        default = fields[part].default_factory() if fields[part].default_factory is not dataclasses.MISSING else None
        cls = type(default) if dataclasses.is_dataclass(default) else None
    return str(ftype)


def _unknown_key_error(full_key: str) -> ConfigError:
    if full_key in MOVED_KEYS:
        return ConfigError(f"config key '{full_key}' is now '{MOVED_KEYS[full_key]}' here; rename it")
    return ConfigError(f"unknown config key '{full_key}'; did you mean '{nearest_key(full_key)}'?")


def _type_error(err: ValidationError) -> ConfigError:
    key = err.full_key or "?"
    msg = str(err).splitlines()[0]
    return ConfigError(f"config key '{key}' expects {field_type(key)}: {msg}")


def _parse_overrides(overrides: Iterable[str]):
    dotlist = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. actor.optim.lr=1e-6)")
        dotlist.append(item)
    return dotlist


def _check_keys(node, schema_keys, prefix=""):
    """Reject keys the schema does not know, naming the nearest valid one."""
    for key in node:
        full = prefix + str(key)
        value = node[key]
        if full not in schema_keys:
            while OmegaConf.is_dict(value) and len(value) == 1:  # name the whole dotted path
                sub = next(iter(value))
                full, value = f"{full}.{sub}", value[sub]
            raise _unknown_key_error(full)
        if OmegaConf.is_dict(value) and not _free_form(full):
            _check_keys(value, schema_keys, full + ".")


def _free_form(key: str) -> bool:
    """A Dict-typed setting (data.apply_chat_template_kwargs): its keys are the user's, not the schema's."""
    return field_type(key).replace("typing.", "").startswith("Dict[")


def _words_back(node, prefix=""):
    """YAML 1.1 reads off/on/no/yes as booleans; where the schema wants a string (verify_weights: off,
    router_replay: off) the word the user meant is put back: "off" for false, "on" for true."""
    for key in list(node):
        full, value = prefix + str(key), node[key]
        if OmegaConf.is_dict(value):
            _words_back(value, full + ".")
        elif isinstance(value, bool) and field_type(full) in ("str", "<class 'str'>"):
            node[key] = "on" if value else "off"


def _one_element_lists(node, prefix=""):
    """A plain string where the schema wants a list of strings is that one-element list (verl reads
    data.train_files=path.parquet so)."""
    for key in list(node):
        full, value = prefix + str(key), node[key]
        if OmegaConf.is_dict(value):
            _one_element_lists(value, full + ".")
        elif isinstance(value, str) and field_type(full) in ("List[str]", "typing.List[str]"):
            node[key] = [value]


def _check_finite(node: dict, prefix: str = "") -> None:
    """Every float of the resolved config is a real number: NaN or inf (e.g. lr=inf, kl_coef=nan) is refused."""
    for key, value in node.items():
        full = prefix + str(key)
        if isinstance(value, dict):
            _check_finite(value, full + ".")
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, float) and not math.isfinite(item):
                name = full if i is None else f"{full}[{i}]"
                raise ConfigError(f"config key '{name}' is {item}; set it to a finite number")


def _async_defaults(layers) -> list:
    """verl's advice for asynchronous training as a default: when the engine lags the trainer
    (async_training.staleness_threshold >= 1 or partial_rollout) and no layer sets
    algorithm.rollout_correction.rollout_is, it is token (truncated at rollout_is_threshold, 2.0). Returned
    as a layer under the user's, so the resolved config shows it."""
    user = OmegaConf.merge(*layers) if layers else OmegaConf.create()
    stale = OmegaConf.select(user, "async_training.staleness_threshold", default=0)
    lags = (isinstance(stale, int) and stale >= 1) or OmegaConf.select(user, "async_training.partial_rollout") is True
    unset = OmegaConf.select(user, "algorithm.rollout_correction.rollout_is", default="unset") == "unset"
    return [OmegaConf.create({"algorithm": {"rollout_correction": {"rollout_is": ASYNC_ROLLOUT_IS}}})] \
        if lags and unset else []


def load_config(path: str = "", overrides: Iterable[str] = ()) -> Config:
    """YAML file (optional; comma-separated files are layered, later ones win: a recipe fragment over a
    run's config) + `key=value` overrides → validated frozen Config."""
    schema = OmegaConf.structured(Config)
    keys = set(all_keys())
    layers = []
    for one in (p for p in path.split(",") if p):
        if not os.path.isfile(one):
            raise ConfigError(f"config file '{one}' does not exist; pass --config configs/tiny_cpu.yaml")
        try:
            layers.append(OmegaConf.load(one))
        except Exception as err:  # yaml errors come in several types
            raise ConfigError(f"config file '{one}' is not valid YAML: {err}") from None
    try:
        layers.append(OmegaConf.from_dotlist(_parse_overrides(overrides)))
    except OmegaConfBaseException as err:
        raise ConfigError(f"could not parse overrides: {err}") from None
    dropped = {}
    try:
        layers = [drop_not_read(to_hybridrl_sections(layer), dropped) for layer in layers]
        for layer in layers:
            _check_keys(layer, keys)
            _words_back(layer)
            _one_element_lists(layer)
    except ConfigKeyError as err:
        raise _unknown_key_error(err.full_key or str(err.key)) from None
    except OmegaConfBaseException as err:  # a ${...} that names no key, a malformed value
        raise ConfigError(f"invalid config: {str(err).splitlines()[0]}") from None
    if dropped and int(os.environ.get("RANK", "0")) == 0:  # before any process group: the launcher's rank
        print("verl keys not read here: " + "; ".join(f"{k}: {why}" for k, why in dropped.items()), flush=True)
    try:
        merged = OmegaConf.merge(schema, *_async_defaults(layers), *layers)
        _check_finite(OmegaConf.to_container(merged, resolve=True))
        return OmegaConf.to_object(merged)
    except ConfigKeyError as err:
        raise _unknown_key_error(err.full_key or str(err.key)) from None
    except ValidationError as err:
        raise _type_error(err) from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid config: {err}") from None


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
