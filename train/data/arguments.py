"""A loader's arguments, declared once as the fields of its dataclass.

A field without a default is required. ``positive`` and ``non_negative``
mark int fields and their lower bound, ``path`` a file or folder that must
exist. ``check`` reads these declarations to refuse a config before anything
is loaded, with the key and the value in the message.
"""

import dataclasses
import os
from typing import Any

from train import checks

_MINIMUM = "minimum"
_PATH = "path"


def positive(default: int):
  """An int field that must be >= 1."""
  return dataclasses.field(default=default, metadata={_MINIMUM: 1})


def non_negative(default: int):
  """An int field that must be >= 0."""
  return dataclasses.field(default=default, metadata={_MINIMUM: 0})


def path():
  """A path field; its default, "", is a config's placeholder for data it
  does not bundle, and counts as missing."""
  return dataclasses.field(default="", metadata={_PATH: True})


def names(loaders) -> set[str]:
  """Every argument that one of ``loaders`` (dataclass types) takes."""
  return {f.name for loader in loaders for f in dataclasses.fields(loader)}


def check(
    name: str, loader, args: dict[str, Any], where: str | None
) -> dict[str, Any]:
  """``loader``'s arguments: ``args`` it takes, its defaults for the rest.

  Args:
    name: the loader's name in ``config.data.name``, for the messages.
    loader: the loader's dataclass type.
    args: ``config.data`` without its name; arguments of other loaders are
      left out, so that one override of the name switches a config to, say,
      synthetic data of the same shapes.
    where: where the loader's data comes from, said when a path is missing.

  Returns:
    The keyword arguments of ``loader``, with paths' ``~`` expanded.

  Raises:
    ValueError: for a missing required argument or an int out of range.
    FileNotFoundError: for a path that does not exist.
  """
  fields = dataclasses.fields(loader)
  kwargs = {f.name: args.get(f.name, f.default) for f in fields}
  missing = [
      f.name
      for f in fields
      if kwargs[f.name] is dataclasses.MISSING
      or (f.metadata.get(_PATH) and kwargs[f.name] == "")
  ]
  if missing:
    where = f": {where}" if where else ""
    raise ValueError(
        f"loader {name!r} needs"
        f" {', '.join(f'config.data.{k}' for k in missing)}{where}"
    )
  for f in fields:
    if _MINIMUM in f.metadata:
      checks.int_in(
          f"config.data.{f.name}", kwargs[f.name], f.metadata[_MINIMUM]
      )
  for f in fields:
    if f.metadata.get(_PATH):
      kwargs[f.name] = os.path.expanduser(os.fspath(kwargs[f.name]))
      if not os.path.exists(kwargs[f.name]):
        raise FileNotFoundError(
            f"config.data.{f.name}={kwargs[f.name]} does not exist"
        )
  return kwargs
