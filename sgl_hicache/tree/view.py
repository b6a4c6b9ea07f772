"""A tree view for operators: the largest subtrees and how many bytes each tier holds of them."""

from __future__ import annotations

from typing import Any

from ..tiers.base import TIERS
from .node import TreeNode
from .radix import RadixTree


def _label(node: TreeNode, width: int = 6) -> str:
    head = ",".join(str(t) for t in node.tokens[:width])
    return f"#{node.id}[{head}{',...' if len(node.tokens) > width else ''}]"


def largest_subtrees(tree: RadixTree, page_bytes: int, top: int = 8, depth: int = 2) -> list[dict[str, Any]]:
    """The `top` largest subtrees under the root, each with its `top` largest children down to
    `depth` levels: tokens in the subtree, bytes per tier, node count, and lock count."""

    def describe(node: TreeNode, level: int) -> dict[str, Any]:
        pages = tree.subtree_pages(node)
        nodes = sum(1 for _ in _walk(node))
        entry: dict[str, Any] = {
            "node": _label(node),
            "edge_tokens": len(node.tokens),
            "subtree_nodes": nodes,
            "bytes": {t: pages[t] * page_bytes for t in TIERS},
            "tokens": {t: pages[t] * tree.page_size for t in TIERS},
            "locked": node.lock_ref,
        }
        if level < depth and node.children:
            kids = sorted(node.children.values(), key=lambda c: -sum(tree.subtree_pages(c).values()))
            entry["children"] = [describe(c, level + 1) for c in kids[:top]]
            if len(kids) > top:
                entry["more_children"] = len(kids) - top
        return entry

    roots = sorted(tree.root.children.values(), key=lambda c: -sum(tree.subtree_pages(c).values()))
    return [describe(c, 1) for c in roots[:top]]


def _walk(node: TreeNode):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def format_tree(entries: list[dict[str, Any]], indent: int = 0) -> str:
    """Text rendering: one line per subtree with tokens per tier."""
    lines = []
    for e in entries:
        t = e["tokens"]
        lines.append(
            f"{'  ' * indent}{e['node']:<34} nodes={e['subtree_nodes']:<6} device={t['device']:<9} host={t['host']:<9} disk={t['disk']:<9}"
            + (f" locked={e['locked']}" if e.get("locked") else "")
        )
        if e.get("children"):
            lines.append(format_tree(e["children"], indent + 1))
        if e.get("more_children"):
            lines.append(f"{'  ' * (indent + 1)}... {e['more_children']} more")
    return "\n".join(lines)
