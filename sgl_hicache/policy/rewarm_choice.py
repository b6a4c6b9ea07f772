"""Which prefixes a restarted cache brings back from the disk tier to host first: the paths the tree
used most recently and most often before the stop, within the host tier's budget."""

from __future__ import annotations

from array import array

from ..tree.node import TreeNode
from ..tree.radix import RadixTree


def rewarm_paths(tree: RadixTree, budget_pages: int) -> list[array]:
    """The token ids (int64 arrays, whole pages) of the prefixes worth re-warming, most valuable
    first, whose pages together (shared prefixes once) fit in `budget_pages`.

    Nodes rank by their last access, then their hit count (what the tree recorded before the stop);
    a node is taken with its ancestors (prefix closure: a page is usable only under its parent), and
    one path is returned per taken node with no taken child, in the order its node was taken."""
    if budget_pages <= 0:
        return []
    ranked = sorted(tree.nodes(), key=lambda n: (n.last_access, n.hit_count), reverse=True)
    taken: dict[int, TreeNode] = {}
    order: list[TreeNode] = []
    used = 0
    for node in ranked:
        if id(node) in taken:
            continue
        chain = []
        n: TreeNode | None = node
        while n is not None and n.parent is not None and id(n) not in taken:
            chain.append(n)
            n = n.parent
        pages = sum(c.num_pages for c in chain)
        if used + pages > budget_pages:
            continue  # a smaller path further down the ranking may still fit
        used += pages
        taken.update((id(c), c) for c in chain)
        order.append(node)
    has_taken_child = {id(n.parent) for n in taken.values()}
    paths = []
    for node in order:
        if id(node) in has_taken_child:
            continue  # a deeper taken path carries it
        parts = []
        n = node
        while n is not None and n.parent is not None:
            parts.append(n.tokens)
            n = n.parent
        path = array("q")
        for tokens in reversed(parts):
            path.extend(tokens)
        paths.append(path)
    return paths


__all__ = ["rewarm_paths"]
