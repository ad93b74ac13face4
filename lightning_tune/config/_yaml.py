"""Reading a configuration file: PyYAML's safe loader with the limits a hand-written training configuration never nears.

:func:`read_yaml` refuses alias bombs, deep nesting and a key given twice, at the line where they happen, and reads YAML
1.1's base-60 numbers (``1:30``) as the text they look like (``docs/config.md`` has the table).
"""

from __future__ import annotations

import re
from typing import Any, Final

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

#: Values all the aliases of a file may repeat together (a merge key ``<<: *defaults`` of 20 keys repeats 21).
MAX_ALIAS_VALUES: Final = 1000
#: Mappings and sequences nested in one another; a training configuration nests 4 deep at most.
MAX_DEPTH: Final = 32
_BASE_60: Final = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")
_MERGE: Final = "tag:yaml.org,2002:merge"


class LimitError(yaml.MarkedYAMLError):
    """Valid YAML that a configuration file may not hold: an alias bomb, deep nesting, a key given twice."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem=problem, problem_mark=mark)


class _Loader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.path: list[str] = []  # the keys (and [indices]) down to the value being composed
        self.depth = self.values = self.repeated = 0  # collections open; values composed; of them, by alias
        self.sizes: dict[str, int] = {}  # anchor -> values its node holds, aliases expanded

    def where(self) -> str:
        return "".join(part if part.startswith("[") else f".{part}" for part in self.path).lstrip(".") or "the file"

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        event = self.peek_event()
        named = isinstance(parent, SequenceNode) or (isinstance(parent, MappingNode) and index is not None)
        if named:  # a value (not a key): its key, or its index in a sequence
            self.path.append(f"[{index}]" if isinstance(parent, SequenceNode) else str(getattr(index, "value", "?")))
        try:
            if isinstance(event, yaml.AliasEvent):
                return self._alias(parent, index, event)
            return self._value(parent, index, event)
        finally:
            if named:
                self.path.pop()

    def _alias(self, parent: Node | None, index: Any, event: yaml.AliasEvent) -> Node:
        name = event.anchor
        if name in self.anchors and name not in self.sizes:
            raise LimitError(f"alias `*{name}` at `{self.where()}` is inside the value it names", event.start_mark)
        node = super().compose_node(parent, index)  # an undefined alias: PyYAML's own error
        self.values += self.sizes[name]
        self.repeated += self.sizes[name]
        if self.repeated > MAX_ALIAS_VALUES:
            why = f"alias `*{name}` at `{self.where()}` repeats {self.sizes[name]:,} values, and the aliases of the"
            limit = f"more than the {MAX_ALIAS_VALUES:,} allowed (write the values out, or repeat fewer)"
            raise LimitError(f"{why} file would repeat {self.repeated:,} in all: {limit}", event.start_mark)
        return node

    def _value(self, parent: Node | None, index: Any, event: Any) -> Node:
        collection = isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent))
        if collection and self.depth >= MAX_DEPTH:
            what = f"values nested more than {MAX_DEPTH} deep at `{self.where()}`"
            raise LimitError(f"{what}; a training configuration nests a few levels", event.start_mark)
        before = self.values
        self.depth += collection
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= collection
        self.values += 1
        if event.anchor is not None:
            self.sizes[event.anchor] = self.values - before
        if isinstance(node, MappingNode):
            self._check_keys(node)
        return node

    def _check_keys(self, node: MappingNode) -> None:
        seen: dict[tuple[str, str], ScalarNode] = {}
        for key, _ in node.value:
            if not isinstance(key, ScalarNode) or key.tag == _MERGE:
                continue
            if (first := seen.setdefault((key.tag, key.value), key)) is not key:
                self.path.append(key.value)
                twice = f"key `{self.where()}` is given twice (first at line {first.start_mark.line + 1})"
                raise LimitError(f"{twice}; PyYAML would keep the last silently: keep one", key.start_mark)

    def resolve(self, kind: type[Node], value: Any, implicit: tuple[bool, bool]) -> str:
        if kind is ScalarNode and implicit[0] and _BASE_60.fullmatch(value):
            return self.DEFAULT_SCALAR_TAG  # YAML 1.1 reads 1:30 as 90 (base 60); YAML 1.2 and people read text
        return str(super().resolve(kind, value, implicit))


def read_yaml(text: str) -> Any:
    """The value of a YAML document, read safely: a ``yaml.YAMLError``, or :class:`LimitError` past a limit."""
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
