"""A radix tree over token ids with SGLang's RadixCache semantics, plus an optional host tier.

Why this shape:
- Edges are compressed: a node holds a tuple of token ids (its key) and its children are
  indexed by their first token. Matching compares whole edges with list slices (C speed);
  a mismatch inside an edge is located by bisection over slice compares, never by a
  per-token Python loop. Contexts of 32K tokens cost microseconds.
- Like SGLang (`mem_cache/radix_cache.py`), a match that ends inside an edge splits it, so
  a request can lock exactly the prefix it uses; locks count along the path to the root and
  locked nodes are never evicted; eviction takes unlocked leaves in LRU order, and a parent
  becomes a candidate when its last child goes.
- The host tier stands in for HiCache (`mem_cache/hiradix_cache.py`). A node can have a
  host copy ("backed"). With SGLang's default write-through policy a node is backed up
  when it is inserted; with write-back, when it is evicted from the device. An evicted
  node that is backed stays in the tree as host-only, and a later match continues through
  it; one that is not is dropped. The host store counts every backed token (device nodes'
  copies included) and makes room by evicting host-only leaves, LRU. Loading a node back
  to the device keeps its host copy. Device-resident nodes always form the top of the tree
  (a device node's parent is on device), so a match is "device part, then host part".
- Session references (SGLang's `enable_session_radix_cache`, unified radix cache): a node
  that is the latest leaf of an open session is "referenced"; eviction takes every
  unreferenced candidate before any referenced one (soft protection: nothing is pinned);
  with eviction_policy="priority" priority comes first, then the reference, then LRU.
  Closing a session only drops its reference.
- Candidates for eviction sit in heaps with lazy invalidation: an entry carries the key it
  was pushed with, and is discarded when popped if the node changed since. This keeps
  `evict` O(k log n) instead of SGLang's scan of every leaf per call.

Time is a logical counter (`tick`), bumped on every match and insert: deterministic, and it
orders accesses exactly as SGLang's `time.monotonic()` stamps do.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

DEVICE = 0
HOST = 1

EvictionPolicy = Literal["lru", "priority"]
WritePolicy = Literal["write_through", "write_back"]
# Token runs are tuples: slices compare at C speed, and tuples of ints are untracked by the
# cyclic garbage collector, which would otherwise rescan millions of cached token ids.
Key = tuple[int, ...]


def _as_tuple(ids: Sequence[int]) -> Key:
    return ids if type(ids) is tuple else tuple(ids)


class Node:
    """One compressed edge of the tree. `key` is the token run from the parent to here."""

    __slots__ = (
        "alive",
        "backed",
        "children",
        "key",
        "last_access",
        "lock",
        "n_dev_children",
        "parent",
        "priority",
        "session_refs",
        "tier",
    )

    def __init__(self, key: Key, parent: Node | None, tier: int = DEVICE) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock = 0  # requests using this node (directly or through a descendant)
        self.last_access = 0
        self.priority = 0
        self.session_refs = 0  # open sessions whose latest leaf this is
        self.tier = tier
        self.n_dev_children = 0  # children on device: a node is a device leaf when 0
        self.alive = True
        self.backed = False  # has a copy in the host store (HiCache)

    def depth(self) -> int:
        """Tokens from the root to the end of this node."""
        n = 0
        node: Node | None = self
        while node is not None:
            n += len(node.key)
            node = node.parent
        return n

    def __repr__(self) -> str:
        tier = "dev" if self.tier == DEVICE else "host"
        return f"Node(len={len(self.key)}, {tier}, lock={self.lock}, t={self.last_access})"


@dataclass(frozen=True)
class Match:
    """A prefix match: `device_len` tokens on device, then `host_len` more on host.

    `device_node` ends the device part (the root if none), `node` ends the whole match."""

    device_len: int
    host_len: int
    device_node: Node
    node: Node

    @property
    def length(self) -> int:
        return self.device_len + self.host_len


@dataclass(frozen=True)
class Insert:
    """Result of an insert: `device_prefix` tokens of the key were already on device (the
    caller's copies of them are duplicates and get freed); `node` ends the key."""

    device_prefix: int
    node: Node


class RadixCache:
    """Token-id radix tree. Counters are in tokens.

    device_tokens: tokens held on device by the tree (SGLang: total size).
    evictable_tokens: device tokens in unlocked nodes (SGLang: evictable_size).
    protected_tokens: device tokens in locked nodes (SGLang: protected_size).
    host_tokens: tokens held in the host store (copies of device nodes and host-only nodes).
    host_only_tokens: tokens in the tree that are only on host.
    """

    def __init__(
        self,
        host_capacity: int = 0,
        eviction_policy: EvictionPolicy = "lru",
        track_eviction: bool = True,
        write_policy: WritePolicy = "write_through",
    ) -> None:
        if eviction_policy not in ("lru", "priority"):
            raise ValueError(f"unknown radix eviction policy {eviction_policy!r}")
        if write_policy not in ("write_through", "write_back"):
            raise ValueError(f"unknown HiCache write policy {write_policy!r}")
        self.write_through = write_policy == "write_through" and host_capacity > 0
        self.write_back = write_policy == "write_back" and host_capacity > 0
        self.root = Node((), None)
        self.root.lock = 1  # the root is never a candidate
        self.host_capacity = host_capacity
        self.eviction_policy: EvictionPolicy = eviction_policy
        # A tree that never evicts (the engine's shadow record of all computed KV) skips heaps.
        self.track_eviction = track_eviction
        self.device_tokens = 0
        self.evictable_tokens = 0
        self.host_tokens = 0
        self.host_only_tokens = 0
        self.n_nodes = 1
        self._tick = 0
        self._seq = 0
        self._dev_heap: list[tuple[int, int, int, Node]] = []
        self._host_heap: list[tuple[int, int, int, Node]] = []
        # cumulative
        self.evicted_to_host = 0  # device tokens evicted that stay as host-only nodes
        self.evicted_dropped = 0  # device tokens evicted and gone (no host copy)
        self.host_evicted = 0  # host-only tokens evicted from the host store

    @property
    def protected_tokens(self) -> int:
        return self.device_tokens - self.evictable_tokens

    # ---- matching and inserting -----------------------------------------------------

    def match_prefix(self, ids: Sequence[int], limit: int | None = None) -> Match:
        """Longest cached prefix of ids[:limit]. Touches (LRU) every node on the path and
        splits the last edge if the match ends inside it."""
        ids = _as_tuple(ids)
        n = len(ids) if limit is None else min(limit, len(ids))
        tick = self._next_tick()
        node = self.root
        pos = 0
        device_node, device_len = self.root, 0
        while pos < n:
            step = self._descend(node, ids, pos, n)
            if step is None:
                break
            child, m = step
            self._touch(child, tick)
            pos += m
            node = child
            if child.tier == DEVICE:
                device_node, device_len = child, pos
        return Match(device_len, pos - device_len, device_node, node)

    def _descend(
        self, node: Node, ids: tuple[int, ...], pos: int, n: int
    ) -> tuple[Node, int] | None:
        """The child of `node` that ids[pos:n] continues into, and how many of its tokens
        match; an edge matched only in part is split there first. None: no such child."""
        child = node.children.get(ids[pos])
        if child is None:
            return None
        key = child.key
        size = len(key)
        if pos + size <= n and ids[pos : pos + size] == key:
            return child, size
        m = self._match_edge(key, ids, pos, n)
        return self._split(child, m), m

    def prefix_len(self, ids: Sequence[int], limit: int | None = None) -> int:
        """Length of the longest prefix of ids[:limit] in the tree (device or host), read
        only: no split, no LRU touch."""
        ids = _as_tuple(ids)
        n = len(ids) if limit is None else min(limit, len(ids))
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(ids[pos])
            if child is None:
                break
            key = child.key
            size = len(key)
            if pos + size <= n and ids[pos : pos + size] == key:
                pos += size
                node = child
                continue
            return pos + self._match_edge(key, ids, pos, n)
        return pos

    def insert(
        self,
        ids: Sequence[int],
        limit: int | None = None,
        priority: int = 0,
        at: Node | None = None,
    ) -> Insert:
        """Insert ids[:limit] (KV the caller computed). Host-resident nodes on the path are
        revived with the caller's copy; new tokens become an unlocked device leaf. Every
        node on the path is touched and gets priority max(own, priority).

        `at`: a live device node (e.g. a request's locked node); then `ids` are the tokens
        that FOLLOW it. Inserting a request's new tokens then costs O(new tokens), not
        O(context). The path above `at` is still touched. device_prefix counts from the
        root either way."""
        ids = _as_tuple(ids)
        n = len(ids) if limit is None else min(limit, len(ids))
        tick = self._next_tick()
        node, pos = self.root, 0
        base = 0
        if at is not None and at is not self.root:
            assert at.alive and at.tier == DEVICE, "insert(at=...) needs a live device node"
            node, base = at, at.depth()
            self._touch_up(at, tick, priority)
        device_prefix = 0
        on_device = True  # device nodes form the top of the tree: count until the first host
        while pos < n:
            step = self._descend(node, ids, pos, n)
            if step is None:
                break
            child, m = step
            if priority > child.priority:
                child.priority = priority
            if child.tier == HOST:
                on_device = False
                self._to_device(child)
            elif on_device:
                device_prefix += m
            self._touch(child, tick)
            pos += m
            node = child
        if pos < n:
            leaf = Node(ids[pos:n], node)
            leaf.last_access = tick
            leaf.priority = priority
            node.children[leaf.key[0]] = leaf
            node.n_dev_children += 1
            self.n_nodes += 1
            size = n - pos
            self.device_tokens += size
            self.evictable_tokens += size
            self._push_dev(leaf)
            if self.write_through:
                self._backup(leaf)
            node = leaf
        return Insert(base + device_prefix, node)

    def _touch_up(self, node: Node, tick: int, priority: int) -> None:
        """Touch node and its ancestors (what a walk from the root would have touched)."""
        while node is not self.root:
            if priority > node.priority:
                node.priority = priority
            self._touch(node, tick)
            node = node.parent  # type: ignore[assignment]

    def load_back(self, node: Node) -> int:
        """Load the host-only part of the path ending at `node` back to device (host copies
        stay). Returns the tokens loaded (the caller charges the transfer and allocates
        device memory)."""
        path = []
        while node.tier == HOST:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        moved = 0
        tick = self._next_tick()
        for h in reversed(path):
            moved += len(h.key)
            self._to_device(h)
            self._touch(h, tick)
        return moved

    # ---- locks ----------------------------------------------------------------------

    def inc_lock(self, node: Node) -> None:
        """Protect the path root..node from eviction (SGLang inc_lock_ref)."""
        while node is not self.root:
            if node.tier != DEVICE:
                raise ValueError("only device-resident nodes can be locked")
            if node.lock == 0:
                self.evictable_tokens -= len(node.key)
            node.lock += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock <= 0:
                raise ValueError("dec_lock on an unlocked node")
            node.lock -= 1
            if node.lock == 0:
                self.evictable_tokens += len(node.key)
                if node.n_dev_children == 0:
                    self._push_dev(node)
            node = node.parent  # type: ignore[assignment]

    # ---- eviction -------------------------------------------------------------------

    def evict(self, n_tokens: int) -> int:
        """Evict at least n_tokens device tokens (fewer if not enough are evictable) from
        unlocked leaves, least valuable first. Returns the device tokens freed."""
        freed = 0
        heap = self._dev_heap
        while freed < n_tokens and heap:
            entry = heapq.heappop(heap)
            node = entry[3]
            if not self._dev_candidate(node, entry):
                continue
            freed += len(node.key)
            self._evict_device(node)
        return freed

    def _evict_device(self, node: Node) -> None:
        size = len(node.key)
        parent = node.parent
        assert parent is not None
        self.device_tokens -= size
        self.evictable_tokens -= size
        parent.n_dev_children -= 1
        if node.backed or (self.write_back and self._backup(node)):
            node.tier = HOST
            self.host_only_tokens += size
            self.evicted_to_host += size
            if not node.children:
                self._push_host(node)
        else:
            self.evicted_dropped += size
            self._delete_subtree(node)
        if parent is not self.root and parent.lock == 0 and parent.n_dev_children == 0:
            self._push_dev(parent)

    def _backup(self, node: Node) -> bool:
        """Give node a host copy if the host store has (or can make) room."""
        size = len(node.key)
        if size > self.host_capacity:
            return False
        heap = self._host_heap
        while self.host_tokens + size > self.host_capacity and heap:
            entry = heapq.heappop(heap)
            victim = entry[3]
            if not self._host_candidate(victim, entry):
                continue
            self.host_tokens -= len(victim.key)
            self.host_only_tokens -= len(victim.key)
            self.host_evicted += len(victim.key)
            self._unlink(victim)
        if self.host_tokens + size > self.host_capacity:
            return False
        node.backed = True
        self.host_tokens += size
        return True

    def _delete_subtree(self, node: Node) -> None:
        """Remove a just-evicted device node and its subtree (all host-resident)."""
        stack = [node]
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            if x is not node:
                self.host_tokens -= len(x.key)
                self.host_only_tokens -= len(x.key)
                self.host_evicted += len(x.key)
            x.alive = False
            self.n_nodes -= 1
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[0]]
        node.children = {}
        self._after_child_removed(parent)

    def _unlink(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[0]]
        node.alive = False
        self.n_nodes -= 1
        self._after_child_removed(parent)

    def _after_child_removed(self, parent: Node) -> None:
        if parent.tier == HOST and not parent.children:
            self._push_host(parent)

    # ---- internals ------------------------------------------------------------------

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    @staticmethod
    def _match_edge(key: Key, ids: Key, pos: int, n: int) -> int:
        """Tokens of key equal to ids[pos:n] from the start (key[0] == ids[pos] is known)."""
        hi = min(len(key), n - pos)
        if ids[pos : pos + hi] == key[:hi]:
            return hi
        lo = 1  # key[:lo] matches; bisect the first mismatch with slice compares
        hi -= 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ids[pos + lo : pos + mid] == key[lo:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, child: Node, m: int) -> Node:
        """Split child's edge after m tokens; returns the new upper node (same tier, locks,
        access time and priority as child). Counters are unchanged."""
        parent = child.parent
        assert parent is not None
        top = Node(child.key[:m], parent, child.tier)
        top.lock = child.lock
        top.last_access = child.last_access
        top.priority = child.priority
        top.backed = child.backed
        child.key = child.key[m:]
        child.parent = top
        top.children[child.key[0]] = child
        top.n_dev_children = 1 if child.tier == DEVICE else 0
        parent.children[top.key[0]] = top
        self.n_nodes += 1
        return top

    def _touch(self, node: Node, tick: int) -> None:
        node.last_access = tick
        if node.tier == DEVICE:
            if node.lock == 0 and node.n_dev_children == 0:
                self._push_dev(node)
        elif not node.children:
            self._push_host(node)

    def _to_device(self, node: Node) -> None:
        size = len(node.key)
        node.tier = DEVICE  # the host copy stays: a later eviction costs no write
        self.host_only_tokens -= size
        self.device_tokens += size
        self.evictable_tokens += size  # host nodes are never locked
        assert node.parent is not None
        node.parent.n_dev_children += 1

    def _key(self, node: Node) -> tuple[int, int]:
        # referenced nodes sort after unreferenced ones (under "priority": within a priority)
        ref = 1 if node.session_refs else 0
        if self.eviction_policy == "priority":
            return 2 * node.priority + ref, node.last_access
        return ref, node.last_access

    # ---- session references -----------------------------------------------------------

    def ref(self, node: Node) -> None:
        """An open session's latest leaf is now `node`."""
        node.session_refs += 1
        self._repush(node)

    def unref(self, node: Node) -> None:
        """A session moved on from `node` or closed (a dead node is fine)."""
        node.session_refs = max(0, node.session_refs - 1)
        self._repush(node)

    def _repush(self, node: Node) -> None:
        """The node's eviction key changed: its old heap entry goes stale, push a new one."""
        if self._dev_candidate(node):
            self._push_dev(node)
        elif self._host_candidate(node):
            self._push_host(node)

    def _push_dev(self, node: Node) -> None:
        if not self.track_eviction:
            return
        p, t = self._key(node)
        self._seq += 1
        heapq.heappush(self._dev_heap, (p, t, self._seq, node))
        if len(self._dev_heap) > 4 * self.n_nodes + 1024:
            self._rebuild_heaps()

    def _push_host(self, node: Node) -> None:
        if not self.track_eviction or self.host_capacity <= 0:
            return
        p, t = self._key(node)
        self._seq += 1
        heapq.heappush(self._host_heap, (p, t, self._seq, node))
        if len(self._host_heap) > 4 * self.n_nodes + 1024:
            self._rebuild_heaps()

    def _dev_candidate(self, node: Node, entry: tuple[int, int, int, Node] | None = None) -> bool:
        ok = (
            node.alive
            and node.tier == DEVICE
            and node.lock == 0
            and node.n_dev_children == 0
            and node is not self.root
        )
        return ok and (entry is None or entry[:2] == self._key(node))

    def _host_candidate(self, node: Node, entry: tuple[int, int, int, Node] | None = None) -> bool:
        ok = node.alive and node.tier == HOST and not node.children
        return ok and (entry is None or entry[:2] == self._key(node))

    def _rebuild_heaps(self) -> None:
        """Drop stale entries: one entry per current candidate."""
        dev, host = [], []
        for node in self.nodes():
            p, t = self._key(node)
            self._seq += 1
            if self._dev_candidate(node):
                dev.append((p, t, self._seq, node))
            elif self._host_candidate(node):
                host.append((p, t, self._seq, node))
        heapq.heapify(dev)
        heapq.heapify(host)
        self._dev_heap, self._host_heap = dev, host

    # ---- inspection (tests, debugging) ---------------------------------------------

    def nodes(self) -> list[Node]:
        """Every node but the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(x.children.values())
        return out

    def check(self) -> None:
        """Recompute every counter from the tree and compare (tests call this)."""
        dev = evictable = host = host_only = 0
        for x in self.nodes():
            assert x.alive and x.key, x
            assert x.parent is not None and x.parent.children.get(x.key[0]) is x
            if x.tier == DEVICE:
                assert x.parent is self.root or x.parent.tier == DEVICE, "device under host"
                dev += len(x.key)
                if x.lock == 0:
                    evictable += len(x.key)
            else:
                assert x.lock == 0 and x.backed, "host-only nodes are unlocked and backed"
                host_only += len(x.key)
            if x.backed:
                host += len(x.key)
            n_dev = sum(1 for c in x.children.values() if c.tier == DEVICE)
            assert n_dev == x.n_dev_children, x
            assert all(x.lock >= c.lock for c in x.children.values()), "lock not on path"
        counted = (dev, evictable, host, host_only)
        kept = (self.device_tokens, self.evictable_tokens, self.host_tokens, self.host_only_tokens)
        assert counted == kept, (counted, kept)
        assert host <= self.host_capacity, (host, self.host_capacity)
