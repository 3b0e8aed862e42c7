"""Loading YAML configuration into validated models, with errors an operator can act on.

Every key named `*_seconds` takes a duration (`30`, `30s`, `500ms`, `1h30m`) and every key named
`*_bytes` a size (`2147483648`, `2GiB`, `24GB`), in every section of every config (oomguard.units).
"""

from __future__ import annotations

import os
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from oomguard import bounded
from oomguard.errors import ConfigError
from oomguard.units import config_value

M = TypeVar("M", bound=BaseModel)


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A YAML config file through the bounded reader: a FIFO, a directory, bad UTF-8, deep
    nesting, an alias bomb or a 5,000-digit number is one ConfigError naming the file."""
    try:
        data = bounded.read_yaml(path, bounded.DEFAULT, source=f"config {os.fsdecode(path)}")
    except bounded.InputError as exc:
        raise ConfigError(str(exc)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _models(annotation: object) -> list[type[BaseModel]]:
    """The config models inside a field's type (`Section`, `Section | None`, `list[Section]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def with_units(model: type[BaseModel], data: object, where: str, problems: list[str]) -> object:
    """`data` with every `*_seconds` and `*_bytes` value written with a unit turned into a number,
    section by section as `model` nests them; a value that is not a duration or size is named
    in `problems` by its dotted path. Unknown keys are left for the model to refuse."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue
        path = f"{where}{key}"
        try:
            out[key] = config_value(key, value)
        except ValueError as exc:
            problems.append(f"  {path}: {exc}")
            continue
        for sub in _models(field.annotation)[:1]:
            if isinstance(value, list):
                out[key] = [
                    with_units(sub, item, f"{path}.{i}.", problems) for i, item in enumerate(value)
                ]
            else:
                out[key] = with_units(sub, value, f"{path}.", problems)
    return out


def validate(model: type[M], data: dict[str, Any], source: str) -> M:
    """Validate `data`; a ConfigError lists every wrong field by its dotted path."""
    wrong: list[str] = []
    data = typing.cast(dict[str, Any], with_units(model, data, "", wrong))
    if wrong:
        raise ConfigError(f"invalid configuration in {source}:\n" + "\n".join(wrong))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "\n".join(
            f"  {'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"invalid configuration in {source}:\n{problems}") from None
