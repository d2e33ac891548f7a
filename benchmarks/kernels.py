"""Paged attention: the Pallas kernels against the XLA reference, at real-model shapes.

For each (batch, context length) the script builds a paged KV cache of one layer of a
Qwen2.5-7B-like attention (28 query heads, 4 kv heads, head_dim 128, 16-token pages,
bf16), with every row's pages scattered over the pool, and times:

- decode: one new token per row (`pallas_gpu.paged_decode_attention` vs
  `paged_attention_reference` with a 1-token block);
- verify: a 48-token speculative tree per row (`pallas_gpu.tree_verify_attention` vs
  the reference under the same tree mask).

Each call is jitted, run once to compile, checked against the other implementation,
then timed over ``--iters`` calls (median of ``--repeats`` batches of calls, with
`block_until_ready`). Reported: microseconds per call, the ratio, and the effective
bandwidth of reading the rows' keys and values (bytes of K and V the row lengths
cover / time), the figure that bounds decoding on a GPU.

On a GPU both run compiled. Elsewhere only the reference is timed (the kernels'
interpret mode checks semantics, not speed) unless ``--interpret`` is given.

    python benchmarks/kernels.py                       # on a GPU
    python benchmarks/kernels.py --quick --interpret   # a smoke run on CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import machine, write_json


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768], help="tokens held per row")
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--tree", type=int, default=48, help="tokens in the verify block")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-cache-gib", type=float, default=24.0, help="skip points whose K+V pool exceeds this")
    p.add_argument("--interpret", action="store_true", help="off a GPU, also time the kernels in interpret mode")
    p.add_argument("--quick", action="store_true", help="tiny shapes, for a smoke run")
    p.add_argument("--out", default="benchmarks/results/kernels.json")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.contexts, args.iters, args.repeats = [1, 4], [256], 2, 2
        args.heads, args.kv_heads, args.head_dim, args.tree = 4, 2, 32, 8
    for name in ("iters", "repeats", "head_dim", "page_size", "tree"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def _time(fn, args, iters: int, repeats: int) -> float:
    """Median seconds per call of ``fn(*args)`` (already compiled)."""
    import jax

    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / iters)
    return statistics.median(per_call)


def _tree_mask(t: int):
    """A fixed tree of ``t`` tokens: node i's parent is (i - 1) // 4 (4 children per node), as a mask."""
    import numpy as np

    parent = [-1] + [(i - 1) // 4 for i in range(1, t)]
    mask = np.zeros((t, t), bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


def run_point(args, b: int, ctx: int, kernels_compiled: bool) -> dict | None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tltjax.kernels import pallas_gpu
    from tltjax.kernels.paged import paged_attention_reference

    dtype = jnp.dtype(args.dtype)
    kvh, d, page, t = args.kv_heads, args.head_dim, args.page_size, args.tree
    pages_per_seq = -(-(ctx + t) // page)
    num_pages = b * pages_per_seq + 1
    pool_bytes = 2 * kvh * num_pages * page * d * dtype.itemsize
    if pool_bytes > args.max_cache_gib * 2**30:
        print(f"skip B={b} ctx={ctx}: K+V pool {pool_bytes / 2**30:.1f} GiB > --max-cache-gib")
        return None
    rng = np.random.default_rng(b * 100_003 + ctx)
    table = jnp.asarray(rng.permutation(num_pages)[: b * pages_per_seq].reshape(b, pages_per_seq), jnp.int32)
    key = jax.random.key(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    k_pages = jax.random.normal(k1, (kvh, num_pages, page, d), dtype)
    v_pages = jax.random.normal(k2, (kvh, num_pages, page, d), dtype)
    lengths = jnp.full((b,), ctx, jnp.int32)
    q1 = jax.random.normal(k3, (b, 1, args.heads, d), dtype)
    qt = jax.random.normal(k4, (b, t, args.heads, d), dtype)
    tree = jnp.broadcast_to(jnp.asarray(_tree_mask(t)), (b, t, t))
    one = jnp.ones((b, 1, 1), bool)

    ref = jax.jit(paged_attention_reference)
    interpret = not kernels_compiled
    dec = jax.jit(lambda q, kp, vp, tb, ln: pallas_gpu.paged_decode_attention(q[:, 0], kp, vp, tb, ln + 1,
                                                                             interpret=interpret)[:, None])
    ver = jax.jit(lambda q, kp, vp, tb, ln, m: pallas_gpu.tree_verify_attention(q, kp, vp, tb, ln, m,
                                                                               interpret=interpret))
    row = dict(batch=b, context=ctx, kv_bytes=int(2 * b * (ctx + 1) * kvh * d * dtype.itemsize))
    timed_kernels = kernels_compiled or args.interpret
    for name, kern, kargs, rargs in (
        ("decode", dec, (q1, k_pages, v_pages, table, lengths), (q1, k_pages, v_pages, table, lengths, one)),
        ("verify", ver, (qt, k_pages, v_pages, table, lengths, tree), (qt, k_pages, v_pages, table, lengths, tree)),
    ):
        want = t_ref = None
        try:  # the reference gathers every row's keys: at the largest points it may not fit
            want = jax.block_until_ready(ref(*rargs))
            t_ref = _time(ref, rargs, args.iters, args.repeats)
            row[f"{name}_reference_us"] = t_ref * 1e6
            row[f"{name}_reference_GBps"] = row["kv_bytes"] / t_ref / 1e9
        except jax.errors.JaxRuntimeError as e:
            row[f"{name}_reference_error"] = str(e).splitlines()[0][:200]
        if timed_kernels:
            got = jax.block_until_ready(kern(*kargs))
            t_k = _time(kern, kargs, args.iters, args.repeats)
            row[f"{name}_pallas_us"] = t_k * 1e6
            row[f"{name}_pallas_GBps"] = row["kv_bytes"] / t_k / 1e9
            if want is not None:
                row[f"{name}_speedup"] = t_ref / t_k
                row[f"{name}_max_abs_diff"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        del want
    return row


def _describe(row: dict, name: str) -> str:
    ref = (f"ref {row[f'{name}_reference_us']:9.1f} us" if f"{name}_reference_us" in row
           else "ref       OOM   ")
    if f"{name}_pallas_us" not in row:
        return f"{name}: {ref}"
    out = f"{name}: {ref}  pallas {row[f'{name}_pallas_us']:9.1f} us ({row[f'{name}_pallas_GBps']:5.0f} GB/s"
    if f"{name}_speedup" in row:
        out += f", {row[f'{name}_speedup']:.2f}x, |diff| {row[f'{name}_max_abs_diff']:.1e}"
    return out + ")"


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    compiled = jax.default_backend() == "gpu"
    if not compiled and not args.interpret:
        print("no GPU: timing the XLA reference only (pass --interpret to time the kernels in interpret mode)")
    rows = []
    for b in args.batch_sizes:
        for ctx in args.contexts:
            row = run_point(args, b, ctx, compiled)
            if row is None:
                continue
            rows.append(row)
            print(f"B={b:4d} ctx={ctx:6d}  " + "  ".join(_describe(row, n) for n in ("decode", "verify")), flush=True)
            # Written after every point: a crash later keeps what was measured.
            write_json(dict(benchmark="kernels", machine=machine(), args=vars(args), kernels_compiled=compiled,
                            rows=rows), args.out, quiet=True)
    result = dict(benchmark="kernels", machine=machine(), args=vars(args), kernels_compiled=compiled, rows=rows)
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
