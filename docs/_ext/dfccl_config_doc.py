"""Sphinx extension: the configuration reference, generated from ``jax_dfccl/config.py``.

The page ``guides/configuration.md`` holds the marker ``{{ dfccl_config_entries }}``; at build
time it is replaced by MyST Markdown made by introspecting the configuration dataclass: its
fields in order, each with its type, its default and the ``#:`` comment above it (read with
Sphinx's own source analyzer).  A field whose default is itself a configuration dataclass is a
section: it gets a heading (from that class's docstring and the field's comment) and its own
fields are listed under the dotted name.  Fields without a comment of their own are listed with
the documented field before them (a group such as ``large_slots, direct_slots, ...``).
"""
from __future__ import annotations

import dataclasses
import importlib
import re
import typing

MARKER = "{{ dfccl_config_entries }}"
OVERVIEW = "{{ dfccl_config_overview }}"
MODULE = "jax_dfccl.config"


def _rst_to_myst(text: str) -> str:
  text = re.sub(r":(func|class|data|mod|meth|attr):`~?([^`]+)`", r"{\1}`\2`", text)
  return re.sub(r"``([^`]+)``", r"`\1`", text)


def _paragraphs(lines: list[str]) -> str:
  """Comment or docstring lines as MyST paragraphs; lines starting with ``*`` or ``-`` are items."""
  blocks, cur = [], []
  for line in list(lines) + [""]:
    text = line.strip()
    if not text:
      if cur:
        blocks.append(cur); cur = []
    elif text[:2] in ("* ", "- ") or not cur:
      cur.append(text)
    else:
      cur[-1] += " " + text
  out = []
  for block in blocks:
    if block[0][:2] in ("* ", "- "):
      out.append("\n".join("- " + _rst_to_myst(item[2:]) for item in block))
    else:
      out.append(_rst_to_myst(" ".join(block)))
  return "\n\n".join(out)


def _target(name: str) -> str:
  return "config-" + name.replace(".", "-").replace("_", "-")


def _value(name: str, v) -> str:
  if isinstance(v, bool) or v is None:
    return f"`{v!r}`"
  if isinstance(v, int) and "bytes" in name and v >= 1024 and v % 1024 == 0:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
      if v % (1 << shift) == 0:
        return f"`{v}` ({v >> shift} {unit})"
  return f"`{v!r}`"


def _type_name(cls, f) -> str:
  try:
    t = typing.get_type_hints(cls)[f.name]
  except Exception:  # noqa: BLE001 - an annotation that does not resolve: print it as written
    return str(f.type)
  if isinstance(t, type):
    return t.__name__
  return str(t).replace("typing.", "").replace("NoneType", "None")


def _default(f):
  if f.default is not dataclasses.MISSING:
    return f.default
  if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
    return f.default_factory()  # type: ignore[misc]
  return dataclasses.MISSING


def _own_docstring(cls) -> str:
  doc = cls.__doc__ or ""
  # dataclasses give an undocumented class its signature as docstring: not prose.
  return "" if doc.startswith(cls.__name__ + "(") else doc


def _analyzer_docs(cls) -> dict:
  from sphinx.pycode import ModuleAnalyzer
  try:
    docs = ModuleAnalyzer.for_module(cls.__module__).find_attr_docs()
  except Exception:  # noqa: BLE001 - no source: entries without prose
    return {}
  return {name: lines for (ns, name), lines in docs.items() if ns == cls.__qualname__}


def _tags(module, name: str) -> list[str]:
  tags = []
  for attr, tag in (("CPU_ONLY_ENTRIES", "CPU runtime only"), ("INIT_ENTRIES", "read by `initialize()`"),
                    ("TRACE_TIME_ENTRIES", "read at trace time")):
    if name in (getattr(module, attr, None) or ()):
      tags.append(tag)
  return tags


def entries_markdown(cls, module, prefix: str = "", level: int = 2) -> str:
  """MyST Markdown for every field of the dataclass `cls` (recursing into sections)."""
  docs = _analyzer_docs(cls)
  out: list[str] = []
  groups: list[tuple[list, list[str]]] = []  # ([fields], doc lines) of plain entries
  sections = []

  def flush():
    for fields, lines in groups:
      terms = []
      for f in fields:
        flat = getattr(cls, "_prefix", "") + f.name  # the name configure() takes, if sections prefix it
        tags = ([f"`configure({flat}=...)`"] if flat != prefix + f.name else []) + _tags(module, flat)
        extra = "; " + ", ".join(tags) if tags else ""
        terms.append(f"`{prefix}{f.name}` ({_type_name(cls, f)}, default "
                     f"{_value(f.name, _default(f))}{extra})")
      out.append(f"({_target(prefix + fields[0].name)})=")
      out.append(", ".join(terms))
      text = _paragraphs(lines) or "(no description)"
      out.append(": " + text.replace("\n\n", "\n\n  ") + "\n")
    groups.clear()

  for f in dataclasses.fields(cls):
    default = _default(f)
    if dataclasses.is_dataclass(default) and not isinstance(default, type):
      flush()
      sub = type(default)
      title = f"`config.{prefix}{f.name}`"
      # The section class's docstring, else the comment above the field.
      intro = _paragraphs(_own_docstring(sub).splitlines()) or _paragraphs(docs.get(f.name, []))
      out.append(f"{'#' * level} {title}\n")
      if intro:
        out.append(intro + "\n")
      out.append(entries_markdown(sub, module, f"{prefix}{f.name}.", min(level + 1, 6)))
      sections.append(f.name)
      continue
    if f.name in docs or not groups:
      groups.append(([f], docs.get(f.name, [])))
    else:
      groups[-1][0].append(f)
  flush()
  return "\n".join(out)


def config_markdown() -> str:
  module = importlib.import_module(MODULE)
  cfg = getattr(module, "config", None)
  cls = type(cfg) if cfg is not None and dataclasses.is_dataclass(cfg) else module.Config
  return entries_markdown(cls, module, level=3)


def overview_markdown() -> str:
  """The configuration module's docstring, as MyST Markdown."""
  module = importlib.import_module(MODULE)
  return _paragraphs((module.__doc__ or "").splitlines()[1:])


def _source_read(app, docname, source):
  if MARKER in source[0]:
    source[0] = source[0].replace(MARKER, config_markdown())
  if OVERVIEW in source[0]:
    source[0] = source[0].replace(OVERVIEW, overview_markdown())


def setup(app):
  app.connect("source-read", _source_read)
  return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
