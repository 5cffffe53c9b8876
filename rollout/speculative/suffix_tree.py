"""Suffix-tree proposals (SuffixDecoding, Oliaro et al. 2024; Seer's grouped speculation): what a
sequence may say next, from what its group's siblings and the same prompt's earlier responses said.

RL samples a group of n responses per prompt and revisits every prompt each epoch; the policy moves
slowly, so a sibling's text, or last epoch's, often continues the way this sequence will. One
`SuffixTree` per prompt (the key: the request's first turn, `SuffixProposer.key_of`) stores texts: each
sequence's tokens after that first turn (its answers, and in multi-turn runs the tool outputs and later
prompts, which answers restate), appended as they are generated, kept after the sequence ends.

The tree is a depth-bounded suffix trie: every substring of at most `max_depth` tokens of the stored
texts is a path from the root, and each node counts the substring's occurrences. A proposal, token by
token: take the longest suffix (at most max_depth - 1 tokens) of the sequence's text plus what is
proposed so far that some stored text continues, then the continuation seen most often after it (ties:
the smallest token id); stop at `k` tokens or when that continuation's share of the node's continuations
falls below `min_share` (the adaptive length: a branching point ends the proposal). "Has a continuation"
holds for a suffix only if it holds for each shorter one, so the longest is found by binary search.

Memory is bounded: `max_tokens` stored tokens over every tree (each adds at most max_depth nodes), the
oldest texts evicted first (their counts subtracted, empty nodes removed). Stale-policy text only
proposes: the engine's verification keeps the output exact. `reference_propose` is the plain twin
(brute force over the stored texts) the tests compare against.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq

from rollout.request import Sequence
from rollout.speculative.proposers import Proposal, Proposer

KIND_CAP = 8
"""Match lengths above this share one kind ("suffix:8"): the engine's acceptance estimate per kind."""


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """The depth-bounded suffix trie of a set of texts (module docstring); texts grow at their end."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth={max_depth}, expected >= 2 (a match of one token and its continuation)")
        self.max_depth = max_depth
        self.root = _Node()
        self.texts: dict[int, list[int]] = {}
        """text id -> its tokens (what the trie holds of it)."""
        self._ends: dict[int, list[_Node]] = {}
        """text id -> the nodes of its suffixes of 1 .. max_depth - 1 tokens (the ones a new token extends)."""
        self._next_id = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.texts.values())

    def new_text(self) -> int:
        self.texts[self._next_id], self._ends[self._next_id] = [], []
        self._next_id += 1
        return self._next_id - 1

    def extend(self, text_id: int, tokens: Seq[int]) -> None:
        """Append `tokens` to text `text_id`: each new position adds the substrings ending there, by
        extending the nodes of the suffixes that ended one token before (O(max_depth) per token)."""
        text, ends, root, cap = self.texts[text_id], self._ends[text_id], self.root, self.max_depth - 1
        for token in tokens:
            token = int(token)
            text.append(token)
            new = []
            for parent in [root] + ends:  # suffixes of 1 .. len(ends) + 1 tokens
                children = parent.children
                child = children.get(token)
                if child is None:
                    child = children[token] = _Node()
                child.count += 1
                new.append(child)
            del new[cap:]
            ends = new
        self._ends[text_id] = ends

    def remove(self, text_id: int) -> int:
        """Forget text `text_id` (its occurrences subtracted, empty nodes removed); its token count."""
        text = self.texts.pop(text_id)
        del self._ends[text_id]
        for start in range(len(text)):
            path, node = [], self.root
            for t in text[start:start + self.max_depth]:
                parent, node = node, node.children[t]
                node.count -= 1
                path.append((parent, t, node))
            for parent, t, node in reversed(path):
                if node.count == 0:
                    del parent.children[t]
        return len(text)

    def _node(self, pattern: Seq[int]) -> _Node | None:
        node = self.root
        for t in pattern:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def longest_match(self, context: Seq[int]) -> tuple[int, _Node | None]:
        """(m, node): the longest suffix of `context` of at most max_depth - 1 tokens that some text
        continues, and its node; (0, None) when no token of it was ever continued."""
        lo, hi, best = 1, min(len(context), self.max_depth - 1), (0, None)
        while lo <= hi:  # "continued" is monotone in the suffix's length
            m = (lo + hi) // 2
            node = self._node(context[len(context) - m:])
            if node is not None and node.children:
                best, lo = (m, node), m + 1
            else:
                hi = m - 1
        return best

    def propose(self, context: Seq[int], k: int, min_share: float) -> tuple[list[int], int]:
        """(up to k tokens to follow `context`, the first token's match length) (module docstring)."""
        text, out, first = list(context), [], 0
        m, node = self.longest_match(text)
        while len(out) < k and node is not None:
            total = sum(c.count for c in node.children.values())
            token, child = min(node.children.items(), key=lambda kv: (-kv[1].count, kv[0]))
            if child.count < min_share * total:
                break
            first = first or m
            out.append(token)
            text.append(token)
            if child.children and m + 1 <= self.max_depth - 1:
                m, node = m + 1, child  # the longest match grows by the token (a longer one would have been found)
            else:
                m, node = self.longest_match(text)
        return out, first


def reference_propose(texts: Seq[Seq[int]], context: Seq[int], k: int, min_share: float, max_depth: int
                      ) -> tuple[list[int], int]:
    """`SuffixTree.propose` by brute force over `texts`: for the longest suffix s (<= max_depth - 1
    tokens) of the context-so-far that occurs followed by a token, count each token x following an
    occurrence of s; take the most frequent (ties: the smallest id) while its share >= min_share."""
    text, out, first = list(context), [], 0
    while len(out) < k:
        found = None
        for m in range(min(len(text), max_depth - 1), 0, -1):
            s = text[len(text) - m:]
            follow: dict[int, int] = {}
            for t in texts:
                for i in range(len(t) - m):
                    if list(t[i:i + m]) == s:
                        follow[t[i + m]] = follow.get(t[i + m], 0) + 1
            if follow:
                found = (m, follow)
                break
        if found is None:
            break
        m, follow = found
        token = min(follow, key=lambda x: (-follow[x], x))
        if follow[token] < min_share * sum(follow.values()):
            break
        first = first or m
        out.append(token)
        text.append(token)
    return out, first


class SuffixProposer(Proposer):
    """Proposals from the tree of the sequence's prompt (module docstring). Per sequence it records which
    text of which tree it feeds and how many of its tokens are in; the trees outlive the sequences (and
    the engine's sleeps): the same prompt in the next epoch finds its earlier responses."""

    def __init__(self, max_depth: int = 16, max_tokens: int = 1 << 16, min_share: float = 0.3,
                 key_tokens: int = 256) -> None:
        if max_tokens < 1 or not 0.0 <= min_share <= 1.0 or key_tokens < 1:
            raise ValueError(f"suffix proposer: max_tokens={max_tokens}, min_share={min_share}, key_tokens="
                             f"{key_tokens}; expected >= 1, in [0, 1], >= 1")
        self.max_depth, self.max_tokens, self.min_share, self.key_tokens = max_depth, max_tokens, min_share, key_tokens
        self.trees: OrderedDict[tuple[int, ...], SuffixTree] = OrderedDict()
        self._fed: weakref.WeakKeyDictionary[Sequence, tuple[SuffixTree, int, int, tuple[int, ...]]] = \
            weakref.WeakKeyDictionary()  # seq -> (its tree, its text, tokens fed, its key)
        self._order: deque[tuple[SuffixTree, int]] = deque()  # every stored text, oldest first
        self.num_tokens = 0
        self.num_evicted = 0

    def key_of(self, seq: Sequence) -> tuple[int, ...]:
        """The prompt a sequence belongs to: its tokens up to its first turn boundary (a multi-turn request
        carries the turns' ends), else its prompt, at most `key_tokens` of them."""
        end = seq.turn_boundaries[0] if seq.turn_boundaries else seq.prompt_len
        return tuple(seq.tokens[:min(end, self.key_tokens)])

    def _feed(self, seq: Sequence) -> SuffixTree:
        """Bring `seq`'s text in its tree up to date (a new sequence starts a text); evict past max_tokens."""
        fed = self._fed.get(seq)
        if fed is not None and fed[2] == len(seq.tokens):  # nothing new since the last call
            return fed[0]
        if fed is None:
            key = self.key_of(seq)
            tree = self.trees.get(key)
            if tree is None:
                tree = self.trees[key] = SuffixTree(self.max_depth)
            text_id = tree.new_text()
            self._order.append((tree, text_id))
            fed = (tree, text_id, len(key), key)
        tree, text_id, upto, key = fed
        if key in self.trees:
            self.trees.move_to_end(key)
        new = seq.tokens[upto:]
        if new and text_id in tree.texts:  # an evicted text is not fed again
            tree.extend(text_id, new)
            self.num_tokens += len(new)
        self._fed[seq] = (tree, text_id, len(seq.tokens), key)
        if self.num_tokens > self.max_tokens:
            while self.num_tokens > self.max_tokens and self._order:
                old_tree, old_id = self._order.popleft()
                if old_id in old_tree.texts:
                    self.num_tokens -= old_tree.remove(old_id)
                    self.num_evicted += 1
            for k in [k for k, t in self.trees.items() if not t.texts and t is not tree]:
                del self.trees[k]
        return tree

    def propose_batch(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, ks):
            tree = self._feed(seq)
            if not k:
                out.append(Proposal([]))
                continue
            tokens, m = tree.propose(seq.tokens[-(self.max_depth - 1):], k, self.min_share)
            out.append(Proposal(tokens, kind=f"suffix:{min(m, KIND_CAP)}" if tokens else ""))
        return out

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.propose_batch([seq], [k])[0].tokens

    def observe(self, seqs: list[Sequence]) -> None:
        """Feed the sequences' new tokens to their trees (every step, asked or not: a sibling that was
        never asked still proposes for the ones that decode later, and for the next epoch)."""
        for seq in seqs:
            self._feed(seq)

    def clear(self) -> None:
        """The engine sleeps: per-sequence feeding ends (the trees stay for the next iterations)."""
        self._fed.clear()
