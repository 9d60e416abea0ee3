"""Branch labels on the call tree: the line the harness kept (final), deliberate other samples (n > 1
choices, parallel requests nobody continued after), and attempts a continued retry superseded."""

from __future__ import annotations

from hypothesis import given, settings

from proxy.export.branches import branch_labels
from proxy.export.samples import merge_steps, merged_rows, stepwise_rows
from proxy.store.models import CallRow
from tests.call_trees import Output, SessionBuilder
from tests.unit.test_merge_steps import call_trees


def _out(*ids: int) -> Output:
    return list(ids), [-0.5] * len(ids)


def _one(builder: SessionBuilder, parent: CallRow | None, *added: int, output: int = 7) -> CallRow:
    (call,) = builder.turn(parent, list(added), [_out(output)])
    return call


def _labels(builder: SessionBuilder) -> dict[int, str]:
    return dict(branch_labels(builder.calls))


def test_a_retried_turn_that_the_harness_continued_supersedes_the_first_attempt() -> None:
    b = SessionBuilder()
    t1 = _one(b, None, 1, 2)
    t2a = _one(b, t1, 3, output=8)
    t2b = _one(b, t1, 3, output=9)  # the same request sent again
    t3 = _one(b, t2b, 4)
    assert _labels(b) == {t1.id: "final", t2a.id: "abandoned", t2b.id: "final", t3.id: "final"}
    [row] = merged_rows(b.session, b.calls, None, "disable")
    assert (row["call_ids"], row["branch"]) == ([t1.id, t2b.id, t3.id], "final")
    every = merged_rows(b.session, b.calls, None, "disable", branches="all")
    assert [(r["call_ids"], r["branch"]) for r in every] == [
        ([t1.id, t2a.id], "abandoned"),
        ([t1.id, t2b.id, t3.id], "final"),
    ]
    assert [s["call_id"] for s in stepwise_rows(b.session, b.calls)] == [t1.id, t2b.id, t3.id]
    steps = stepwise_rows(b.session, b.calls, branches="all")
    assert [(s["call_id"], s["branch"]) for s in steps] == [
        (t1.id, "final"),
        (t2a.id, "abandoned"),
        (t2b.id, "final"),
        (t3.id, "final"),
    ]


def test_an_attempt_continued_for_a_while_then_given_up_is_abandoned_whole() -> None:
    b = SessionBuilder()
    t1 = _one(b, None, 1)
    t2a = _one(b, t1, 2)
    t3a = _one(b, t2a, 3)
    t2b = _one(b, t1, 2, output=9)
    t3b = _one(b, t2b, 3)
    labels = _labels(b)
    assert [labels[c.id] for c in (t2a, t3a)] == ["abandoned", "abandoned"]
    assert [labels[c.id] for c in (t1, t2b, t3b)] == ["final"] * 3


def test_going_back_to_an_earlier_attempt_makes_the_other_one_abandoned() -> None:
    b = SessionBuilder()
    t1 = _one(b, None, 1)
    a = _one(b, t1, 2)
    b1 = _one(b, t1, 2, output=9)
    b2 = _one(b, b1, 3)
    a2 = _one(b, a, 3)  # the harness went back to the first attempt and ended there
    labels = _labels(b)
    assert (labels[b1.id], labels[b2.id]) == ("abandoned", "abandoned")
    assert (labels[a.id], labels[a2.id]) == ("final", "final")


def test_n_choices_are_samples_never_abandoned() -> None:
    b = SessionBuilder()
    t1 = _one(b, None, 1)
    c0, c1 = b.turn(t1, [2], [_out(8), _out(9)])
    t3 = _one(b, c1, 3)  # the harness continued the second choice
    assert _labels(b) == {t1.id: "final", c0.id: "sample", c1.id: "final", t3.id: "final"}
    rows = merged_rows(b.session, b.calls, None, "disable")
    assert [(r["call_ids"], r["branch"]) for r in rows] == [
        ([t1.id, c0.id], "sample"),
        ([t1.id, c1.id, t3.id], "final"),
    ]
    # Step-wise, merged back: the shared first call is trained once, with the first choice that
    # extends it; the kept line goes on from its prompt (mask 0 there).
    runs = merge_steps(stepwise_rows(b.session, b.calls))
    assert [(r["call_ids"], r["branch"]) for r in runs] == [
        ([t1.id, c0.id], "sample"),
        ([c1.id, t3.id], "final"),
    ]
    assert runs[1]["prompt_ids"] == [*b.context(t1), 2]


