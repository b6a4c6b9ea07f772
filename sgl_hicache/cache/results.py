"""What the cache answers to a match and to an insert (named apart from SGLang's own result types)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from ..tree.node import TreeNode


@dataclass
class PrefixMatch:
    """What of a prompt the tree holds, and in which tier.

    `path` is the matched chain of nodes from the root; the first `device_tokens` tokens are on the
    device, the next `host_tokens` only on host, the next `disk_tokens` only in the lower tier
    (residency is prefix-closed per tier, so the attribution is always in that order).
    `device_handles` are the device pages of the device part, in order (an int64 `array`).
    """

    path: list[TreeNode]
    device_tokens: int
    host_tokens: int
    disk_tokens: int
    device_handles: array
    last_node: TreeNode
    last_device_node: TreeNode

    @property
    def tokens(self) -> int:
        return self.device_tokens + self.host_tokens + self.disk_tokens

    @property
    def lower_tier_tokens(self) -> int:
        return self.host_tokens + self.disk_tokens

    def head(self, tokens: int) -> PrefixMatch:
        """The match cut to its first `tokens` tokens: the figures exactly, the path to the whole
        nodes that fit."""
        covered = max(0, min(tokens, self.tokens))
        dev = min(self.device_tokens, covered)
        host = min(self.host_tokens, covered - dev)
        path: list[TreeNode] = []
        seen = 0
        for node in self.path:
            seen += len(node.tokens)
            if seen > covered:
                break
            path.append(node)
        page_size = len(self.path[0].tokens) // self.path[0].num_pages if self.path else 1
        last = path[-1] if path else self.last_device_node
        handles = self.device_handles[: dev // page_size]
        return PrefixMatch(path, dev, host, covered - dev - host, handles, last, self.last_device_node)


@dataclass
class InsertOutcome:
    """`prefix_tokens` were already in the tree's device tier; `duplicates` are the caller's device
    pages that the tree did not take (it already held those pages) and the caller must free (an
    int64 `array`)."""

    prefix_tokens: int
    duplicates: array
    last_node: TreeNode
    adopted_pages: int = 0  # caller's pages the tree took ownership of
    new_nodes: tuple[TreeNode, ...] = ()  # nodes the insert created (write-through starts from them)
