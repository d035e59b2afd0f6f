"""Tracer accuracy and cost: writes results/trace.md.

For each zoo model and a few Hugging Face models built from tiny configs:

- parameters: ``ModelGraph.num_params`` against the model's deduplicated
  ``named_parameters()`` (must match exactly);
- forward FLOPs: the sum of the per-module forward FLOPs against
  ``FlopCounterMode`` over the whole model's forward on meta tensors (target:
  within 2%);
- saved activations (models small enough to run): the sum of the per-module
  saved bytes against one real CPU forward (+ loss) under a
  ``saved_tensors_hooks`` pack hook, deduplicated by storage, parameters
  excluded (target: within 10%);
- wall time of ``trace_model`` (median of 3) and, for the planning-only
  shapes, in a fresh subprocess so that import time is separate, with the
  peak resident memory of that process (targets: llama-7b <= 5 s, llama-70b
  <= 20 s and <= 3 GB).

Usage: ``python -m benchmarks.trace_bench [--out results/trace.md]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

_T0 = time.perf_counter()  # before torch and wrapopt are imported: a child reports its import time
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from wrapopt.fileio import atomic_write_text  # noqa: E402
from wrapopt.models import zoo  # noqa: E402
from wrapopt.trace.meta import trace_model  # noqa: E402

BIG = ("llama-7b", "llama-70b")
TARGET_S = {"llama-7b": 5.0, "llama-70b": 20.0}
TARGET_RSS_BYTES = 3 * 10**9


# --- models -------------------------------------------------------------------------------


def _hf_models() -> dict[str, tuple[Callable[[], nn.Module], tuple[Any, ...], dict[str, Any]]]:
    """Tiny Hugging Face models (random weights from a config): name -> (factory, args, kwargs)."""
    import transformers as tf

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (2, 32), generator=g)
    images = torch.randn(2, 3, 32, 32, generator=g)
    return {
        "hf:gpt2": (lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)), (ids,), {}),
        "hf:llama": (lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128)), (ids,), {}),
        "hf:bert": (lambda: tf.BertForMaskedLM(tf.BertConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            vocab_size=1000, max_position_embeddings=128)), (ids,), {}),
        "hf:t5": (lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=1000)), (ids,),
            {"decoder_input_ids": ids}),
        "hf:vit": (lambda: tf.ViTForImageClassification(tf.ViTConfig(
            image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, num_labels=10)), (images,), {}),
    }


def _build(factory: Callable[[], nn.Module], device: str) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return factory()


# --- reference measurements ------------------------------------------------------------------


def _to(obj: Any, device: str) -> Any:
    return torch.utils._pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, obj)


def reference_flops(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """FlopCounterMode over the whole model's forward, on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(*_to(args, "meta"), **_to(kwargs, "meta"))
    return float(counter.get_total_flops())


def measured_saved_bytes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                         loss_fn: Callable[..., torch.Tensor]) -> int:
    """Bytes autograd saves in one real forward + loss: distinct storages, parameters excluded."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs and ptr not in saved:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args, **kwargs)
        loss_fn(out, args)
    return sum(saved.values())


def peak_rss_bytes() -> int:
    """Peak resident memory of this process.

    ``VmHWM`` where Linux has it: ``ru_maxrss`` survives ``exec`` and so reports the
    parent's peak in a freshly spawned child whenever the parent was bigger.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _median_time(fn: Callable[[], Any], repeats: int = 3) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


# --- one model ------------------------------------------------------------------------------


def bench_small(name: str, factory: Callable[[], nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any],
                loss_fn: Callable[..., torch.Tensor] | None) -> dict[str, Any]:
    from wrapopt.losses import default_loss

    meta_model = _build(factory, "meta")
    graph = trace_model(meta_model, args, loss_fn=loss_fn, example_kwargs=kwargs)
    row: dict[str, Any] = {"model": name, "modules": len(graph.modules)}
    row["params"] = graph.num_params
    row["params_ref"] = sum(p.numel() for p in meta_model.parameters())  # deduplicated
    row["flops"] = sum(m.fwd_flops for m in graph.modules)
    row["flops_ref"] = reference_flops(meta_model, args, kwargs)
    row["saved"] = sum(m.saved_bytes for m in graph.modules) + graph.loss_saved_bytes
    real_model = _build(factory, "cpu")
    row["saved_ref"] = measured_saved_bytes(real_model, args, kwargs, loss_fn or default_loss)
    # Again with dropout off (eval mode) on both sides: see _EXPLANATION on attention dropout.
    eval_graph = trace_model(_build(factory, "meta").eval(), args, loss_fn=loss_fn, example_kwargs=kwargs, fx=False)
    row["saved_eval"] = sum(m.saved_bytes for m in eval_graph.modules) + eval_graph.loss_saved_bytes
    row["saved_ref_eval"] = measured_saved_bytes(_build(factory, "cpu").eval(), args, kwargs, loss_fn or default_loss)
    row["fx_kept"] = graph.trace.fx_graph is not None
    row["dataflow_edges"] = graph.trace.dataflow.number_of_edges() if graph.trace.dataflow is not None else 0
    row["notes"] = list(graph.estimates)
    # Real weights: the tracer must leave them alone (same objects, same values).
    before = {n: (id(p), p.detach().clone()) for n, p in real_model.named_parameters()}
    trace_model(real_model, args, loss_fn=loss_fn, example_kwargs=kwargs, fx=True)
    row["real_untouched"] = all(
        id(p) == before[n][0] and p.device.type == "cpu" and torch.equal(p.detach(), before[n][1])
        for n, p in real_model.named_parameters()
    )
    row["time_s"], row["times_s"] = _median_time(
        lambda: trace_model(meta_model, args, loss_fn=loss_fn, example_kwargs=kwargs))
    return row


