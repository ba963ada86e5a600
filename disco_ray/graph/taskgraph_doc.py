"""Reading a TaskGraph document's vertex records (`TaskGraph.from_dict`): each record checked
for its fields' types, and the vertex ids in a topological order, naming unknown inputs and cycles."""

from __future__ import annotations

import heapq

from .errors import FormatError, GraphError


def records(raw: list, kinds: set[str]) -> dict[str, dict]:
    """The vertex records of a document's "vertices" list by id, each checked (FormatError or
    GraphError naming the vertex); `kinds`: the vertex kinds there are."""
    by_id: dict[str, dict] = {}
    for n, r in enumerate(raw):
        if not isinstance(r, dict):
            raise FormatError(f"taskgraph: vertices[{n}] is not an object")
        vid = r.get("id")
        if not isinstance(vid, str) or not vid:
            raise FormatError(f'taskgraph: vertices[{n}] has no string "id"')
        if vid in by_id:
            raise GraphError(f"vertex {vid!r}: duplicate id")
        kind = r.get("kind")
        if not isinstance(kind, str) or kind not in kinds:
            raise FormatError(f"vertex {vid!r}: unknown kind {kind!r} (input, kernel or transfer)")
        ins = r.get("inputs", [])
        if not isinstance(ins, list) or not all(isinstance(i, str) for i in ins):
            raise FormatError(f'vertex {vid!r}: "inputs" must be a list of ids')
        if r.get("attrs") is not None and not isinstance(r.get("attrs"), dict):
            raise FormatError(f'vertex {vid!r}: "attrs" must be an object')
        when = r.get("when", [])
        if not isinstance(when, list) or not all(
            isinstance(c, dict) and isinstance(c.get("value"), str) for c in when
        ):
            raise FormatError(f'vertex {vid!r}: "when" must be a list of {{"value": id, "index": n}}')
        if r.get("state", False) not in (True, False):
            raise FormatError(f'vertex {vid!r}: "state" must be true or false, got {r.get("state")!r}')
        by_id[vid] = r
    return by_id


def topo_ids(by_id: dict[str, dict]) -> list[str]:
    """Vertex ids in a topological order (keeping file order where free); names unknown inputs and cycles."""
    indeg = {}
    succ: dict[str, list[str]] = {i: [] for i in by_id}
    for vid, r in by_id.items():
        deps = list(dict.fromkeys(r.get("inputs", [])))
        for d in deps:
            if d not in by_id:
                raise GraphError(f"vertex {vid!r}: unknown input {d!r}")
            succ[d].append(vid)
        indeg[vid] = len(deps)
    pos = {vid: n for n, vid in enumerate(by_id)}
    heap = [pos[v] for v, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    ids = list(by_id)
    order = []
    while heap:
        v = ids[heapq.heappop(heap)]
        order.append(v)
        for w in succ[v]:
            indeg[w] -= 1
            if indeg[w] == 0:
                heapq.heappush(heap, pos[w])
    if len(order) != len(by_id):
        # every unplaced vertex has an unplaced input: walk those back until one repeats
        path: list[str] = []
        seen: dict[str, int] = {}
        v = next(v for v in ids if indeg[v] > 0)
        while v not in seen:
            seen[v] = len(path)
            path.append(v)
            v = next(d for d in by_id[v].get("inputs", []) if indeg[d] > 0)
        cycle = [*path[seen[v] :], v][::-1]
        raise GraphError(f"vertex {v!r}: cycle {' -> '.join(cycle)}")
    return order
