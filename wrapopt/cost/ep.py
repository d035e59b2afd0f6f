"""The expert-parallel view of a model: what one rank of an expert-parallel group holds, moves
and computes, as a ``ModelGraph`` and a ``ComputeProfile`` the FSDP simulator scores on the
data-parallel mesh (as the tensor-parallel view does: [Note: tensor parallel costs] in tp.py).

[Note: expert parallel costs] Under expert parallelism of degree ``ep`` (TorchTitan's
``ExpertParallel`` on its sparse mesh ``efsdp x ep``) each rank of an ep group holds ``n / ep``
of a mixture's ``n`` experts, and FSDP shards each expert over the other ``efsdp = dp_shard x cp
/ ep`` ranks; the dense part (attention, norms, router, embeddings) stays sharded over every
data-parallel rank. ``ep_view`` prices one rank's share:

- Parameters: a module holding stacked experts (``ModuleInfo.experts``, See [Note: experts on
  meta] in trace/ops.py) keeps its whole bytes in ``own_bytes`` (what a rank stores sharded is
  ``n/ep / efsdp = n / (dp_shard x cp)`` experts' worth, the same as FSDP alone over the shard
  group), while its element count, which sizes what FSDP all-gathers and reduce-scatters and the
  unsharded gradients, is ``1/ep`` of them: a rank gathers its ``n/ep`` experts, not all ``n``.
  The gathers are priced over the plan's shard group, not over ``efsdp``: at a large ``efsdp``
  that is the same ring share ((g-1)/g), at a small one it over-prices the experts' gathers (at
  ``efsdp = 1`` nothing is gathered in the real step, and the estimate says so in a note).
- Compute: a rank runs the (token, expert) pairs routed to its experts from every rank of its
  group; with routing balanced that is as many pairs as its own tokens made, so the experts'
  FLOPs per rank are those of the trace. The busiest rank sets the pace: the experts' time is
  multiplied by the load imbalance (``EP_IMBALANCE``, the busiest rank's pairs over the mean),
  an assumption the estimate states in its notes (1.0: balanced, as capacity buffers or a
  load-balancing loss keep it). A measured experts module's time beyond its matmuls' FLOPs at
  the profile's rate is taken as per-expert work and is 1/ep of it: Hugging Face's eager experts
  run a set of ops per expert the routing hit, and a rank loops over its n/ep (on the fidelity
  bench's CPU ranks that loop is most of the module: its ep2 plans measured 17-39% faster than the
  same plans without, results/fidelity_moe.md). A stated GPU's module times are its kernels'
  (FLOPs and bytes): left whole.
- All-to-all: per call of an experts module, forward, one dispatch (the routed tokens to the
  ranks holding their experts) and one combine (the outputs back); backward, one of each for the
  gradients. Each moves ``pairs x hidden x dtype`` bytes per rank, of which ``(ep-1)/ep`` leave
  it: priced as the ring all-gather of that buffer on the ep group (the same bytes through each
  rank's link), on the links it crosses: inside a node when ``ep <= ranks per node``
  (``FabricProfile.collective_s``). ``pairs`` is the experts module's forward FLOPs over 2 x
  one expert's parameters (capacity factor 1: the routed pairs, ``top-k x tokens``, for Hugging
  Face's experts modules; a module that also counts its one-hot dispatch as matmuls, the zoo's
  ``moe-tiny``, is over-stated by that share). The all-to-alls block the experts' matmuls (the
  next op needs their result) and TorchTitan runs them unoverlapped: time of the experts module
  on the compute lane, as the tensor-parallel collectives are.
- Permutation: the tokens are sorted into the order of the ranks they go to before the dispatch
  and back after the combine (a read and a write of the buffer each, forward and backward):
  memory-bound ops at the profile's op bandwidth (``op_bandwidth_bytes_per_s``, else its memory
  bandwidth). The router (a linear, a softmax and a top-k) is in the trace already, priced as
  every module is (its matmul, its memory-bound ops).
- Units: each experts module is an FSDP unit of its own, on the efsdp mesh, as TorchTitan shards
  ``moe.experts`` and as ``plan/ep.py`` applies it: the view scores a plan with those units split
  out of the units that held them (``expert_units``; resharding after forward unless the plan
  made the module a unit of its own, checkpointed as the unit around it: apply checkpoints the
  plan's units as they were, the experts inside them). With ``efsdp = 1`` (ep the whole shard
  group) FSDP2 runs no collective for them but still copies them into unsharded parameters and
  gradients (its world-size-1 path): their memory is priced as gathered, their units' all-gathers
  and reduce-scatters take no time (``Simulator._mesh_costs``). Under HSDP (shard groups of ``s``
  ranks, ep inside each: ``plan/ep.py``'s ``replicate x efsdp x ep``) a rank's shard of its
  experts is ``1/efsdp = ep/s`` of their ``n/ep``, and that is what is all-reduced over the
  replicas (the dense units' ``1/s``, as without ep).
- Memory: the combine weights the tokens that come back by their routing weights, which saves
  them for backward: one buffer of the routed tokens per call more than the experts module saved
  (``saved_bytes``). Left out: the all-to-all's transient send and receive buffers, and contention
  of the all-to-all with FSDP's collectives.
"""

