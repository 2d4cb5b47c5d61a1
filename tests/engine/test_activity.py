"""A side stage's activity as the AR loop reads it: whether any of its work ran between a step's launch and the
read of its tokens, and the step's company from that."""

import threading

from hypothesis import given, strategies as st

from intone.engine.activity import Activity, company
from intone.protocol import STEP_COMPANY


@given(st.lists(st.sampled_from(["enter", "exit", "mark"]), max_size=30))
def test_ran_since_is_true_exactly_when_a_piece_was_running_at_the_mark_ran_after_it_or_runs_now(events):
    activity, open_pieces, marks = Activity(), 0, []  # marks: (mark, did a piece run since it, per the model)
    for event in events:
        if event == "enter":
            activity.__enter__()
            open_pieces += 1
            marks = [(m, True) for m, _ in marks]
        elif event == "exit" and open_pieces:
            activity.__exit__(None, None, None)
            open_pieces -= 1
        elif event == "mark":
            marks.append((activity.mark(), open_pieces > 0))
    for mark, ran in marks:
        assert activity.ran_since(mark) == (ran or open_pieces > 0)


def test_pieces_from_several_threads_are_all_counted():
    activity, start = Activity(), threading.Barrier(8)
    mark = activity.mark()

    def work():
        start.wait()
        for _ in range(200):
            with activity:
                pass

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert activity.active == 0 and activity.began == 1600 and activity.ran_since(mark)
    assert not activity.ran_since(activity.mark())


@given(st.booleans(), st.sets(st.sampled_from(["codec", "frontend"])))
def test_a_step_has_exactly_one_company_and_a_prefill_counts_first(prefill, beside):
    found = company(prefill, beside)
    assert found in STEP_COMPANY
    expected = "prefill" if prefill else {frozenset(): "alone", frozenset({"codec"}): "codec",
                                          frozenset({"frontend"}): "frontend"}.get(frozenset(beside), "codec+frontend")
    assert found == expected
