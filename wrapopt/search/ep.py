"""Expert-parallel degrees: which a request allows on a model (its degree loop is search/axes.py's).

[Note: expert parallel search] ``--ep N`` or ``--ep auto`` adds a degree loop to the flat shapes
(See [Note: shapes tried] in search/shapes.py): ``auto`` tries 1 (FSDP alone) and every degree above
1 that divides the experts of every mixture of the model and the data-parallel ranks it splits them
over (TorchTitan's rule); a degree given that the model cannot take is refused naming the module and
the degrees that would. Each degree is the 1-D search on its cost view (``Simulator.for_ep``, See
[Note: expert parallel costs] in cost/ep.py), its shard groups whole ep groups (FSDP over every
rank, or HSDP with ep inside each shard group, as ``plan/ep.py`` applies it), its plans lifted onto
the mesh with ``ep_size``: the loop search/axes.py runs for every such axis (See [Note: the degree
loop of an axis]), at a fixed global batch too (ep borrows data-parallel ranks: every degree has the
splits FSDP alone has). Degrees are compared by the step (a degree changes no rank's tokens). Not
searched: ep beside tensor parallelism (no cost view of experts under it: ``--ep`` with ``--tp`` is
refused, ``--tp auto`` tries ep at tp 1 only) or context parallelism. Under a pipeline each
pipeline shape takes the degrees too, where they divide its stage's data-parallel ranks (See [Note:
ep in a pipeline] in search/shapes.py).
"""

from __future__ import annotations

from wrapopt.cost.simulate import ep_problem, expert_counts
from wrapopt.errors import OptionError, PlanError
from wrapopt.spec import AUTO, ModelGraph, ParallelRequest

__all__ = ["resolve_ep"]


def resolve_ep(graph: ModelGraph, request: ParallelRequest) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The expert-parallel degrees above 1 to try, and notes on the ones ``auto`` left out. A
    degree given that the model cannot take raises ``PlanError``. See [Note: expert parallel search]."""
    if request.ep == 1:
        return (), ()
    if isinstance(request.tp, int) and request.tp > 1:
        raise OptionError(f"--ep {request.ep} with --tp {request.tp}: wrapopt has no cost model of experts under "
                          "tensor parallelism; pass --tp 1 (or --tp auto: expert parallelism is then tried at tp 1)")
    ranks = request.mesh.world_size  # the data-parallel ranks of a flat shape without tensor parallelism
    if request.ep != AUTO:
        problem = ep_problem(graph, request.ep)
        if problem:
            raise PlanError(problem)
        return (request.ep,), ()
    counts = expert_counts(graph)
    if not counts:
        return (), ("--ep auto: the model holds no stacked experts: expert parallelism not tried",)
    top = min(counts)
    degrees = tuple(d for d in range(2, top + 1) if all(n % d == 0 for n in counts) and ranks % d == 0)
    left = [d for d in range(2, top + 1) if all(n % d == 0 for n in counts) and ranks % d]
    notes = (f"--ep auto: ep {', '.join(map(str, left))} not tried: they do not divide the {ranks} ranks",) if left \
        else ()
    return degrees, notes