def test_n_choices_of_the_last_turn_the_first_is_final() -> None:
    b = SessionBuilder()
    r0, r1 = b.turn(None, [1], [_out(8), _out(9)])
    assert _labels(b) == {r0.id: "final", r1.id: "sample"}
    assert len(merged_rows(b.session, b.calls, None, "disable")) == 2


def test_parallel_requests_nobody_continued_are_samples_the_latest_final() -> None:
    b = SessionBuilder()
    t1 = _one(b, None, 1)
    leaves = [_one(b, t1, 10 + i) for i in range(4)]
    labels = _labels(b)
    assert [labels[c.id] for c in leaves] == ["sample"] * 3 + ["final"]
    assert len(merged_rows(b.session, b.calls, None, "disable")) == 4


def test_a_leaf_asked_after_the_kept_line_went_on_is_a_sample() -> None:
    b = SessionBuilder()
    t1 = _one(b, None, 1)
    t2 = _one(b, t1, 2)
    t3 = _one(b, t2, 3)
    probe = _one(b, t1, 5)  # a side request from turn 1, after the line moved on
    labels = _labels(b)
    assert labels[probe.id] == "sample"
    assert [labels[c.id] for c in (t1, t2, t3)] == ["final"] * 3


def test_a_resent_first_prompt_is_a_retry_a_new_conversation_is_not() -> None:
    b = SessionBuilder()
    r1 = _one(b, None, 1, 2)
    x = _one(b, r1, 3)
    r2 = _one(b, None, 1, 2, output=9)  # the same first request again: a sibling of r1
    y = _one(b, r2, 3)
    summary = _one(b, None, 5, 6)  # another first prompt (a summary): a conversation of its own
    z = _one(b, summary, 7)
    labels = _labels(b)
    assert (labels[r1.id], labels[x.id]) == ("abandoned", "abandoned")
    assert [labels[c.id] for c in (r2, y, summary, z)] == ["final"] * 4


def test_aborted_calls_are_not_branches() -> None:
    b = SessionBuilder()
    t1 = _one(b, None, 1)
    b.turn(t1, [2], [_out(8)], status="aborted")
    t2 = _one(b, t1, 2, output=9)
    assert _labels(b) == {t1.id: "final", t2.id: "final"}


@settings(max_examples=100, deadline=None)
@given(call_trees())
def test_labels_are_consistent_on_any_tree(builder: SessionBuilder) -> None:
    calls = builder.calls
    labels = branch_labels(calls)
    done = [c for c in calls if c.status == "ok"]
    assert set(labels) == {c.id for c in done}
    severity = {"final": 0, "sample": 1, "abandoned": 2}
    for call in done:
        if call.parent_id is not None:
            # Once off the kept line, a branch never comes back to it.
            assert severity[labels[call.id]] >= severity[labels[call.parent_id]]
    parents = {c.parent_id for c in done}
    final_leaves = [c for c in done if c.id not in parents and labels[c.id] == "final"]
    final_roots = {c.id for c in done if c.parent_id is None and labels[c.id] == "final"}
    # One kept line per conversation: each final root leads to exactly one final leaf.
    assert len(final_leaves) == len(final_roots)
    every = merged_rows(builder.session, calls, None, "disable", branches="all")
    assert len(every) == len(done) - len(parents - {None})
    kept = merged_rows(builder.session, calls, None, "disable")
    assert [r for r in every if r["branch"] != "abandoned"] == kept
    # Step-wise keeps exactly the calls of the rows merged mode keeps.
    steps = stepwise_rows(builder.session, calls)
    assert {s["call_id"] for s in steps} == {i for r in kept for i in r["call_ids"]}
    assert {s["call_id"] for s in stepwise_rows(builder.session, calls, branches="all")} == set(labels)