from __future__ import annotations

import math
from dataclasses import replace

from wrapopt.cost.calls import module_time
from wrapopt.cost.dtypes import traced_dtype_bytes
from wrapopt.errors import PlanError
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.spec import ModelGraph, PlanSpec, UnitSpec
from wrapopt.units import ancestors

__all__ = ["EP_IMBALANCE", "ep_caveats", "ep_problem", "ep_view", "expert_counts", "expert_units", "stacked_experts"]

EP_IMBALANCE = 1.0  # the busiest expert-parallel rank's routed pairs over the mean: See [Note: expert parallel costs]


def stacked_experts(graph: ModelGraph) -> dict[str, tuple[int, int]]:
    """Module -> (experts, elements of its stacked expert weights): the 3-D parameters registered on
    a module the trace marked as holding experts (``ModuleInfo.experts``), leading dimension one per
    expert. See [Note: experts on meta] in trace/ops.py."""
    out: dict[str, tuple[int, int]] = {}
    holders = {m.fqn: m.experts for m in graph.modules if m.experts}
    for fqn, shape, _dtype in graph.param_shapes:
        owner = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        n = holders.get(owner)
        if n and len(shape) == 3 and shape[0] == n:
            prev = out.get(owner, (n, 0))
            out[owner] = (n, prev[1] + math.prod(shape))
    return out


def expert_counts(graph: ModelGraph) -> tuple[int, ...]:
    """The distinct numbers of experts of the model's mixtures (empty: no stacked experts)."""
    return tuple(sorted({n for n, _numel in stacked_experts(graph).values()}))


def ep_problem(graph: ModelGraph, ep: int) -> str | None:
    """Why ``ep`` cannot split this model's experts (None: it can): no stacked experts, or a
    degree that does not divide every mixture's experts, naming the module and the degrees that
    would."""
    experts = stacked_experts(graph)
    if not experts:
        return (f"--ep {ep}: the model holds no stacked experts (a module with a 3-D expert weight, "
                "as Hugging Face's and TorchTitan's MoE layers): pass --ep 1")
    for fqn, (n, _numel) in experts.items():
        if n % ep:
            works = [d for d in range(2, n + 1) if n % d == 0]
            return (f"--ep {ep} does not divide the {n} experts of {fqn}; degrees that do: "
                    f"{', '.join(map(str, works)) or 'none above 1'} (or --ep 1)")
    return None


def ep_caveats(mesh) -> frozenset[str]:
    """What the view over-prices on ``mesh`` (a ``MeshSpec`` with ``ep_size``): the experts'
    gathers priced over the shard group where they run over ``efsdp``. See [Note: expert parallel
    costs]."""
    efsdp, shard = max(1, mesh.efsdp_size), mesh.shard_size
    if efsdp == 1 or efsdp >= shard or (efsdp - 1) / efsdp >= 0.9 * (shard - 1) / shard:
        return frozenset()
    return frozenset({f"expert parallel {mesh.ep_size}: the experts' all-gathers and reduce-scatters are priced over "
                      f"the shard group of {shard} ranks; they run over efsdp = {efsdp} (a smaller ring share), so "
                      "the step is over-stated"})


def expert_units(plan: PlanSpec, experts: tuple[str, ...]) -> PlanSpec:
    """``plan`` as expert parallelism applies it: each experts module a unit of its own (over
    efsdp), out of the unit that held it, resharding as that unit did when it was the module's
    alone (else after forward). See [Note: applying expert parallelism] in plan/ep.py."""
    if not experts:
        return plan
    own = {u.modules[0]: u for u in plan.units if len(u.modules) == 1 and u.modules[0] in experts}
    if len(own) == len(experts):
        return plan
    named = set(experts)
    by_module = {m: u for u in plan.units for m in u.modules if m not in named}
    units = [own.get(e) or UnitSpec((e,), checkpoint=_enclosing_checkpoint(e, by_module)) for e in experts]
    for u in plan.units:
        if u.modules[0] in own and len(u.modules) == 1:
            continue
        rest = tuple(m for m in u.modules if m not in named)
        if rest:
            units.append(u if len(rest) == len(u.modules) else replace(u, modules=rest))
    return replace(plan, units=tuple(units))


