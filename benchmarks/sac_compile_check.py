"""What torch.compile's partitioner saves of a selective-op block, against the model: ``python -m
benchmarks.sac_compile_check`` (CPU, about 10 s a model).

Checks [Note: compile keeps what backward reads] in wrapopt/selective.py: the first block of each zoo
model is checkpointed with selective-op's policy (``selective_context_fn``) and compiled whole
(``fullgraph=True``) with the ``aot_eager_decomp_partition`` backend, whose partitioner is inductor's
(``min_cut_rematerialization_partition``) without its C++ code generation. The activations its forward
saves for backward (each storage once; the block's parameters and inputs left out, as the model counts
the input apart) are set beside the tracer's kept bytes of the block's modules with the unread share
dropped (what the simulator keeps under compile), and beside the eager kept bytes.
"""

from __future__ import annotations

import sys

import torch


def check(name: str) -> tuple[int, int, int]:
    """(bytes the compiled block saves, the model's compiled kept bytes, the model's eager kept bytes)."""
    from torch.utils.checkpoint import checkpoint

    from wrapopt.models import zoo
    from wrapopt.selective import selective_context_fn
    from wrapopt.trace.meta import trace_model

    torch.manual_seed(0)
    entry = zoo.get_entry(name)
    model, inputs = entry.build("cpu"), entry.inputs()
    graph = trace_model(entry.build("meta"), entry.inputs(), loss_fn=entry.loss)
    first = graph.blocks[0]
    block = model.get_submodule(first)
    cap: dict = {}
    hook = block.register_forward_pre_hook(lambda m, a, kw: cap.setdefault("c", (a, kw)), with_kwargs=True)
    with torch.no_grad():
        model(*inputs)
    hook.remove()
    args, kwargs = cap["c"]
    outside = {p.untyped_storage().data_ptr() for p in block.parameters()}
    outside |= {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}

    def sac(x, *a, **k):  # noqa: ANN001, ANN202
        return checkpoint(block, x, *a, use_reentrant=False, context_fn=selective_context_fn, **k)

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in outside:
            saved.setdefault(key, t.untyped_storage().nbytes())
        return t

    x = args[0].detach().requires_grad_()
    outside.add(x.untyped_storage().data_ptr())
    compiled = torch.compile(sac, backend="aot_eager_decomp_partition", fullgraph=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(x, *args[1:], **kwargs)
    mods = [m for m in graph.modules if m.fqn == first or m.fqn.startswith(first + ".")]
    return (sum(saved.values()), sum(int(m.selective_kept_bytes * (1 - m.selective_unread)) for m in mods),
            sum(m.selective_kept_bytes for m in mods))


def main() -> int:
    for name in ("llama-tiny", "gpt-tiny"):
        got, model, eager = check(name)
        print(f"{name}: compiled block saves {got:,} B; the model keeps {model:,} B compiled ({model / got:.3f}), "
              f"{eager:,} B eagerly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
