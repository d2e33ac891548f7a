"""The rollout engine: paged KV cache, bucketed pre-compiled programs, plain and speculative decoding.

`Engine.generate` takes prompts × ``n`` samples and returns, per sequence, the
new tokens, the target's log-probs of the processed sampling distribution,
the finish reason and (on request) the target features for drafter training.

How it runs. Device work is done only by the programs of
`tltjax.rollout.programs`, each lowered and compiled once at warm-up per
(batch bucket, strategy): the pool of executables that replaces CUDA graphs.
The host loop between calls (this module) admits waiting sequences when pages
are free, prefills them, picks the smallest bucket that holds the active rows
(compaction moves slot indices and page tables, never pages), grows each row's
pages ahead of the next chunk, preempts the newest rows when pages run out
(they are re-admitted later by recomputing their context: never a crash, never
a different token distribution), and reads back the tokens of each chunk.
There is no per-token host work: a chunk runs ``decode_steps`` plain steps or
``spec_rounds`` draft-verify rounds on device.

Speculation is switched per chunk: when the active rows fit in a bucket of at
most ``spec_threshold``, the strategy for that bucket (a `Strategy`, or the
choice of a callable) drafts and the target verifies. With a
`tltjax.rollout.bandit.Bandit` as ``strategy`` the choice is learned instead:
the pool holds speculative programs up to ``spec_max_bucket`` (within
``pool_budget_mb``), the bandit picks an arm (plain or a strategy) per chunk and
is told the tokens and device seconds of each call, measured where the engine
reads the tokens back anyway. The drafter's cache is advanced on every chunk, speculative
or not, so switching needs no re-prefill.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tltjax import sharding as sharding_lib
from tltjax.rollout import programs
from tltjax.rollout.bandit import Bandit
from tltjax.rollout.paged_cache import SCRATCH_PAGE, PageAllocator
from tltjax.rollout.sampling import SamplingParams
from tltjax.rollout.speculative import Strategy

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compile_count = 0


def _on_event(event: str, duration: float, **kw) -> None:
    global _compile_count
    if event == _BACKEND_COMPILE_EVENT:
        _compile_count += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """XLA compilations in this process so far (every backend compile, by anyone)."""
    return _compile_count


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Shapes and scheduling of the rollout engine.

    ``max_batch``: the largest batch bucket; buckets are the powers of two up to
    it. ``max_seq_len``: the most tokens (prompt + response) a sequence may hold.
    ``memory_budget_mb``: KV-cache memory (target + drafter pages); 0 gives room
    for ``max_batch`` full-length rows. ``decode_steps`` / ``spec_rounds``: device
    steps per call. ``spec_threshold``: speculate when the active rows fit a
    bucket of at most this size (0: never; with a bandit, its default for
    buckets not measured yet). ``strategies``: the pool compiled for those
    buckets. ``spec_max_bucket``: the largest bucket with speculative programs
    (0: ``spec_threshold``); a bandit can only choose among compiled programs, so
    an adaptive engine sets it to ``max_batch``. ``pool_budget_mb``: most memory
    the compiled programs may hold (0: no limit); speculative programs enter
    from the smallest bucket up and the rest are left out (`Engine.pool_summary`).
    ``prefill_batch``: rows per prefill call;
    ``prefill_lengths``: prompt-length buckets (default: powers of two from
    ``page_size``). ``max_group``: siblings the n-gram drafter reads.
    ``batch_buckets``: explicit bucket sizes (default: powers of two); the
    largest must be ``max_batch``.
    """

    max_batch: int = 64
    max_seq_len: int = 1024
    page_size: int = 16
    memory_budget_mb: float = 0.0
    decode_steps: int = 8
    spec_rounds: int = 4
    spec_threshold: int = 0
    strategies: tuple = ("eagle:depth=4",)
    prefill_batch: int = 4
    prefill_lengths: tuple = ()
    max_group: int = 8
    attention_impl: str = "auto"
    batch_buckets: tuple = ()
    spec_max_bucket: int = 0
    pool_budget_mb: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "strategies", tuple(Strategy.parse(s) for s in self.strategies))
        for name in ("max_batch", "max_seq_len", "page_size", "decode_steps", "spec_rounds", "prefill_batch"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"EngineConfig.{name}={v!r} must be an int >= 1")
        if self.max_batch & (self.max_batch - 1) and not self.batch_buckets:
            raise ValueError(f"EngineConfig.max_batch={self.max_batch} must be a power of two (the largest bucket)")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"EngineConfig.page_size={self.page_size} must be a power of two")
        if min(self.spec_threshold, self.max_group, self.memory_budget_mb, self.spec_max_bucket,
               self.pool_budget_mb) < 0:
            raise ValueError("EngineConfig.spec_threshold, max_group, memory_budget_mb, spec_max_bucket and "
                             "pool_budget_mb must be >= 0")
        if (self.spec_threshold or self.spec_max_bucket) and not self.strategies:
            raise ValueError("EngineConfig.spec_threshold / spec_max_bucket > 0 need at least one strategy")
        if self.spec_max_bucket and self.spec_max_bucket < self.spec_threshold:
            raise ValueError(f"EngineConfig.spec_max_bucket={self.spec_max_bucket} must be 0 or >= "
                             f"spec_threshold={self.spec_threshold} (the pool must hold the default's programs)")
        if self.batch_buckets and (max(self.batch_buckets) != self.max_batch or min(self.batch_buckets) < 1):
            raise ValueError(f"batch_buckets {self.batch_buckets} must be >= 1 with the largest == max_batch")
        if any(int(n) < 1 or int(n) > self.max_seq_len for n in self.prefill_lengths):
            raise ValueError(f"prefill_lengths {self.prefill_lengths} must lie in [1, max_seq_len={self.max_seq_len}]")

    @functools.cached_property
    def buckets(self) -> tuple[int, ...]:
        if self.batch_buckets:
            return tuple(sorted(set(int(b) for b in self.batch_buckets)))
        return tuple(1 << i for i in range(self.max_batch.bit_length()))

    @functools.cached_property
    def spec_buckets(self) -> tuple[int, ...]:
        """Buckets whose speculative programs the pool may hold."""
        return tuple(b for b in self.buckets if b <= (self.spec_max_bucket or self.spec_threshold))

    @functools.cached_property
    def pend_width(self) -> int:
        """Drafter positions a row can have pending: one chunk of plain steps or one round's emitted tokens."""
        return max([self.decode_steps] + [s.max_emitted for s in self.strategies])

    def margin(self, strategy: Strategy | None) -> int:
        """Tokens past a row's length that one call may write (its pages must exist beforehand)."""
        p = self.pend_width
        if strategy is None:
            return max(self.decode_steps, p) + 1
        tree = strategy.top_k * max(strategy.depth - 1, 0)
        return (self.spec_rounds - 1) * strategy.max_emitted + max(strategy.num_nodes + 1, p, tree) + 1

    @functools.cached_property
    def max_margin(self) -> int:
        return max([self.margin(None)] + [self.margin(s) for s in self.strategies])

    @functools.cached_property
    def pages_per_seq(self) -> int:
        return -(-(self.max_seq_len + self.max_margin) // self.page_size)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Prefill length buckets, the last one ``max_seq_len``."""
        if self.prefill_lengths:
            out = sorted(set(int(n) for n in self.prefill_lengths) | {self.max_seq_len})
        else:
            out, n = [], self.page_size
            while n < self.max_seq_len:
                out.append(n)
                n *= 2
            out.append(self.max_seq_len)
        return tuple(out)


@dataclasses.dataclass
class GeneratedSequence:
    """One generated sequence (see `Engine.generate`)."""

    prompt_index: int
    sample_index: int
    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    features: np.ndarray | None = None  # [len(prompt) + len(tokens) - 1, F]: feature of each position
    preemptions: int = 0
    budget: int = 0
    finish_time: float = 0.0  # seconds from the start of the generate call
    _feats: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens


@dataclasses.dataclass
class GenerateStats:
    """What one `Engine.generate` call did.

    ``compilations`` counts XLA compilations after warm-up (0: the pool covered everything);
    ``warmup_compilations`` those of a warm-up this call triggered (new sampling params);
    ``batch_trace`` lists (bucket, active rows, "plain" | strategy name) per call;
    ``accept_lengths`` the mean tokens emitted per active row in each speculative round.
    """

    tokens: int = 0
    sequences: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0
    spec_calls: int = 0
    decode_steps: int = 0
    spec_rounds: int = 0
    preemptions: int = 0
    compilations: int = 0
    warmup_compilations: int = 0
    time_prefill: float = 0.0
    time_decode: float = 0.0
    time_spec: float = 0.0
    time_host: float = 0.0
    time_total: float = 0.0
    max_pages_used: int = 0
    batch_trace: list = dataclasses.field(default_factory=list)
    accept_lengths: list = dataclasses.field(default_factory=list)
    spec_tokens: int = 0

    @property
    def mean_accept_length(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("batch_trace")
        d.pop("accept_lengths")
        d["mean_accept_length"] = self.mean_accept_length
        d["tokens_per_s"] = self.tokens / self.time_total if self.time_total else 0.0
        return d


StrategyChoice = (
    Strategy | str | None | Mapping[int, Strategy | str | None] | Callable[[int], Strategy | None] | Bandit
)


class Engine:
    """Generates from a `CausalLM` target, optionally speculating with a `Drafter`.

    The engine holds the page pools (sized by ``config.memory_budget_mb``) and the
    compiled programs for one sampling configuration; `warmup` compiles all of
    them, after which `generate` never compiles. `set_params` swaps in new target
    / drafter weights of the same shapes (e.g. after a policy update).
    """

    def __init__(
        self, target, config: EngineConfig = EngineConfig(), drafter=None, *, feature_layers=None, mesh=None
    ):
        self.config = config
        # ``mesh``: the engine's devices (a `tltjax.sharding.make_mesh` mesh, e.g. one rollout
        # replica): weights are laid out by their logical axes (tensor parallel over ``tensor``),
        # KV pages split by KV head, and every program is compiled for exactly these devices.
        self.mesh = mesh
        # On the CPU backend the "device" is this process's share of the host's cores: a chunk's device
        # time is the CPU time the process spent on it (other processes' load does not count), capped by
        # the wall time (parallel threads). Elsewhere it is the wall time up to the read-back.
        device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        self._cpu_clock = device.platform == "cpu"
        tgraph, self.tparams = nnx.split(target)
        self.target_config = target.config
        if drafter is not None:
            dgraph, self.dparams = nnx.split(drafter)
            layers = drafter.config.feature_layers
            if feature_layers is not None and tuple(feature_layers) != layers:
                raise ValueError(f"feature_layers {feature_layers} differ from the drafter's {layers}")
            drafter.config.check_target(target.config)
        else:
            dgraph, self.dparams = None, {}
            layers = tuple(feature_layers or (target.config.num_hidden_layers,))
            if any(s.drafter == "eagle" for s in config.strategies) and config.spec_buckets:
                raise ValueError(
                    "the eagle strategies in EngineConfig.strategies need a drafter; pass drafter=..., or use "
                    "'ngram:depth=...' strategies"
                )
        self._tgraph, self._dgraph, self.feature_layers = tgraph, dgraph, tuple(layers)
        self.tparams, self.dparams = self._place(self.tparams), self._place(self.dparams)
        self.drafter_config = None if drafter is None else drafter.config
        tc = target.config
        kv_bytes = PageAllocator.page_bytes(tc, config.page_size)
        if drafter is not None:
            kv_bytes += PageAllocator.page_bytes(drafter.config.layer_config, config.page_size)
        if config.memory_budget_mb:
            num_pages = int(config.memory_budget_mb * 2**20) // kv_bytes
        else:
            num_pages = config.max_batch * config.pages_per_seq + 1
        if num_pages < 2:
            raise ValueError(
                f"memory_budget_mb={config.memory_budget_mb} holds {num_pages} pages of {kv_bytes} bytes; "
                "raise it (a page holds page_size tokens of every layer's keys and values)"
            )
        self.num_pages = num_pages
        self.page_bytes = kv_bytes
        self._state = None
        self._programs: dict = {}
        self._pool: dict[int, tuple[Strategy, ...]] = {}  # bucket → strategies whose programs were compiled
        self._program_bytes: dict = {}
        self._left_out: list = []
        self._sampling: SamplingParams | None = None
        self._with_features: bool | None = None
        self.warmup_compilations = 0

    # ------------------------------------------------------------------ state and programs
    def _init_state(self) -> programs.EngineState:
        c, tc = self.config, self.target_config
        dtype = tc.jnp_dtype
        shape = (tc.num_hidden_layers, tc.num_key_value_heads, self.num_pages, c.page_size, tc.head_dim)
        if self.drafter_config is not None:
            lc = self.drafter_config.layer_config
            dshape = (1, lc.num_key_value_heads, self.num_pages, c.page_size, lc.head_dim)
        else:
            dshape = (1, 1, self.num_pages, c.page_size, 1)
        feat = tc.hidden_size * len(self.feature_layers)
        rows = programs.RowState.init(c.max_batch, c.pend_width, feat, c.pages_per_seq * c.page_size, dtype)
        state = programs.EngineState(
            k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype),
            dk_pages=jnp.zeros(dshape, dtype), dv_pages=jnp.zeros(dshape, dtype), rows=rows,
        )
        if self.mesh is None:
            return state
        pages = (None, "kv_heads", None, None, None)
        shardings = jax.tree.map(lambda a: NamedSharding(self.mesh, P()), state)
        shardings = shardings.replace(
            k_pages=sharding_lib.named_sharding(shape, pages, self.mesh),
            v_pages=sharding_lib.named_sharding(shape, pages, self.mesh),
            dk_pages=sharding_lib.named_sharding(dshape, pages, self.mesh),
            dv_pages=sharding_lib.named_sharding(dshape, pages, self.mesh),
        )
        return jax.device_put(state, shardings)

    def _pin_state(self) -> Callable:
        """Wraps a program so the state it returns keeps the layout it came in with (on a mesh, XLA
        would otherwise pick the output layout, and the next call would not accept it)."""
        if self.mesh is None:
            return lambda fn: fn
        layout = jax.tree.map(lambda a: a.sharding, self._state)

        def pin(fn):
            def pinned(*args):
                out = fn(*args)
                return (jax.lax.with_sharding_constraint(out[0], layout), *out[1:])

            return pinned

        return pin

    def _place(self, params: nnx.State) -> nnx.State:
        """``params`` laid out on the engine's mesh by their logical axes (as they are without a mesh)."""
        if self.mesh is None or not jax.tree.leaves(params):
            return params
        return jax.device_put(params, sharding_lib.state_shardings(params, self.mesh))

    def set_params(self, target=None, drafter=None) -> None:
        """Uses new weights (same shapes) from now on; compiled programs are kept.

        Weights on other devices (e.g. the training mesh) are copied onto the engine's mesh.
        """
        if target is not None:
            self.tparams = self._place(nnx.state(target))
        if drafter is not None:
            if self.drafter_config is None:
                raise ValueError("this engine was built without a drafter")
            self.dparams = self._place(nnx.state(drafter))

    def _spec(self, sampling: SamplingParams, with_features: bool) -> programs.ProgramSpec:
        return programs.ProgramSpec(
            target_graph=self._tgraph, drafter_graph=self._dgraph, feature_layers=self.feature_layers,
            sampling=sampling, impl=self.config.attention_impl, with_features=with_features,
        )

    def warmup(self, sampling: SamplingParams = SamplingParams(0.0), *, with_features: bool = False) -> int:
        """Compiles every program for ``sampling``; returns the number of compilations it took.

        Programs: a prefill per length bucket, a plain chunk per batch bucket and
        a speculative chunk per (bucket up to ``spec_max_bucket`` or
        ``spec_threshold``, strategy). Under ``pool_budget_mb`` speculative
        programs enter from the smallest bucket up, strategies in config order; a
        program that would overflow the budget is left out, and so are the larger
        buckets of its strategy.
        """
        if self._sampling == sampling and self._with_features == with_features and self._programs:
            return 0
        before = compile_count()
        c = self.config
        spec = self._spec(sampling, with_features)
        if self._state is None:
            self._state = self._init_state()
        host = None if self.mesh is None else NamedSharding(self.mesh, P())  # inputs from the host
        like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=None if host is None else a.sharding)  # noqa: E731
        st, tp, dp = (jax.tree.map(like, t) for t in (self._state, self.tparams, self.dparams))
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=host)  # noqa: E731
        key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=host)
        pps, nstop = c.pages_per_seq, 8
        pin = self._pin_state()
        progs = {}
        for n in c.lengths:
            b = c.prefill_batch
            fn = jax.jit(pin(functools.partial(_raw_prefill, spec)), donate_argnums=(2,))
            progs[("prefill", n)] = fn.lower(
                tp, dp, st, i32(b), i32(b, pps), i32(b, n), i32(b), i32(b), i32(nstop), key
            ).compile()
        for b in c.buckets:
            fn = jax.jit(pin(functools.partial(_raw_decode, spec, c.decode_steps)), donate_argnums=(2,))
            progs[("decode", b)] = fn.lower(tp, dp, st, i32(b), i32(b, pps), i32(nstop), key).compile()
        sizes = {k: program_bytes(p) for k, p in progs.items()}
        budget = c.pool_budget_mb * 2**20 or float("inf")
        if sum(sizes.values()) > budget:
            raise ValueError(
                f"EngineConfig.pool_budget_mb={c.pool_budget_mb} cannot hold the prefill and plain programs "
                f"({sum(sizes.values()) / 2**20:.2f} MB); raise it or set 0 (no limit)"
            )

        def build(b, s):
            fn = jax.jit(pin(functools.partial(_raw_spec, spec, s, c.spec_rounds)), donate_argnums=(2,))
            prog = fn.lower(tp, dp, st, i32(b), i32(b, pps), i32(b, max(c.max_group, 1)), i32(nstop), key).compile()
            return prog, program_bytes(prog)

        spec_progs, spec_sizes, left_out = fill_pool(c.spec_buckets, c.strategies, build,
                                                     budget - sum(sizes.values()))
        pool: dict[int, list[Strategy]] = {}
        for (b, s), prog in spec_progs.items():
            progs[("spec", b, s)], sizes[("spec", b, s)] = prog, spec_sizes[(b, s)]
            pool.setdefault(b, []).append(s)
        self._programs, self._sampling, self._with_features = progs, sampling, with_features
        self._pool = {b: tuple(v) for b, v in pool.items()}
        self._program_bytes, self._left_out = sizes, left_out
        self.warmup_compilations = compile_count() - before
        return self.warmup_compilations

    @property
    def num_programs(self) -> int:
        return len(self._programs)

    def arms(self, bucket: int) -> tuple[Strategy | None, ...]:
        """What a chunk of ``bucket`` can run: plain (None), then the pool's strategies for it (after `warmup`)."""
        return (None, *self._pool.get(bucket, ()))

    def pool_summary(self) -> dict:
        """The compiled pool: programs, their estimated memory (MB, see `program_bytes`), the budget,
        speculative programs per bucket and those the budget left out."""
        return {
            "programs": len(self._programs),
            "spec_programs": sum(len(v) for v in self._pool.values()),
            "mb": sum(self._program_bytes.values()) / 2**20,
            "budget_mb": self.config.pool_budget_mb,
            "arms": {b: ["plain", *(s.name for s in self._pool.get(b, ()))] for b in self.config.buckets},
            "left_out": [f"{s.name}@{b}" for b, s in self._left_out],
        }

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        sampling: SamplingParams = SamplingParams(0.0),
        max_new_tokens: int = 256,
        stop_ids: Sequence[int] = (),
        seed: int = 0,
        strategy: StrategyChoice = "auto",
        return_features: bool = False,
        progress: Callable[[dict], None] | None = None,
        on_finish: Callable[[GeneratedSequence], None] | None = None,
    ) -> tuple[list[GeneratedSequence], GenerateStats]:
        """Generates ``n`` samples per prompt; returns (sequences in prompt-major order, stats).

        ``strategy``: "auto" (the first strategy of the pool for every bucket up to
        ``spec_threshold``), None (never speculate), a `Strategy` or spec string
        (in every bucket whose pool holds it), a mapping bucket → strategy, a
        callable ``bucket -> Strategy | None``, or a `Bandit`, which chooses among
        `arms` per chunk and is updated after each call (tokens, seconds, rows).
        Only strategies of the compiled pool can run. ``progress`` receives a
        dict after every decode call (tokens, active rows, mean accept length, and the call's bucket,
        strategy and `time.perf_counter` span ``call_start``, ``call_end``).
        ``on_finish`` receives each sequence as soon as it finishes (its tokens,
        log-probs and finish reason are final; ``features`` are filled in at the
        end of the call), so that work on it (e.g. its reward) overlaps the tail.
        """
        c = self.config
        self._check_inputs(prompts, n, max_new_tokens, stop_ids)
        choose = self._chooser(strategy)
        bandit = strategy if isinstance(strategy, Bandit) else None
        t_start = time.perf_counter()
        stats = GenerateStats(warmup_compilations=self.warmup(sampling, with_features=return_features))
        compiles_before = compile_count()
        seqs = [
            GeneratedSequence(prompt_index=i, sample_index=j, prompt=[int(t) for t in p])
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        for s in seqs:
            s.budget = min(max_new_tokens, c.max_seq_len - len(s.prompt))
        stops = np.full((8,), -1, np.int32)
        stops[: len(stop_ids)] = list(stop_ids)
        stop_set = set(int(s) for s in stop_ids)
        alloc = PageAllocator(self.num_pages, c.page_size)
        free_slots = list(range(c.max_batch - 1, -1, -1))
        slot_of: dict[int, int] = {}  # seq index → slot (active rows)
        slot_owner: dict[int, int] = {}  # slot → seq index of its latest occupant (for sibling reads)
        admitted_order: dict[int, None] = {}  # active rows in admission order
        queue = collections.deque(range(len(seqs)))
        calls = 0

        def key_data():
            # (seed, call number) as raw threefry key data: distinct per call, and no device op here
            nonlocal calls
            calls += 1
            return np.array([seed & 0xFFFFFFFF, calls], np.uint32)

        def finish(i: int, reason: str) -> None:
            s = seqs[i]
            s.finish_reason = reason
            s.finish_time = time.perf_counter() - t_start
            alloc.free(i)
            free_slots.append(slot_of.pop(i))
            del admitted_order[i]
            if on_finish is not None:
                on_finish(s)

        def take(i: int, toks, lps, feats) -> bool:
            """Appends emitted tokens to sequence i; True when it finished."""
            s = seqs[i]
            for k, (t, lp) in enumerate(zip(toks, lps)):
                s.tokens.append(int(t))
                s.logprobs.append(float(lp))
                if return_features:
                    s._feats.append(feats[k])
                if int(t) in stop_set:
                    finish(i, "stop")
                    return True
                if len(s.tokens) >= s.budget:
                    finish(i, "length")
                    return True
            return False

        while queue or slot_of:
            # ---- admit and prefill waiting sequences
            t0 = time.perf_counter()
            admitted = []
            while queue and free_slots:
                i = queue[0]
                need = min(len(seqs[i].context) + c.max_margin, c.pages_per_seq * c.page_size)
                if not alloc.ensure(i, need):
                    break
                queue.popleft()
                slot = free_slots.pop()
                slot_of[i], slot_owner[slot] = slot, i
                admitted_order[i] = None
                admitted.append(i)
            if not slot_of and queue:
                i = queue[0]
                raise RuntimeError(
                    f"the KV-cache budget ({self.num_pages - 1} pages of {c.page_size} tokens) cannot hold one "
                    f"sequence of {len(seqs[i].context)} tokens plus a chunk's margin of {c.max_margin}; raise "
                    "EngineConfig.memory_budget_mb or lower max_seq_len / decode_steps"
                )
            stats.time_host += time.perf_counter() - t0
            for start in range(0, len(admitted), c.prefill_batch):
                group = admitted[start : start + c.prefill_batch]
                self._prefill(group, seqs, slot_of, alloc, stops, key_data(), stats, return_features, take)
            if not slot_of:
                continue
            # ---- pick the bucket and strategy, make room for the next chunk (preempting rows shrinks the
            # bucket, which may change the strategy and its margin: choose again until nothing is preempted)
            t0 = time.perf_counter()
            cap = c.pages_per_seq * c.page_size
            while active := list(admitted_order):
                bucket = next(b for b in c.buckets if b >= len(active))
                strat = choose(bucket) if self._pool.get(bucket) else None
                margin = c.margin(strat)
                preempted = False
                for i in active:
                    if i not in slot_of:
                        continue
                    while not alloc.ensure(i, min(len(seqs[i].context) - 1 + margin, cap)):
                        victim = next(reversed(admitted_order))
                        self._preempt(victim, seqs, slot_of, free_slots, alloc, admitted_order, queue)
                        stats.preemptions += 1
                        preempted = True
                        if victim == i:
                            break
                if not preempted:
                    break
            if not active:
                stats.time_host += time.perf_counter() - t0
                continue
            idx = np.full((bucket,), c.max_batch, np.int32)
            idx[: len(active)] = [slot_of[i] for i in active]
            table = np.full((bucket, c.pages_per_seq), SCRATCH_PAGE, np.int32)
            table[: len(active)] = alloc.table(active, c.pages_per_seq)
            stats.max_pages_used = max(stats.max_pages_used, self.num_pages - 1 - alloc.num_free)
            stats.time_host += time.perf_counter() - t0
            # ---- one device call
            t0, c0 = time.perf_counter(), time.process_time()
            if strat is None:
                prog = self._programs[("decode", bucket)]
                self._state, out = prog(self.tparams, self.dparams, self._state, idx, table, stops, key_data())
            else:
                if strat.drafter == "ngram":
                    group = self._groups(active, seqs, slot_of, slot_owner, bucket)
                else:  # unused by the program
                    group = np.full((bucket, max(c.max_group, 1)), c.max_batch, np.int32)
                prog = self._programs[("spec", bucket, strat)]
                self._state, out = prog(self.tparams, self.dparams, self._state, idx, table, group, stops, key_data())
            out = jax.device_get(out)
            t_call, t_done = t0, time.perf_counter()
            dt = t_done - t0
            device_s = min(dt, time.process_time() - c0) if self._cpu_clock else dt
            t0 = time.perf_counter()
            emitted = 0
            for r, i in enumerate(active):
                for step in range(out.count.shape[1]):
                    k = int(out.count[r, step])
                    if k == 0:
                        continue
                    emitted += k
                    feats = out.features[r, step, :k] if return_features else None
                    if take(i, out.tokens[r, step, :k], out.logprobs[r, step, :k], feats):
                        break
            stats.tokens += emitted
            if bandit is not None:
                live = float((out.count[: len(active)] > 0).sum()) / out.count.shape[1]  # rows live per step
                bandit.update(bucket, strat, emitted, device_s, rows=live)
            stats.batch_trace.append((bucket, len(active), "plain" if strat is None else strat.name))
            if strat is None:
                stats.decode_calls += 1
                stats.decode_steps += c.decode_steps
                stats.time_decode += dt
            else:
                stats.spec_calls += 1
                stats.spec_rounds += c.spec_rounds
                stats.time_spec += dt
                stats.spec_tokens += emitted
                counts = out.count[: len(active)]
                for step in range(counts.shape[1]):
                    live = counts[:, step] > 0
                    if live.any():
                        stats.accept_lengths.append(float(counts[live, step].mean()))
            stats.time_host += time.perf_counter() - t0
            if progress is not None:
                progress({"tokens": stats.tokens, "active": len(slot_of), "waiting": len(queue),
                          "accept": stats.mean_accept_length, "bucket": bucket,
                          "strategy": "plain" if strat is None else strat.name, "call_start": t_call,
                          "call_end": t_done})
        for s in seqs:
            if return_features:
                s.features = np.stack(s._feats) if s._feats else None
            s._feats = []
        stats.sequences = len(seqs)
        stats.compilations = compile_count() - compiles_before
        stats.time_total = time.perf_counter() - t_start
        return seqs, stats

    # ------------------------------------------------------------------ helpers
    def _check_inputs(self, prompts, n, max_new_tokens, stop_ids) -> None:
        c = self.config
        vocab = self.target_config.vocab_size
        if not prompts:
            raise ValueError("generate needs at least one prompt")
        if n < 1 or max_new_tokens < 1:
            raise ValueError(f"n={n} and max_new_tokens={max_new_tokens} must be >= 1")
        if len(stop_ids) > 8:
            raise ValueError(f"at most 8 stop ids, got {len(stop_ids)}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if len(p) >= c.max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; EngineConfig.max_seq_len={c.max_seq_len} leaves no room to "
                    "generate: raise max_seq_len or shorten the prompt"
                )
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {min(p)}..{max(p)}")

    def _chooser(self, strategy: StrategyChoice) -> Callable[[int], Strategy | None]:
        """``bucket -> Strategy | None``; called only for buckets whose pool holds speculative programs."""
        pool = self.config.strategies
        if isinstance(strategy, Bandit):
            return lambda b: strategy.select(b, self.arms(b))
        if isinstance(strategy, str) and strategy == "auto":
            thr = self.config.spec_threshold
            return lambda b: pool[0] if b <= thr and pool[0] in self._pool.get(b, ()) else None
        if strategy is None:
            return lambda b: None

        def check(s, bucket=None):
            if s is None:
                return None
            s = Strategy.parse(s)
            if s not in pool:
                raise ValueError(f"strategy {s.name} is not in the compiled pool {[p.name for p in pool]}")
            if bucket is not None and s not in self._pool.get(bucket, ()):
                raise ValueError(f"strategy {s.name} has no program for bucket {bucket} in the pool "
                                 f"{self.pool_summary()['arms'][bucket]} (pool_budget_mb left it out)")
            return s

        if isinstance(strategy, Mapping):
            table = {int(b): check(s) for b, s in strategy.items()}
            return lambda b: check(table.get(b), b)
        if callable(strategy) and not isinstance(strategy, Strategy):
            return lambda b: check(strategy(b), b)
        fixed = check(strategy)
        return lambda b: fixed if fixed in self._pool.get(b, ()) else None

    def _groups(self, active, seqs, slot_of, slot_owner, bucket) -> np.ndarray:
        """Slots of each row's sibling responses (same prompt), padded with the empty slot."""
        c = self.config
        g = max(c.max_group, 1)
        out = np.full((bucket, g), c.max_batch, np.int32)
        by_prompt: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        for slot, j in slot_owner.items():
            by_prompt[seqs[j].prompt_index].append((slot, j))
        for r, i in enumerate(active):
            sib = []
            for slot, j in by_prompt[seqs[i].prompt_index]:
                if len(sib) == c.max_group:
                    break
                if j != i:
                    sib.append(slot)
            out[r, : len(sib)] = sib
        return out

    def _prefill(self, group, seqs, slot_of, alloc, stops, key, stats, return_features, take) -> None:
        c = self.config
        t0 = time.perf_counter()
        ctx = [seqs[i].context for i in group]
        longest = max(len(x) for x in ctx)
        n = next(L for L in c.lengths if L >= longest)
        b = c.prefill_batch
        ids = np.zeros((b, n), np.int32)
        lens = np.zeros((b,), np.int32)
        budget = np.zeros((b,), np.int32)
        idx = np.full((b,), c.max_batch, np.int32)
        for r, (i, x) in enumerate(zip(group, ctx)):
            ids[r, : len(x)] = x
            lens[r] = len(x)
            budget[r] = seqs[i].budget - len(seqs[i].tokens)
            idx[r] = slot_of[i]
        table = np.full((b, c.pages_per_seq), SCRATCH_PAGE, np.int32)
        table[: len(group)] = alloc.table(group, c.pages_per_seq)
        stats.time_host += time.perf_counter() - t0
        t0 = time.perf_counter()
        prog = self._programs[("prefill", n)]
        self._state, out, prompt_feats = prog(
            self.tparams, self.dparams, self._state, idx, table, ids, lens, budget, stops, key
        )
        out, prompt_feats = jax.device_get((out, prompt_feats))
        stats.time_prefill += time.perf_counter() - t0
        stats.prefill_calls += 1
        for r, i in enumerate(group):
            s = seqs[i]
            if return_features:
                s._feats = list(prompt_feats[r, : lens[r] - 1])  # positions before the last context token
                feats = out.features[r, 0]
            else:
                feats = None
            stats.tokens += 1
            take(i, out.tokens[r, 0], out.logprobs[r, 0], feats)

    def _preempt(self, i, seqs, slot_of, free_slots, alloc, admitted_order, queue) -> None:
        """Frees row i's pages and slot; it waits at the front of the queue and resumes by recompute."""
        alloc.free(i)
        free_slots.append(slot_of.pop(i))
        del admitted_order[i]
        seqs[i].preemptions += 1
        queue.appendleft(i)


def fill_pool(buckets, strategies, build, room: float):
    """Speculative programs within ``room`` bytes: the smallest bucket first, strategies in order; a program
    that would overflow is left out, and so are the larger buckets of its strategy (not even compiled).

    ``build(bucket, strategy) -> (program, bytes)``. Returns (programs and sizes keyed by (bucket,
    strategy), the (bucket, strategy) pairs left out).
    """
    progs, sizes, left_out, dropped = {}, {}, [], set()
    used = 0
    for b in buckets:
        for s in strategies:
            if s in dropped:
                left_out.append((b, s))
                continue
            prog, size = build(b, s)
            if used + size > room:
                dropped.add(s)
                left_out.append((b, s))
                continue
            progs[(b, s)], sizes[(b, s)] = prog, size
            used += size
    return progs, sizes, left_out


def program_bytes(compiled) -> int:
    """Memory a compiled program holds or needs beyond its (donated) arguments: generated code plus
    temporaries, as XLA reports them (``memory_analysis``); 0 where the backend reports nothing."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return 0
    if m is None:
        return 0
    return int(m.generated_code_size_in_bytes + m.temp_size_in_bytes)


def _raw_prefill(spec, tparams, dparams, state, idx, table, ids, lens, budget, stops, key):
    return programs.prefill(spec, tparams, dparams, state, idx, table, ids, lens, budget, stops,
                            jax.random.wrap_key_data(key))


def _raw_decode(spec, steps, tparams, dparams, state, idx, table, stops, key):
    return programs.decode_chunk(spec, steps, tparams, dparams, state, idx, table, stops,
                                 jax.random.wrap_key_data(key))


def _raw_spec(spec, strategy, rounds, tparams, dparams, state, idx, table, group, stops, key):
    return programs.spec_chunk(spec, strategy, rounds, tparams, dparams, state, idx, table, group, stops,
                               jax.random.wrap_key_data(key))
