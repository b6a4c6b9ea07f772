"""A tree view for operators: the largest subtrees, how much of each every tier holds, how hot they are.

`largest_subtrees` (run where the tree lives: the embedded engine, the server's scheduler) describes
the biggest subtrees under the root and their biggest children as plain JSON (it goes into reports and
`/server_info`); `format_tree` renders that as a table, one row per subtree:

    subtree      depth  tokens  hits  last access  device   host   disk  nodes  text
    #12              1   8,192    41     0.3 s ago    2,048  4,096  8,192     37  "You are a helpful..."
      #57            2   2,048     6      12 s ago        0  1,024  2,048      5  "Summarise the..."

`tokens` counts the subtree's distinct tokens (every page once, whichever tiers hold it), `hits` the
matches that reused the subtree's first node, `last access` the most recent use anywhere in the subtree
(on the clock of the cache: the virtual clock for the embedded engine), device/host/disk the tokens each
tier holds. With a tokenizer, `text` is the first words of the subtree's own tokens (its edge).
"""

from __future__ import annotations

from typing import Any, Protocol

from ..tiers.base import TIERS
from .node import TreeNode
from .radix import RadixTree

HEAD_TOKENS = 32  # token ids kept per subtree for its text


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def largest_subtrees(
    tree: RadixTree, page_bytes: int, top: int = 8, depth: int = 2, now: float | None = None
) -> list[dict[str, Any]]:
    """The `top` largest subtrees under the root, each with its `top` largest children down to
    `depth` levels: depth, tokens in the subtree, tokens and bytes per tier, node count, hits, last
    access (and its age at `now`, the cache's clock), lock count and the first token ids."""

    def describe(node: TreeNode, level: int) -> dict[str, Any]:
        pages = tree.subtree_pages(node)
        nodes = list(_walk(node))
        last = max(n.last_access for n in nodes)
        tiers = "".join(c if node.in_tier(t) else "-" for t, c in zip(TIERS, "DHK"))
        entry: dict[str, Any] = {
            "node": f"#{node.id}",
            "depth": level,
            "edge_tokens": len(node.tokens),
            "subtree_tokens": _distinct_pages(node) * tree.page_size,
            "subtree_nodes": len(nodes),
            "bytes": {t: pages[t] * page_bytes for t in TIERS},
            "tokens": {t: pages[t] * tree.page_size for t in TIERS},
            "residency": tiers,
            "hits": node.hit_count,
            "last_access": last,
            "age_s": None if now is None else max(0.0, now - last),
            "locked": node.lock_ref,
            "head_tokens": [int(t) for t in node.tokens[:HEAD_TOKENS]],
        }
        if level < depth and node.children:
            kids = sorted(node.children.values(), key=_distinct_pages, reverse=True)
            entry["children"] = [describe(c, level + 1) for c in kids[:top]]
            if len(kids) > top:
                entry["more_children"] = len(kids) - top
        return entry

    roots = sorted(tree.root.children.values(), key=_distinct_pages, reverse=True)
    return [describe(c, 1) for c in roots[:top]]


def _distinct_pages(node: TreeNode) -> int:
    """Pages in the subtree, each once whichever tiers hold it (the ordering of the view)."""
    return sum(n.num_pages for n in _walk(node))


def _walk(node: TreeNode):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def format_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return "<1 s ago"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _text(entry: dict[str, Any], decoder: Decoder | None, width: int = 48) -> str:
    ids = entry.get("head_tokens")
    if decoder is None or not ids:
        return ""
    try:
        text = " ".join(decoder.decode(list(ids)).split())
    except Exception as e:  # a tokenizer that does not fit the ids: say so in the cell, keep the table
        return f"(cannot decode: {type(e).__name__})"
    if len(text) > width:  # cut at a word boundary when there is one
        cut = text[: width - 3]
        text = (cut.rsplit(" ", 1)[0] if " " in cut else cut) + "..."
    return '"' + text + '"'


def format_tree(entries: list[dict[str, Any]], decoder: Decoder | None = None) -> str:
    """A table, one row per subtree, children indented under their parent (see the module docstring).
    Old reports (before depth/hits/age were recorded) render with '-' in those columns."""
    header = ["subtree", "depth", "tokens", "hits", "last access", "device", "host", "disk", "nodes", "tiers", "text"]
    rows: list[list[str]] = []

    def add(es: list[dict[str, Any]], indent: int) -> None:
        for e in es:
            t = e.get("tokens", {})
            total = e.get("subtree_tokens")
            label = "  " * indent + str(e.get("node", "?")) + (f" locked={e['locked']}" if e.get("locked") else "")
            rows.append(
                [
                    label,
                    str(e.get("depth", indent + 1)),
                    _num(total),
                    _num(e.get("hits")),
                    format_age(e.get("age_s")),
                    _num(t.get("device", 0)),
                    _num(t.get("host", 0)),
                    _num(t.get("disk", 0)),
                    _num(e.get("subtree_nodes")),
                    e.get("residency", "-"),
                    _text(e, decoder),
                ]
            )
            add(e.get("children") or [], indent + 1)
            if e.get("more_children"):
                rows.append(["  " * (indent + 1) + f"... {e['more_children']} more", *[""] * (len(header) - 1)])

    add(entries, 0)
    if not rows:
        return "(empty tree)"
    if decoder is None:
        header, rows = header[:-1], [r[:-1] for r in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    left = {0, len(header) - 1} if decoder is not None else {0}
    lines = [
        "  ".join(c.ljust(w) if i in left or i == 9 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in [header, *rows]
    ]
    return "\n".join(lines)


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:,}"
