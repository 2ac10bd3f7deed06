"""Hooks of the docs site (mkdocs.yml, ``hooks:``): the docstrings use Sphinx's roles
(``:class:`~unbroken.Remote```, ``:meth:`step```), which the reference pages render as code."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj|const):<code>(~?)([^<]*)</code>")


def _shown(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    """``:class:<code>~unbroken.Remote</code>`` (a role, as rendered) -> ``<code>Remote</code>``."""
    return _ROLE.sub(_shown, html)
