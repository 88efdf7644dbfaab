from pagedllm.spec_decode.ngram_proposer import NgramProposer


def test_longest_suffix_match_proposes_what_followed():
    p = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    # suffix [1, 2, 3] occurred at the start, followed by 4 5 6
    assert p.propose([1, 2, 3, 4, 5, 6, 9, 1, 2, 3]) == [4, 5, 6]


def test_most_recent_occurrence_wins_and_proposals_stop_at_the_end():
    p = NgramProposer(num_speculative_tokens=4, min_n=1, max_n=2)
    assert p.propose([7, 8, 1, 7, 8, 2, 7, 8]) == [2, 7, 8]
    assert p.propose([3, 9, 3]) == [9, 3]


def test_no_match_or_too_short():
    p = NgramProposer(num_speculative_tokens=2, min_n=2, max_n=3)
    assert p.propose([1, 2, 3, 4]) == []
    assert p.propose([5]) == []
    assert p.propose([1, 2, 1]) == []  # a 1-gram matches, but min_n is 2