def child(name: str, fx: str) -> None:
    """Runs in a fresh process: import, build, trace 3 times; prints one JSON line."""
    import_s = time.perf_counter() - _T0  # torch + wrapopt (this script's imports)
    entry = zoo.get_entry(name)
    model = entry.build("meta")
    inputs = entry.inputs()
    fx_arg = {"auto": None, "on": True, "off": False}[fx]
    graphs = []

    def once() -> None:
        graphs.append(trace_model(model, inputs, loss_fn=entry.loss, fx=fx_arg))

    median, times = _median_time(once)
    g = graphs[-1]
    row = {
        "model": name, "fx": fx, "import_s": import_s, "time_s": median, "times_s": times,
        "rss_bytes": peak_rss_bytes(),
        "modules": len(g.modules), "params": g.num_params,
        "params_ref": sum(p.numel() for p in model.parameters()),
        "flops": sum(m.fwd_flops for m in g.modules),
        "saved": sum(m.saved_bytes for m in g.modules) + g.loss_saved_bytes,
        "fx_kept": g.trace.fx_graph is not None,
        "dataflow_edges": g.trace.dataflow.number_of_edges() if g.trace.dataflow is not None else 0,
        "notes": list(g.estimates),
    }
    if fx == "auto":
        row["flops_ref"] = reference_flops(model, inputs, {})
    print("RESULT " + json.dumps(row))


def bench_big(name: str, fx: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_repo(), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.trace_bench", "--child", name, "--fx", fx],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{name} ({fx}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _repo() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- report ------------------------------------------------------------------------------


def _label(row: dict[str, Any]) -> str:
    return row["model"] if ":" in row["model"] else f"zoo:{row['model']}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.4f}" if b else ("1.0000" if not a else "inf")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def render(small: list[dict[str, Any]], big: list[dict[str, Any]], load: tuple[float, float]) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Tracer accuracy and cost",
        "",
        f"Written by `benchmarks/trace_bench.py` on {now}.",
        f"Machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (shared with other work); Python {platform.python_version()}, "
        f"torch {torch.__version__}" + _hf_version() + ". No process group (tracing is single-process). "
        f"Load average (1 min) from other work: {load[0]:.1f} at the start, {load[1]:.1f} at the end.",
        "",
        "Targets: parameter totals exact; forward FLOPs within 2% of `FlopCounterMode` on the whole model "
        "(meta tensors); saved-activation bytes within 10% of a real CPU run (pack hook, distinct storages, "
        "parameters excluded); llama-7b <= 5 s, llama-70b <= 20 s and <= 3 GB peak RSS.",
        "",
        "## Accuracy",
        "",
        "| model | modules | params (traced) | exact | fwd FLOPs (traced) | / FlopCounterMode | saved act. (traced) "
        "| / measured real | same, dropout off | fx graph | dataflow edges | real weights untouched |",
        "|---|---:|---:|:---:|---:|---:|---:|---:|---:|:---:|---:|:---:|",
    ]
    for r in small + [b for b in big if b["fx"] == "auto"]:
        saved_ref = r.get("saved_ref")
        lines.append(
            f"| {_label(r)} | {r['modules']} | {r['params']:,} | {'yes' if r['params'] == r['params_ref'] else 'NO'} "
            f"| {r['flops']:.4g} | {_ratio(r['flops'], r['flops_ref'])} | {r['saved']:,} "
            f"| {_ratio(r['saved'], saved_ref) if saved_ref is not None else 'n/a (too big to run)'} "
            f"| {_ratio(r['saved_eval'], r['saved_ref_eval']) if saved_ref is not None else 'n/a'} "
            f"| {'kept' if r['fx_kept'] else 'skipped'} | {r['dataflow_edges']} "
            f"| {('yes' if r['real_untouched'] else 'NO') if 'real_untouched' in r else 'n/a (meta only)'} |"
        )
    lines += [
        "",
        "## Time and memory",
        "",
        "Small models: median of 3 calls of `trace_model` in this process (after the accuracy runs, so warm). "
        "Planning-only shapes: a fresh process per row imports wrapopt (import time shown apart), builds the "
        "model on meta and calls `trace_model` 3 times; the first call includes one-off warm-up (first export, "
        "first fake-tensor dispatch). Peak RSS is that process's `VmHWM` (torch import included). "
        "The machine's 2 cores are shared with other work: single calls vary by up to ~30%; targets are "
        "checked on the median.",
        "",
        "| model | fx | import (s) | trace, 3 calls (s) | median (s) | target | peak RSS | fx graph |",
        "|---|---|---:|---|---:|---|---:|:---:|",
    ]
    for r in small:
        lines.append(f"| {r['model']} | auto | - | {', '.join(f'{t:.2f}' for t in r['times_s'])} | {r['time_s']:.2f} "
                     f"| - | - | {'kept' if r['fx_kept'] else 'skipped'} |")
    for r in big:
        target = TARGET_S[r["model"]]
        verdict = "met" if r["time_s"] <= target else "MISSED"
        rss_ok = r["rss_bytes"] <= TARGET_RSS_BYTES
        rss = _gb(r["rss_bytes"]) + ("" if r["model"] != "llama-70b" else (" (met)" if rss_ok else " (MISSED)"))
        lines.append(f"| {_label(r)} | {r['fx']} | {r['import_s']:.2f} | {', '.join(f'{t:.2f}' for t in r['times_s'])} "
                     f"| {r['time_s']:.2f} | <= {target:.0f} s: {verdict} | {rss} "
                     f"| {'kept' if r['fx_kept'] else 'skipped'} |")
    notes = sorted({n for r in small + big for n in r["notes"]})
    if notes:
        lines += ["", "Tracer notes (`ModelGraph.estimates`) seen above:", ""]
        lines += [f"- {n}" for n in notes]
    lines += ["", "## Reading the numbers", "", *_EXPLANATION, ""]
    return "\n".join(lines)


