"""YAML with line numbers: PyYAML's composed node tree turned into plain Python
values plus a table ``path -> line`` (1-based), so a schema error can say where in
the file the offending field is.

A path is a tuple of mapping keys (str) and sequence indices (int), the same shape
as a pydantic error's ``loc``.
"""

from __future__ import annotations

from typing import Any

import yaml

Path = tuple


def load_with_lines(text: str, source: str = "<string>") -> tuple[Any, dict[Path, int]]:
    """Parse ``text``; return ``(value, lines)``.

    Raises:
        ValueError: not valid YAML (with the line and column PyYAML reports), or a
            duplicate mapping key.
    """
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(e, "problem", None) or str(e)
        raise ValueError(f"{where}: not valid YAML: {problem}") from None
    lines: dict[Path, int] = {}
    if node is None:
        return None, lines
    constructor = yaml.SafeLoader("")  # scalar resolution only (ints, bools, null)

    def build(n: yaml.Node, path: Path) -> Any:
        lines[path] = n.start_mark.line + 1
        if isinstance(n, yaml.MappingNode):
            out: dict = {}
            for k, v in n.value:
                key = constructor.construct_object(k, deep=True)
                if key in out:
                    raise ValueError(f"{source}:{k.start_mark.line + 1}: duplicate key "
                                     f"{key!r}")
                child = (*path, key)
                out[key] = build(v, child)
                lines[child] = k.start_mark.line + 1  # the key's line, not its value's
            return out
        if isinstance(n, yaml.SequenceNode):
            return [build(v, (*path, i)) for i, v in enumerate(n.value)]
        return constructor.construct_object(n, deep=True)

    return build(node, ()), lines


def line_of(lines: dict[Path, int], loc: Path) -> int | None:
    """The line of ``loc`` or of its nearest enclosing path that the file has."""
    loc = tuple(loc)
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return lines.get(())
