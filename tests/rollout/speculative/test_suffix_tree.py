"""rollout/speculative/suffix_tree.py: the suffix trie against its brute-force twin (longest match,
most frequent continuation, the share cut-off), texts grown token by token equal texts built at once,
removal undoes insertion exactly, and the proposer's memory bound, keys and eviction."""
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.request import Sequence
from rollout.sampling import SamplingParams
from rollout.speculative.suffix_tree import SuffixProposer, SuffixTree, reference_propose

texts_st = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=30), min_size=1, max_size=5)


def shape(node) -> dict:
    """The trie under `node` as nested {token: (count, subtree)}."""
    return {t: (c.count, shape(c)) for t, c in node.children.items()}


@settings(max_examples=200, deadline=None)
@given(texts=texts_st, context=st.lists(st.integers(0, 4), min_size=1, max_size=12),
       k=st.integers(1, 8), min_share=st.sampled_from([0.0, 0.3, 0.5, 0.9]), depth=st.integers(2, 7))
def test_the_tree_proposes_what_brute_force_over_the_texts_does(texts, context, k, min_share, depth):
    tree = SuffixTree(depth)
    for text in texts:
        tree.extend(tree.new_text(), text)
    assert tree.propose(context, k, min_share) == reference_propose(texts, context, k, min_share, depth)


@settings(max_examples=100, deadline=None)
@given(texts=texts_st, cuts=st.lists(st.integers(0, 30), min_size=5, max_size=5), depth=st.integers(2, 6),
       drop=st.integers(0, 4))
def test_growing_texts_token_by_token_and_removing_one_leave_the_trie_of_the_rest(texts, cuts, depth, drop):
    grown = SuffixTree(depth)
    ids = [grown.new_text() for _ in texts]
    for i, text in enumerate(texts):  # interleaved: a piece of every text, then the rest
        grown.extend(ids[i], text[:cuts[i]])
    for i, text in enumerate(texts):
        for token in text[cuts[i]:]:
            grown.extend(ids[i], [token])
    drop %= len(texts)
    grown.remove(ids[drop])
    built = SuffixTree(depth)
    for i, text in enumerate(texts):
        if i != drop:
            built.extend(built.new_text(), text)
    assert shape(grown.root) == shape(built.root)
    if len(texts) == 1:
        assert grown.root.children == {}  # nothing left behind


def test_counts_are_occurrences_of_each_substring():
    tree = SuffixTree(3)
    tree.extend(tree.new_text(), [1, 2, 1, 2, 1])
    assert tree.root.children[1].count == 3 and tree.root.children[2].count == 2
    assert tree.root.children[1].children[2].count == 2  # "1 2" twice
    assert tree.root.children[1].children[2].children[1].count == 2  # "1 2 1" twice; depth 3 ends there
    assert tree.root.children[1].children[2].children[1].children == {}
    assert tree.propose([2, 1], 4, 0.0) == ([2, 1, 2, 1], 2)  # copies the repeat, re-matching past the depth


def test_a_branching_point_ends_the_proposal():
    tree = SuffixTree(8)
    for tail in ([5, 6], [5, 7], [5, 6]):
        tree.extend(tree.new_text(), [1, 2, 3, *tail])
    assert tree.propose([9, 1, 2], 8, 0.5) == ([3, 5, 6], 2)  # 6 follows "3 5" 2 of 3 times: kept
    assert tree.propose([9, 1, 2], 8, 0.7) == ([3, 5], 2)  # under a 0.7 share: stops before the branch
    assert tree.propose([8, 8], 4, 0.0) == ([], 0)  # nothing of it ever seen


def seq(tokens: list[int], prompt_len: int, boundaries: tuple[int, ...] = ()) -> Sequence:
    return Sequence(0, "r", list(tokens), prompt_len, SamplingParams(), torch.Generator(),
                    turn_boundaries=boundaries)


def test_siblings_propose_each_others_text_and_a_later_epoch_finds_it():
    proposer = SuffixProposer(max_depth=8)
    prompt = [1, 2, 3]
    first = seq(prompt + [10, 11, 12, 13, 14], 3)
    proposer.propose_batch([first], [0])  # fed, nothing asked
    sibling = seq(prompt + [10, 11], 3)
    (p,) = proposer.propose_batch([sibling], [3])
    assert p.tokens == [12, 13, 14] and p.kind == "suffix:2"
    other_prompt = seq([7, 7, 7, 10, 11], 3)
    assert proposer.propose_batch([other_prompt], [3])[0].tokens == []  # another prompt's tree is empty
    proposer.clear()  # the engine sleeps; the next epoch's sample of the same prompt
    again = seq(prompt + [10], 3)
    assert proposer.propose_batch([again], [2])[0].tokens == [11, 12]


def test_multi_turn_requests_key_by_their_first_turn():
    proposer = SuffixProposer()
    turn2 = seq([1, 2, 3, 40, 41, 5, 6], 7, boundaries=(3, 5))
    assert proposer.key_of(turn2) == (1, 2, 3)
    assert proposer.key_of(seq([1, 2, 3, 9], 3)) == (1, 2, 3)


def test_memory_stays_within_max_tokens_evicting_the_oldest_texts():
    rng = random.Random(0)
    proposer = SuffixProposer(max_depth=6, max_tokens=200)
    for i in range(40):
        s = seq([i % 7, 100] + [rng.randrange(5) for _ in range(30)], 2)
        proposer.propose_batch([s], [2])
        assert proposer.num_tokens <= 200
        assert proposer.num_tokens == sum(t.num_tokens for t in proposer.trees.values())
    assert proposer.num_evicted > 0 and len(proposer.trees) <= 7
    for tree in proposer.trees.values():  # what is left is exactly the trie of the texts kept
        rebuilt = SuffixTree(6)
        for text in tree.texts.values():
            rebuilt.extend(rebuilt.new_text(), text)
        assert shape(tree.root) == shape(rebuilt.root)
