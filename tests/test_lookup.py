"""Prompt lookup: which continuation is proposed, and when none is."""

from blockspec.speculative.lookup import MAX_NGRAM, lookup


def test_copies_what_followed_the_match():
    assert lookup([1, 2, 3, 4, 9, 9, 1, 2, 3], 2, 3) == [4, 9, 9]


def test_prefers_the_longest_then_the_latest_match():
    assert lookup([3, 1, 2, 8, 4, 1, 2, 9, 5, 1, 2], 2, 2) == [9, 5]  # two (1, 2): the latest
    assert lookup([7, 1, 2, 8, 4, 1, 2, 9, 7, 1, 2], 2, 2) == [8, 4]  # (7, 1, 2) beats the later (1, 2)


def test_match_near_the_end_repeats_periodically():
    assert lookup([5, 1, 2, 7, 1, 2], 2, 4) == [7, 1, 2, 7]
    assert lookup([1, 1, 1, 1], 2, 3) == [1, 1, 1]


def test_no_proposal_without_a_long_enough_match():
    assert lookup([1, 2, 3], 2, 3) == []
    assert lookup([1, 2, 9, 2], 2, 3) == []  # only a 1-gram repeats
    assert lookup([1, 2, 9, 2], 1, 2) == [9, 2]
    assert lookup([4], 1, 2) == [] and lookup([1, 2, 1, 2], 0, 2) == [] and lookup([1, 2, 1, 2], 2, 0) == []


def test_match_length_is_capped():
    pattern = list(range(20))
    tokens = pattern + [99] + pattern  # a 20-token repeat: matched as MAX_NGRAM tokens, copy still exact
    assert MAX_NGRAM < 20 and lookup(tokens, MAX_NGRAM, 3) == [99, 0, 1]
