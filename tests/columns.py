"""What a rich console printed, and the words a narrow terminal cut across lines."""

from __future__ import annotations

import io
import re

from rich.console import Console

_BOX = re.compile("[\u2500-\u257f]")  # the box-drawing characters of table borders


class Recording(Console):
    """A console of ``width`` columns writing to a string (``text``) that keeps what it was
    asked to print, so :func:`cut_words` can render it again without a width limit."""

    def __init__(self, width: int):
        super().__init__(file=io.StringIO(), width=width, color_system=None)
        self.printed: list[tuple[tuple, dict]] = []

    def print(self, *objects, **kwargs) -> None:
        self.printed.append((objects, kwargs))
        super().print(*objects, **kwargs)

    @property
    def text(self) -> str:
        return self.file.getvalue()


def _words(text: str) -> list[str]:
    return _BOX.sub(" ", text).split()


def cut_words(console: Recording) -> list[str]:
    """Words of ``console``'s output that are no whole word of the same output printed 1,000
    columns wide: the pieces of a word cut at the end of a line (``sparse_indexe`` + ``r``) or
    punctuation left alone on a line (``,``)."""
    wide = Recording(1000)
    for objects, kwargs in console.printed:
        wide.print(*objects, **kwargs)
    whole = set(_words(wide.text))
    return [word for word in _words(console.text) if word not in whole]
