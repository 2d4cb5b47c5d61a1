"""The device-side token history the samplers read: rows always equal each request's generated tokens,
however requests come, go, reuse seats, outgrow the table or have their tokens set by hand."""

import torch
from hypothesis import given, settings, strategies as st

from intone.ops.token_history import TokenHistory, last_tokens


def seats_of(history, ids, lists):
    """The step's seats as the runner hands them to the device."""
    return torch.from_numpy(history.assign(ids, lists))


def expected_rows(lists, capacity):
    return torch.tensor([toks + [-1] * (capacity - len(toks)) for toks in lists])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sets(st.integers(0, 9), max_size=6), st.integers(0, 99)), min_size=1, max_size=25))
def test_rows_follow_every_request_through_joins_leaves_and_growth(steps):
    history = TokenHistory("cpu", seats=2, capacity=40)
    tokens: dict[str, list[int]] = {}
    for live, value in steps:
        ids = sorted(f"r{i}" for i in live)
        for rid in list(tokens):
            if rid not in ids:
                del tokens[rid]  # left: it never comes back under the same id
        lists = [tokens.setdefault(rid, []) for rid in ids]
        if any(len(t) >= 39 for t in lists):
            break
        seats = seats_of(history, ids, lists)
        counts = torch.tensor([len(t) for t in lists])
        if ids:
            assert torch.equal(history.rows(seats, counts), expected_rows(lists, 40))
            assert len(set(seats.tolist())) == len(ids)  # a seat holds one request
            new = torch.tensor([value + i for i in range(len(ids))])
            history.record(seats, counts, new)
            for t, v in zip(lists, new.tolist()):
                t.append(v)
        assert len(history) == len(ids)


def test_tokens_set_by_hand_are_written_before_they_are_read():
    history = TokenHistory("cpu", seats=4, capacity=8)
    seats = seats_of(history, ["a"], [[]])
    history.record(seats, torch.tensor([0]), torch.tensor([5]))
    seats = seats_of(history, ["a"], [[7, 8, 9]])  # the host's list disagrees with the seat's count
    assert history.rows(seats, torch.tensor([3])).tolist() == [[7, 8, 9, -1, -1, -1, -1, -1]]


def test_last_tokens_are_right_aligned_and_respect_the_first_position():
    rows = torch.tensor([[1, 2, 3, 4, 5, -1], [9, -1, -1, -1, -1, -1], [-1] * 6])
    counts = torch.tensor([5, 1, 0])
    assert last_tokens(rows, counts, 3).tolist() == [[3, 4, 5], [-1, -1, 9], [-1, -1, -1]]
    # Fish's RAS window never holds the first generated token (position 0)
    assert last_tokens(rows, counts, 10, first=1).tolist()[0] == [-1] * 6 + [2, 3, 4, 5]
    assert last_tokens(rows, counts, 2, first=1).tolist()[1] == [-1, -1]
