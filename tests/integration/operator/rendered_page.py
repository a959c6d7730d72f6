"""The DOM that headless chromium dumped, as a small tree the status-page tests can query.

Used by test_status_page.py. Stdlib only (html.parser): elements with their attributes,
children and text, found by id, by class or by data-* attribute.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser

VOID_TAGS = frozenset({"meta", "link", "br", "hr", "img", "input", "col", "area", "base", "wbr"})


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element | str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def walk(self) -> Iterator[Element]:
        yield self
        for child in self.children:
            if isinstance(child, Element):
                yield from child.walk()

    def find_all(self, tag: str | None = None, *, cls: str | None = None,
                 **attrs: str) -> list[Element]:
        """Descendants matching tag, class and attributes (data_service= means data-service)."""
        wanted = {k.replace("_", "-"): v for k, v in attrs.items()}
        return [
            e for e in self.walk()
            if (tag is None or e.tag == tag)
            and (cls is None or cls in e.classes)
            and all(e.attrs.get(k) == v for k, v in wanted.items())
        ]

    def one(self, tag: str | None = None, *, cls: str | None = None, **attrs: str) -> Element:
        found = self.find_all(tag, cls=cls, **attrs)
        assert len(found) == 1, f"expected one {tag or '*'} .{cls} {attrs}, found {len(found)}"
        return found[0]

    def by_id(self, element_id: str) -> Element:
        return self.one(id=element_id)

    @property
    def disabled(self) -> bool:
        return "disabled" in self.attrs


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self._stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs})
        self._stack[-1].children.append(element)
        if tag not in VOID_TAGS:
            self._stack.append(element)

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self._stack) - 1, 0, -1):
            if self._stack[depth].tag == tag:
                del self._stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        self._stack[-1].children.append(data)


def parse(html: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(html)
    builder.close()
    return builder.root