def _enclosing_checkpoint(fqn: str, by_module: dict[str, UnitSpec]) -> bool | str:
    """The checkpointing of the innermost unit around ``fqn``: apply checkpoints the plan's units as
    they were, so an experts module inside a checkpointed block is recomputed with it."""
    for anc in ancestors(fqn)[1:]:
        if anc in by_module:
            return by_module[anc].checkpoint
    return False


def _per_expert(t: float, matmul_s: float, ep: int) -> float:
    """A measured experts module's time ``t`` under ep: its matmuls' FLOPs at the profile's rate
    whole, the rest (per-expert work) 1/ep. See [Note: expert parallel costs]."""
    return min(t, matmul_s) + max(0.0, t - matmul_s) / ep


def ep_view(graph: ModelGraph, compute: ComputeProfile, fabric: FabricProfile, ep: int, *,
            batch_scale: float = 1.0, activation_dtype_bytes: int | None = None,
            imbalance: float = EP_IMBALANCE, timed: ModelGraph | None = None,
            ) -> tuple[ModelGraph, ComputeProfile, frozenset[str]]:
    """One expert-parallel rank's graph and compute profile, and the notes of the view (``graph``:
    the traced one; ``timed``: the graph the simulator times, after the compute dtype and the
    throughput knobs, default ``graph``). See [Note: expert parallel costs]."""
    problem = ep_problem(graph, ep)
    if problem:
        raise PlanError(problem)
    experts = stacked_experts(graph)
    rpn = min(ep, fabric.ranks_per_node)
    notes: set[str] = {f"expert parallel {ep}: expert load taken as {imbalance:g}x the mean on the busiest rank "
                       "(an assumption: routing skew slows the experts by as much)"}
    act = (activation_dtype_bytes or traced_dtype_bytes(graph)) / traced_dtype_bytes(graph)
    tokens = max(1, graph.batch_size) * max(1, graph.seq_len)
    op_bw = compute.op_bandwidth_bytes_per_s or compute.memory_bandwidth_bytes_per_s
    measured = {fqn: (f, b) for fqn, f, b in compute.module_times}
    times, routed = [], {}
    for m in (timed or graph).call_order():
        f, b = module_time(m, compute, batch_scale, measured)
        if m.fqn in experts:
            n, numel = experts[m.fqn]
            m = graph.info(m.fqn)  # its sizes as traced, scaled by ``act``
            pairs = min(m.fwd_flops / (2 * numel / n), tokens * n)  # routed (token, expert) pairs, all calls
            routed[m.fqn] = round(pairs / tokens * m.output_bytes)  # bytes of the routed tokens as traced
            buffer = routed[m.fqn] * act * batch_scale  # and as the step runs them
            a2a, caveat = fabric.collective_s("all_gather", ep, rpn, buffer / max(1, m.num_calls))
            if caveat:
                notes.add(caveat)
            move = 2 * m.num_calls * a2a + (4 * buffer / op_bw if op_bw else 0.0)  # dispatch + combine, permutes
            if measured and compute.flops_per_s:  # the per-expert share: a rank loops over n/ep experts
                f, b = (_per_expert(t, fl * batch_scale / compute.flops_per_s, ep)
                        for t, fl in ((f, m.fwd_flops), (b, m.bwd_flops)))
            f, b = f * imbalance + move, b * imbalance + move
        times.append((m.fqn, f / batch_scale, b / batch_scale))
    infos = {}
    for fqn, (n, numel) in experts.items():
        m = graph.info(fqn)
        keep = numel - numel // ep  # the elements of the experts on other ranks: not gathered here
        trainable = keep if m.own_trainable_numel >= numel else 0
        infos[fqn] = replace(m, own_numel=m.own_numel - keep, own_trainable_numel=m.own_trainable_numel - trainable,
                             saved_bytes=m.saved_bytes + routed.get(fqn, 0))  # the combined tokens, weighted
    tree = graph.tree.copy()
    for fqn, m in infos.items():
        tree.nodes[fqn]["info"] = m
    view = replace(graph, modules=tuple(infos.get(m.fqn, m) for m in graph.modules), tree=tree)
    # the times are at batch_scale already (module_time): See [Note: batch scaling] in calls.py
    return view, replace(compute, module_times=tuple(times), batch_fixed_share=0.0), frozenset(notes)
