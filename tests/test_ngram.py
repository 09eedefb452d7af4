"""The n-gram (prompt lookup) matcher."""

import pytest

from specdemo.core.acceptance import Verdict
from specdemo.core.protocol import Proposal, RoundResult
from specdemo.methods.ngram import LOOKUP_DEPTHS, LOOKUP_PRIOR, LookupBranch, NgramDrafter, NgramIndex


def test_longest_suffix_match_wins():
    index = NgramIndex(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    index.extend([1, 2, 3, 4, 9, 3, 5, 1, 2, 3])
    # suffix (1, 2, 3) occurred at 0..2 and was followed by 4, 9, 3; the 1-gram (3) last occurred at 5 (-> 5)
    assert index.lookup(3) == [4, 9, 3]


def test_most_recent_occurrence_is_preferred():
    index = NgramIndex(1, 2, prefer="recent")
    index.extend([7, 8, 1, 7, 8, 2, 7, 8])
    assert index.lookup(1) == [2]


def test_first_occurrence_when_asked():
    index = NgramIndex(1, 2, prefer="first")
    index.extend([7, 8, 1, 7, 8, 2, 7, 8])
    assert index.lookup(2) == [1, 7]
    growing = NgramIndex(1, 2, prefer="first")
    for end in range(1, 9):
        growing.extend([7, 8, 1, 7, 8, 2, 7, 8][:end])
    assert growing.lookup(2) == [1, 7]


def test_follow_continues_the_last_accepted_copy():
    #          0  1  2  3  4  5  6  7
    tokens = [8, 5, 8, 6, 8, 7, 9, 8]  # (8) ended at 0, 2 and 4 before the suffix
    index = NgramIndex(1, 2, prefer="follow")
    index.extend(tokens)
    assert index.find(2) == ([7, 9], 4)  # nothing copied yet: the most recent occurrence
    assert index.find(2, follow_from=1) == ([6, 8], 2)  # the first occurrence at or after where the copy ended
    assert index.find(2, follow_from=2) == ([6, 8], 2)
    assert index.find(2, follow_from=5) == ([7, 9], 4)  # none after it: the most recent again
    assert NgramIndex(1, 2, prefer="first").find(2, follow_from=3) == ([], None)  # empty index


def round_result(tokens, accepted):
    return RoundResult(Proposal(tokens), Verdict(accepted, 0))


def test_drafter_follows_only_accepted_copies_and_forgets_them_on_a_new_sequence():
    drafter = NgramDrafter(1, 2)  # "follow" is the default
    drafter.start([8, 5, 8, 6])
    assert drafter.propose([8, 5, 8, 6, 8], 1).tokens == [6]  # (6, 8) never occurred; (8) last ended at 2
    drafter.feedback(round_result([6], 0))  # rejected: nothing to follow
    assert drafter.index.follow_from is None
    drafter.propose([8, 5, 8, 6, 8, 7, 9, 8], 2)
    drafter.feedback(round_result([9, 8], 1))  # copied from the occurrence ending at 4, one token accepted
    assert drafter.index.follow_from == 5
    drafter.propose([3, 3, 3], 2)  # a different sequence: the index starts over and so does following
    assert drafter.index.follow_from is None
    drafter.feedback(round_result([3, 3], 2))
    assert drafter.index.follow_from == 3  # the copy of (3) after its occurrence ending at 1, both accepted
    drafter.start([1])
    assert drafter.index.follow_from is None
    drafter.feedback(round_result([], 0))  # a round without a copy follows nothing
    assert drafter.index.follow_from is None


def test_an_unknown_preference_is_refused():
    import pytest

    with pytest.raises(ValueError, match="follow, recent, first"):
        NgramIndex(1, 2, prefer="best")


def test_falls_back_to_shorter_ngrams_and_to_nothing():
    index = NgramIndex(1, 3)
    index.extend([5, 6, 7, 1, 2, 7])
    assert index.lookup(2) == [1, 2]  # only the 1-gram (7) matches
    none = NgramIndex(2, 3)
    none.extend([1, 2, 3, 4])
    assert none.lookup(4) == []


def test_continuation_may_run_into_the_suffix_and_is_capped():
    index = NgramIndex(1, 2)
    index.extend([4, 4, 4])
    assert index.lookup(5) == [4]  # (4, 4) last ended at 1; followed by one token only
    index.extend([4, 4, 4, 4])
    assert len(index.lookup(2)) == 2


def test_incremental_updates_equal_a_fresh_index():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    growing = NgramIndex(1, 4)
    for end in range(1, len(tokens) + 1):
        growing.extend(tokens[:end])
        fresh = NgramIndex(1, 4)
        fresh.extend(tokens[:end])
        assert growing.lookup(5) == fresh.lookup(5)
        assert growing._ends == fresh._ends


def test_a_different_sequence_resets_the_index():
    index = NgramIndex(1, 2)
    index.extend([1, 2, 3, 1])
    assert index.lookup(2) == [2, 3]
    index.extend([9, 9, 8, 9])
    assert index.lookup(2) == [8, 9]  # (9) last ended at 1, followed by 8, 9


def test_drafter_interface():
    drafter = NgramDrafter(1, 3)
    drafter.start([1, 2, 3])
    assert drafter.propose([1, 2, 3, 1, 2], 4).tokens == [3, 1, 2]
    assert drafter.propose([1, 2, 3, 1, 2], 0).tokens == []
    assert drafter.propose([1, 2, 3, 1, 2], 4).draft_probs is None


def test_a_lookup_branch_learns_its_rates_per_position_from_what_the_target_wrote():
    branch = LookupBranch(1, 2)
    start = LOOKUP_PRIOR[0] / LOOKUP_PRIOR[1]
    context = [1, 2, 3, 4, 5, 9, 1, 2]
    tokens, probs = branch.propose(context, 4)
    assert tokens == [3, 4, 5, 9]
    assert probs == pytest.approx([start, start**2, start**3, start**4])  # path probabilities: rates multiplied
    # the target accepted 3, 4, then wrote 7 where the branch had 5: positions 0, 1 right, position 2 wrong
    assert branch.feedback([3, 4]) == 2
    assert branch.rates(2) == [start] * LOOKUP_DEPTHS  # counted when the next branch is proposed
    context += [3, 4, 7]
    branch.propose(context, 4)
    rates = branch.rates(2)  # the copy followed a 2-gram (1, 2)
    assert rates[0] > start and rates[1] > start and rates[2] < start
    assert rates[3:] == [start] * (LOOKUP_DEPTHS - 3)  # position 3 was not tested: the first 3 were not all right
    assert branch.rates(1) == branch.rates(3) == [start] * LOOKUP_DEPTHS  # other match lengths learn apart


def test_a_lookup_branch_is_scored_over_the_rounds_it_takes_to_write_it_verified_or_not():
    branch = LookupBranch(1, 1)
    start = LOOKUP_PRIOR[0] / LOOKUP_PRIOR[1]
    context = [5, 1, 2, 3, 4, 6, 5]
    assert branch.propose(context, 5)[0] == [1, 2, 3, 4, 6]
    # a tree that held none of it: the target writes 1 itself, then two tokens a round
    assert branch.feedback([]) == 0
    for written in ([1], [2, 3], [4, 6]):
        context += written
        branch.propose(context, 5)
        if written != [4, 6]:
            assert branch.rates(1) == [start] * LOOKUP_DEPTHS  # still open: right so far, not all written
    # the whole branch was written: every position tested and right, though no round verified past its first
    rates = branch.rates(1)
    assert all(rate > start for rate in rates[:5]) and rates[5:] == [start] * (LOOKUP_DEPTHS - 5)
    branch.start()  # a new run forgets the open branches, not the rates
    assert branch._open == [] and branch.rates(1) == rates


def test_a_lookup_branch_follows_its_accepted_copies_and_starts_over():
    #          0  1  2  3  4  5  6  7
    context = [8, 5, 8, 6, 8, 7, 9, 8]
    branch = LookupBranch(1, 2)
    assert branch.propose(context, 2)[0] == [7, 9]  # the most recent occurrence of (8), which ends at 4
    assert branch.feedback([]) == 0 and branch.index.follow_from is None  # nothing accepted: no copy to follow
    branch.propose(context, 2)
    assert branch.feedback([7]) == 1 and branch.index.follow_from == 5  # one copied token accepted
    branch.start()
    assert branch.index.follow_from is None and branch.propose(context, 2)[0] == [7, 9]