_EXPLANATION = [
    "- `fx=auto` (the default, `fx=None`) exports the fx graph only for models of at most 200 modules; "
    "llama-7b (389) and llama-70b (965) skip it and take the module dataflow from the ops of the traced "
    "forward instead (same definition, see `[Note: dataflow]` in `wrapopt/trace/fx.py`). `fx=on` forces "
    "the export; it costs 1-2 ms per exported op on this machine, depending on load "
    "(llama-70b exports about 7,100 ops).",
    "- Forward FLOPs count matmuls, convolutions and attention (PyTorch's FLOP formulas), causal "
    "attention at full cost, as `FlopCounterMode` does. `FlopCounterMode` on meta runs the math "
    "attention path (two matmuls), the tracer the fused kernel (`sdpa_flop_count`): the same count.",
    "- Saved activations are compared with the loss included on both sides (the tracer's step is "
    "forward + loss + backward).",
    "- Attention dropout explains every saved-activation gap above 1%: Hugging Face GPT-2, BERT and T5 "
    "train with attention dropout 0.1, and on CPU `scaled_dot_product_attention` with `dropout_p > 0` "
    "takes the math path, which saves the seq x seq attention probabilities and the dropout mask. The "
    "tracer models the fused kernels (`[Note: attention on meta]` in `wrapopt/trace/ops.py`), which GPUs run "
    "with dropout too (flash / memory-efficient attention save the output, the log-sum-exp and the RNG "
    "state), so it plans for what a GPU keeps. With dropout off on both sides (`.eval()`, the \"dropout "
    "off\" column) the CPU also runs the fused kernel and the figures agree. The zoo models have no "
    "dropout. Llama's grouped-query attention was overstated by the head ratio until the tracer stopped "
    "repeating K/V heads before the fused kernel (the kernel reads them grouped, as the dispatcher passes "
    "them); it now matches exactly.",
]


def _hf_version() -> str:
    try:
        import transformers

        return f", transformers {transformers.__version__}"
    except ImportError:
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(_repo(), "results", "trace.md"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--fx", default="auto", choices=("auto", "on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--skip-big", action="store_true", help="only the small models (quick check)")
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.fx)
        return 0
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    load_start = os.getloadavg()[0]
    small = []
    for name in ("gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny"):
        e = zoo.get_entry(name)
        small.append(bench_small(f"zoo:{name}", e.factory, e.inputs(), {}, e.loss))
        print(json.dumps({k: v for k, v in small[-1].items() if k != "notes"}), flush=True)
    try:
        hf = _hf_models()
    except ImportError:
        hf = {}
    for name, (factory, hf_args, hf_kwargs) in hf.items():
        small.append(bench_small(name, factory, hf_args, hf_kwargs, None))
        print(json.dumps({k: v for k, v in small[-1].items() if k != "notes"}), flush=True)
    big = []
    if not args.skip_big:
        for name in BIG:
            for fx in ("auto", "on"):
                big.append(bench_big(name, fx))
                print(json.dumps(big[-1]), flush=True)
    atomic_write_text(args.out, render(small, big, (load_start, os.getloadavg()[0])))
    os.chmod(args.out, 0o644)  # atomic_write_text's temporary file is created 0600
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
