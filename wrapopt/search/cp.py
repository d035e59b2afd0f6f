"""Context-parallel degrees: which a request allows on a model (its degree loop is search/axes.py's).

[Note: context parallel search] ``--cp N`` or ``--cp auto`` adds a degree loop to the flat shapes
(See [Note: shapes tried] in search/shapes.py). ``auto`` tries 1 and every power of two that splits
the sequence into ``2 x cp`` chunks (the head-tail load balancer's) and divides the data-parallel
ranks; a degree given that the sequence or the model cannot take is refused, naming the degrees
that would or the module whose attention is not SDPA (``cost/cp.py``'s ``cp_refusal``). Each degree
is the flat search (FSDP alone, or ``--tp``'s degrees: See [Note: 2-D search]) on its cost view
(``Simulator.for_cp``, See [Note: context parallel costs] in cost/cp.py), its shard groups the
multiples of the degree (FSDP shards over ``dp_shard x cp``), its plans lifted onto the mesh with
``cp_size``: the loop ``search/axes.py`` runs for every such axis (See [Note: the degree loop of an
axis]). A degree's step runs ``1/cp`` of the tokens per GPU (the local batch is per data-parallel
rank, as TorchTitan's ``local_batch_size``: the cp ranks split its sequences), so the degrees are
compared by tokens per second per GPU, ``step x cp`` lower is faster.

[Note: context parallel at a global batch] With ``--global-batch N`` the sequences per step are
fixed, and a cp degree c leaves ``world / (t x c)`` ranks that read different sequences, so each
degree has its own splits ``N = micro_batch x accumulation x world / (t x c)`` (``batch_splits``
with ``cp``). Each degree's splits are the global-batch search (See [Note: global batch search] in
search/batch.py), each split priced on the cp view of its own simulator and searched with shard
groups that hold whole cp groups; the answer is lifted onto the cp mesh. Every degree's step then
covers the same N sequences, so the degrees are compared by the step itself (not per token, as
above); a degree with no split of N (the ranks left do not divide it) is named in the notes.
"""

from __future__ import annotations

from wrapopt.errors import OptionError, PlanError
from wrapopt.spec import AUTO, ModelGraph, ParallelRequest
from wrapopt.spec.cp import cp_degrees, cp_refusal

__all__ = ["resolve_cp"]


def resolve_cp(graph: ModelGraph, request: ParallelRequest) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The context-parallel degrees above 1 to try, and notes on what ``auto`` left out. A degree
    given that the model or the sequence cannot take raises ``PlanError`` / ``OptionError``. See
    [Note: context parallel search]."""
    if request.cp == 1:
        return (), ()
    why = cp_refusal(graph)
    fixed = [d for d in (request.tp, request.pp) if isinstance(d, int)]
    ranks = request.mesh.world_size  # the data-parallel ranks cp splits (under auto: the most any degree leaves)
    for d in fixed:
        ranks //= d
    seq = graph.seq_len
    if request.cp != AUTO:
        if why:
            raise PlanError(f"--cp {request.cp}: {why}")
        cp = int(request.cp)
        if seq % (2 * cp):
            works = [c for c in range(2, seq + 1) if seq % (2 * c) == 0 and ranks % c == 0][:8]
            raise OptionError(f"--cp {cp} does not split the sequence of {seq} tokens into 2 x {cp} chunks (the "
                              f"causal load balancer's); degrees that do: {', '.join(map(str, works)) or 'none'}")
        return (cp,), ()
    if why:
        return (), (f"--cp auto: context parallelism not tried: {why}",)
    degrees = cp_degrees(seq, ranks)
    return degrees, () if degrees else (
        f"--cp auto: no degree splits the sequence of {seq} tokens into 2 x cp chunks and divides the {ranks} "
        "data-parallel ranks",)
