"""Which branches of a session's call tree a trainer gets: the kept line, samples, abandoned retries.

The tree: each completed call hangs under the call whose prompt + output its prompt extends; first
calls of conversations that sent the very same prompt ids hang under one virtual root (a resent
first request). Where a call has several children, they are grouped by request: the choices of one
request (n > 1) share its `request_id`; a later request with the same parent is a resend.

At such a fork, the kept request is the continued one (a child has children) whose subtree holds the
most recent call; if none was continued, the most recent request. Every other request is:
- abandoned when the kept request was continued after its last call (a retry the harness went on
  with superseded it), with everything under it;
- a sample otherwise (a parallel request nobody continued past).
Within the kept request, the continued choice with the most recent call is kept (if none was
continued, choice 0, the one a client reading `choices[0]` goes on with); the other choices are
samples. A call's label is the worst met on its way from the root: final < sample < abandoned.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Literal

from proxy.store.models import CallRow

Branch = Literal["final", "sample", "abandoned"]
BranchFilter = Literal["final", "all"]
BRANCH_FILTERS: tuple[BranchFilter, ...] = ("final", "all")
_SEVERITY: dict[Branch, int] = {"final": 0, "sample": 1, "abandoned": 2}


def _request(call: CallRow) -> str:
    return str(call.finish_detail.get("request_id") or f"call-{call.id}")


def _choice(call: CallRow) -> int:
    return int(call.finish_detail.get("choice", 0))


def _fork_key(call: CallRow) -> Hashable:
    return call.parent_id if call.parent_id is not None else ("root", call.prompt_added)


def _fork_verdicts(children: list[CallRow], latest: dict[int, int], continued: set[int]) -> dict[int, Branch]:
    """The label of the edge into each child of one fork."""
    requests: dict[str, list[CallRow]] = defaultdict(list)
    for child in children:
        requests[_request(child)].append(child)

    def recency(calls: list[CallRow]) -> int:
        return max(latest[c.id] for c in calls)

    went_on = [calls for calls in requests.values() if any(c.id in continued for c in calls)]
    kept = max(went_on or list(requests.values()), key=recency)
    primary = max(
        kept, key=lambda c: (c.id in continued, latest[c.id] if c.id in continued else 0, -_choice(c))
    )
    verdicts: dict[int, Branch] = {}
    for calls in requests.values():
        for call in calls:
            if calls is kept:
                verdicts[call.id] = "final" if call is primary else "sample"
            elif went_on and recency(calls) < recency(kept):
                verdicts[call.id] = "abandoned"
            else:
                verdicts[call.id] = "sample"
    return verdicts


def branch_labels(calls: Sequence[CallRow]) -> dict[int, Branch]:
    """The label of every completed call (aborted calls are no branch of anything)."""
    done = sorted((c for c in calls if c.status == "ok"), key=lambda c: c.id)
    latest = {c.id: c.id for c in done}  # the most recent call in each call's subtree
    for call in reversed(done):  # children are recorded after their parents
        if call.parent_id is not None and call.parent_id in latest:
            latest[call.parent_id] = max(latest[call.parent_id], latest[call.id])
    continued = {c.parent_id for c in done if c.parent_id is not None}
    forks: dict[Hashable, list[CallRow]] = defaultdict(list)
    for call in done:
        forks[_fork_key(call)].append(call)
    verdicts: dict[int, Branch] = {}
    for children in forks.values():
        verdicts.update(_fork_verdicts(children, latest, continued))
    labels: dict[int, Branch] = {}
    for call in done:
        inherited = labels.get(call.parent_id, "final") if call.parent_id is not None else "final"
        own = verdicts[call.id]
        labels[call.id] = own if _SEVERITY[own] > _SEVERITY[inherited] else inherited
    return labels


def kept(label: Branch, branches: BranchFilter) -> bool:
    """Whether a branch with this label is exported under this filter."""
    return branches == "all" or label != "abandoned"
