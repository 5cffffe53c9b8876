"""The position-page requests of a paged step (models/paged_positions.py): checked against each sequence's
new tokens, and the writes' metadata laid out per length bucket."""
import pytest
import torch

from models.paged import StepMetadata
from models.paged_positions import add_position_writes, check_position_pages
from models.state import SegmentBatch


def test_a_sequence_asks_for_at_most_one_page_per_position_before_its_last():
    batch = SegmentBatch(new_lens=[3, 1], starts=[10, 5])
    check_position_pages({0: [[7, 8], []]}, batch)
    with pytest.raises(ValueError, match="sequence 0 asks for 3 position pages in layer 0 with 3 new tokens: "
                                         "expected at most 2"):
        check_position_pages({0: [[7, 8, 9], []]}, batch)
    with pytest.raises(ValueError, match="sequence 1 asks for 1 position pages in layer 2 with 1 new tokens"):
        check_position_pages({2: [[], [4]]}, batch)
    with pytest.raises(ValueError, match=r"position_pages\[0\] has 1 rows for 2 sequences"):
        check_position_pages({0: [[7, 8]]}, batch)


def test_writes_are_laid_out_per_bucket_and_shared_by_a_groups_layers():
    pages = [[7, 8], [], [9]]  # one list object for the group's two layers
    meta = StepMetadata()
    keys = add_position_writes(meta, {0: pages, 1: pages}, [[0, 1], [2]])
    meta.move(torch.device("cpu"))
    assert set(keys) == {(id(pages), (0, 1)), (id(pages), (2,))}  # one entry per bucket, not per layer
    rows, at, dst, top = keys[(id(pages), (0, 1))]
    assert (meta[rows].tolist(), meta[at].tolist(), meta[dst].tolist(), top) == ([0, 0], [1, 2], [7, 8], 2)
    rows, at, dst, top = keys[(id(pages), (2,))]
    assert (meta[rows].tolist(), meta[at].tolist(), meta[dst].tolist(), top) == ([0], [1], [9], 1)
    assert add_position_writes(StepMetadata(), {0: [[], []]}, [[0, 1]]) == {}  # nobody asks: no bucket entry
