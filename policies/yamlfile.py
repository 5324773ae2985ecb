"""Operator YAML files (catalog, policy): parse, validate with pydantic, name every problem."""

from __future__ import annotations

from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


def parse_yaml_model(text: str, source: str, model: type[Model], what: str, error: type[Exception]) -> Model:
    """One parse for every operator file, so each reports errors the same way: file, field, message."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{source}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{source}: expected a mapping at the top level")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}" for err in exc.errors()
        )
        raise error(f"{source}: invalid {what}: {problems}") from exc
