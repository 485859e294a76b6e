"""Model runner: one model, its preallocated KV cache, slots, padded ragged forwards."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

import torch

from actors.engine.kv_cache import KVCache, KVSlotPool
from actors.engine.model import BatchMeta, CausalLM, ForwardOutput
from configs import metric_names as M


@dataclass(frozen=True)
class RowInput:
    """One request's slice of a batched forward: ``token_ids`` go to positions
    ``start .. start+len-1`` of cache slot ``slot``."""

    slot: int
    start: int
    token_ids: list[int]


@dataclass(frozen=True)
class ForwardRoute:
    """The forwards a ``ModelRunner`` runs, chosen when the model loads (``select_route``):
    which one serves a batch then depends on its shape only.

    stack_tokens: batches of at most this many tokens run every layer in one C call
    (``FORWARD_PATH_STACK``); 0: no stack call (no packed weights, the kernel not built).
    flat: the flat forward of batches of short rows past the stack (``run_flat`` on the
    compiled graph, ``FORWARD_PATH_COMPILED``, or eager with the C attention kernel,
    ``FORWARD_PATH_OPS``), None: none; it returns None for a batch the compiled graph
    refuses. flat_max_q / flat_max_tokens: its longest row / most tokens.
    Every other batch runs packed (``run_packed``: prompt chunks, uneven verifies) or
    padded (``run_padded``), by ``ModelRunner.pack``.
    weights_version: the model's ``weights_version`` the route was chosen for.
    flat_kind: "compiled" | "eager" | "" (no flat forward)."""

    stack_tokens: int
    flat: Callable[..., tuple | None] | None
    flat_max_q: int
    flat_max_tokens: int
    weights_version: int
    flat_kind: str = ""

    @property
    def name(self) -> str:
        """The route in words, e.g. ``stack<=16 + compiled<=1024 + packed|padded``."""
        parts = [f"stack<={self.stack_tokens}"] if self.stack_tokens else []
        if self.flat is not None:
            parts.append(f"{self.flat_kind}<={self.flat_max_tokens}")
        return " + ".join(parts + ["packed|padded"])


class ModelRunner:
    """Owns a ``CausalLM`` and a ``KVCache`` of ``num_slots`` x ``max_len`` tokens.

    ``run`` pads ragged rows to the longest one and returns logits for every
    real token (or only each row's last, for prefill), so a whole batch of
    requests with different draft lengths is verified in one forward. Slots
    and per-request lengths live in ``self.cache.pool`` (``KVSlotPool``).
    """

    # padded rows write past a request's end; this many extra positions keep
    # those writes in bounds (more than any draft length plus the anchor).
    PAD_MARGIN = 72

    def __init__(self, model: CausalLM, num_slots: int, max_len: int, pad_id: int = 0,
                 name: str = "target KV cache"):
        self.model = model
        self.device = model.device
        dtype = model.lm_head.weight.dtype
        self.cache = KVCache(model.config, num_slots, max_len, self.device, dtype,
                             margin=self.PAD_MARGIN, name=name)
        self.pool: KVSlotPool = self.cache.pool
        self.max_len = max_len
        self.pad_id = pad_id
        # the torch.compile'd flat forward (``compile``); None: eager
        self._flat = None
        # its attention by the C kernel (``actors.engine.attention_kernel``): set by
        # ``compile`` where the kernel builds and the cache is float32 on a CPU
        self.flat_kernel = False
        self.flat_fallbacks = 0     # batches the compiled forward refused (a recompile due)
        # eager forwards of decode / verify batches flat too, attention by the C kernel
        # (``EAGER_FLAT``): a CPU, a float32 cache, the kernel built
        self._stack, self._stack_key = None, None     # ``stack``
        # the forward path of every forward since the caller last cleared it (FORWARD_PATH_*
        # of ``configs.metric_names``, in order; the engine's step row records them)
        self.paths: collections.deque[str] = collections.deque(maxlen=64)
        # whether the latest ``run`` padded its rows to the longest (``run_padded``); the
        # stack, flat and packed forwards compute each row's own tokens only
        self.last_padded = False
        self.eager_flat = False
        if self.EAGER_FLAT and self.device.type == "cpu" and dtype == torch.float32:
            from actors.engine import attention_kernel

            self.eager_flat = attention_kernel.load() is not None
        self.route = self.select_route()

    # attributes the route depends on: setting one (``compile``, a test switching a path
    # off) chooses the route again, so ``run`` never re-derives it per step
    ROUTE_INPUTS = frozenset({"_flat", "flat_kernel", "eager_flat", "STACK_KERNEL",
                              "STACK_MAX_TOKENS", "FLAT_MAX_Q", "FLAT_MAX_TOKENS",
                              "FLAT_KERNEL_MAX_Q", "FLAT_KERNEL_MAX_TOKENS", "EAGER_FLAT_MAX_Q"})

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name in self.ROUTE_INPUTS and "route" in self.__dict__:
            object.__setattr__(self, "route", self.select_route())

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        if name in self.ROUTE_INPUTS and "route" in self.__dict__:
            object.__setattr__(self, "route", self.select_route())

    def select_route(self) -> ForwardRoute:
        """Choose the forward of each batch shape class (``ForwardRoute``) from what loaded:
        the stack call where the packed weights and the layer kernel are there, the
        compiled flat forward after ``compile``, else the eager flat one where the C
        attention kernel built. Called at load, after ``compile`` and when the model's
        weights were fused again (``CausalLM.weights_version``); not per step."""
        stack_tokens = self.stack_max_tokens if self.stack() is not None else 0
        if self._flat is not None:
            flat, kind, (max_q, max_tokens) = self._run_flat_past_stack, "compiled", self.flat_limits
        elif self.eager_flat:
            flat, kind, max_q, max_tokens = (self._run_flat_past_stack, "eager",
                                             self.EAGER_FLAT_MAX_Q, self.FLAT_KERNEL_MAX_TOKENS)
        else:
            flat, kind, max_q, max_tokens = None, "", 0, 0
        return ForwardRoute(stack_tokens, flat, max_q, max_tokens, self.model.weights_version,
                            kind)

    # Without a compiled forward, batches of rows of at most this many tokens (decodes,
    # verifies) still run flat (``run_flat``, eager): each token attends its own slot up to
    # its own position in the C kernel, where the padded batch's SDPA read and masked every
    # row to the longest context (tiny target, 8 decodes, one thread: SDPA 443 us a layer
    # there, 34% of the step). Prompt chunks keep the packed / padded forwards.
    EAGER_FLAT = True
    EAGER_FLAT_MAX_Q = 16
    # Batches of at most this many tokens run every layer in one C call
    # (``actors.engine.layer_kernel``: the tiny target's b1 decode step 3.1 ms op by op, of
    # which 0.9 ms computing), compiled forward or not. Needs the packed bfloat16 weights
    # (``CausalLM.packable``) and a float32 cache on a CPU.
    STACK_KERNEL = True
    STACK_MAX_TOKENS = None     # None: the kernel's own limit (``layer_kernel.max_tokens()``:
    # 16, or 1024 with the AVX-512 weight kernel, which serves verifies of any length)

    # torch.compile (inductor), vLLM's default on its CPU and GPU backends (``enforce_eager``
    # off), of the flat forward (``run_flat``): a batch's tokens one after the other, each
    # attending its own slot (``Attention._flat_attention``). T (tokens), the rows' mix of
    # lengths, the logits wanted and the context read are all dynamic, so ONE graph covers
    # every batch of short rows: decodes, verifies of any draft lengths (ngram's 0..k),
    # short prompt chunks (a prompt's tail after a prefix-cache hit) and any mix of them in
    # one forward. The warm-up compiles it at load; a batch that would compile again runs
    # eager instead (``fail_on_recompile``): never a compile while a request waits.
    # rows of at most this many tokens run on the compiled forward: decodes, verifies and
    # prompt chunks up to here (with 16 verify rows of a 4-draft step, a 32-token chunk ran
    # in 45.7 ms flat vs 51.9 packed eager; a 110-token one was even, 57.2 vs 60.3; a
    # 250-token one lost, 122 vs 101: the flat attention reads T x context)
    FLAT_MAX_Q = 64
    FLAT_MAX_TOKENS = 256    # ... while the batch has at most this many tokens
    # the same with the C attention kernel (``flat_kernel``), which reads each token's own
    # positions only: 15 decodes + a prompt chunk from position 0, tiny target, one
    # thread: 64 tokens 19.9 ms flat vs 28.1 packed eager, 250: 51.1 vs 61.1, 500: 111.5 vs
    # 122.8; 250 tokens from position 300: 70.5 vs 73.9
    FLAT_KERNEL_MAX_Q = 512
    FLAT_KERNEL_MAX_TOKENS = 1024
    # (row starts, row lengths) of the warm-up batches (slots 0.. of a fresh cache): the
    # first compiles the graph, the others must run on it and match eager
    COMPILE_WARM_ROWS = (((40, 9), (5, 3)), ((17,), (1,)), ((31, 12, 60), (2, 1, 4)),
                         ((0,), (6,)), ((8, 0), (9, 16)))

    def compile(self) -> bool:
        """Compile the flat forward (``run_flat``) for batches of short rows.

        Returns False (and stays eager, with a warning logged) when the cache already has
        requests, inductor fails (no C++ compiler), or the compiled logits differ
        from the eager ones on the warm-up rows by more than 1e-3 (numerical ties of
        ~1e-6 are expected: fused kernels round in another order). The warm-up writes
        the free slots 0..2 of the cache (positions past a slot's valid length, which
        attention masks and later writes overwrite); call it before serving."""
        import logging

        log = logging.getLogger(__name__)
        if self._flat is not None:
            return True
        if self.pool.num_free < self.pool.num_slots or self.pool.num_slots < 3:
            log.warning("compile: the cache has live requests or fewer than 3 slots; eager")
            return False
        if max(s + n for starts, lens in self.COMPILE_WARM_ROWS
               for s, n in zip(starts, lens)) + 1 > self.max_len:
            return False
        if self.device.type == "cpu" and self.cache.k[0].dtype == torch.float32:
            from actors.engine import attention_kernel

            self.flat_kernel = attention_kernel.load() is not None
        if not self._compile_and_check(log):
            self.flat_kernel = False       # eager: the attribute says what runs
            return False
        return True

    def _compile_and_check(self, log) -> bool:
        """``compile``'s work: torch.compile the forward, run the warm-up rows on it and
        compare them with eager; True (and ``_flat`` set) when every check held."""
        import torch._dynamo   # not loaded by the model's construction any more

        # (the draft model's graph counts against the same code object's limit)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
        try:
            import torch.fx.experimental._config as fx_config

            fn = torch.compile(self.model.forward, dynamic=True)
            gen = torch.Generator().manual_seed(0)
            V = self.model.config.vocab_size
            first = True
            for starts, lens in self.COMPILE_WARM_ROWS:
                for last_only in (False, True):
                    rows = [RowInput(i, st, torch.randint(0, V, (n,), generator=gen).tolist())
                            for i, (st, n) in enumerate(zip(starts, lens))]
                    ctx = [RowInput(i, 0, torch.randint(0, V, (st,), generator=gen).tolist())
                           for i, st in enumerate(starts) if st > 0]
                    if ctx:                     # contexts to attend, written eager
                        self.run_packed(ctx)
                    want, _ = self.run_packed(rows, last_only)
                    self._flat = fn
                    try:
                        # no duck shaping: sizes equal by chance in the compiling batch (T
                        # and the logits rows, two contexts) must not become one symbol
                        with fx_config.patch(use_duck_shape=False):
                            got = self.run_flat(rows, last_only, strict=not first,
                                                stack=False)
                    finally:
                        self._flat = None
                    first = False
                    if got is None:
                        log.warning("compile: the warm-up batch %s needed a second graph; "
                                    "staying eager", lens)
                        return False
                    got = got[0]
                    err = max(float((g - w).abs().max()) for g, w in zip(got, want))
                    if not err <= 1e-3:
                        log.warning("compile: compiled logits differ from eager by %.2e "
                                    "(rows %s); staying eager", err, lens)
                        return False
        except Exception as exc:  # noqa: BLE001  (inductor: no C++ compiler, an unsupported op)
            log.warning("compile: torch.compile failed, staying eager: %r", exc)
            return False
        self._flat = fn
        return True

    @property
    def last_path(self) -> str | None:
        """The forward path of the latest forward (``paths``' last), None before any."""
        return self.paths[-1] if self.paths else None

    @property
    def stack_max_tokens(self) -> int:
        """The most tokens of a batch on the stack call (``STACK_MAX_TOKENS``)."""
        if self.STACK_MAX_TOKENS is not None:
            return self.STACK_MAX_TOKENS
        from actors.engine import layer_kernel

        return layer_kernel.max_tokens()

    def stack(self):
        """The model's layers over this cache for one C call a forward
        (``layer_kernel.Stack``; built at first use, again after ``CausalLM.fuse``
        replaced the packed weights), or None where it does not apply (``Stack.usable``)."""
        if not self.STACK_KERNEL:
            return None
        layer0 = self.model.model.layers[0].self_attn
        key = getattr(layer0, "qkv_packed", None)
        if self._stack_key is not key or key is None:
            from actors.engine import layer_kernel

            self._stack = layer_kernel.Stack.of(self.model, self.cache)
            self._stack_key = key
        return self._stack

    def current_route(self) -> ForwardRoute:
        """``route``, chosen again first when the model's weights were fused since."""
        route = self.route
        if route.weights_version != self.model.weights_version:
            route = self.route = self.select_route()
        return route

    def flat(self, lens: list[int]) -> bool:
        """Whether a batch with these row lengths runs flat (``run_flat``): in one C call
        (``stack``: at most ``stack_max_tokens`` tokens), on the compiled forward,
        or eager with the C attention kernel (``eager_flat``)."""
        if not lens:
            return False
        route, n = self.current_route(), sum(lens)
        return n <= route.stack_tokens or (route.flat is not None and max(lens) <= route.flat_max_q
                                           and n <= route.flat_max_tokens)

    @property
    def flat_limits(self) -> tuple[int, int]:
        """(longest row, most tokens) of a batch on the compiled flat forward."""
        if self.flat_kernel:
            return self.FLAT_KERNEL_MAX_Q, self.FLAT_KERNEL_MAX_TOKENS
        return self.FLAT_MAX_Q, self.FLAT_MAX_TOKENS

    def fuses(self, lens: list[int]) -> bool:
        """Whether rows of these lengths (a step's prompt chunks and its longest verify
        row) should share one forward: the compiled flat one or a packed one."""
        return self.flat(lens) or self.pack(lens)

    @torch.inference_mode()
    def run(self, rows: list[RowInput], last_only: bool | list[bool] = False,
            aux_layers: tuple[int, ...] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Forward ``rows`` in one padded batch.

        Returns (logits, aux): logits[i] is [len_i, V] (or [1, V] with
        ``last_only``, which may be a list: per row); aux[i] is [len_i, A*H] target hidden states of
        ``aux_layers`` or None when no aux layers were asked for.
        """
        lens = [len(r.token_ids) for r in rows]
        route, n = self.current_route(), sum(lens)
        self.last_padded = False
        if n <= route.stack_tokens:
            return self._run_stack(rows, last_only, aux_layers)
        if not aux_layers and route.flat is not None and max(lens) <= route.flat_max_q \
                and n <= route.flat_max_tokens:
            got = route.flat(rows, last_only)
            if got is not None:
                return got
        if isinstance(last_only, (list, tuple)):     # per row (a decode + prefill batch)
            if len(set(last_only)) == 1:
                last_only = bool(last_only[0])
            else:
                return self.run_packed(rows, list(last_only), aux_layers)
        if self.pack(lens):
            return self.run_packed(rows, last_only, aux_layers)
        logits, aux = self.run_padded(rows, last_only, aux_layers)
        if last_only:
            per_row = [logits[i] for i in range(len(rows))]
        else:
            per_row = [logits[i, :lens[i]] for i in range(len(rows))]
        return per_row, aux

    # a row attending alone costs about this many K/V positions' reads (the call's overhead)
    ROW_CALL_POSITIONS = 256
    MAX_LONG_ROWS = 8

    def split_long(self, rows: list[RowInput], kv_len: int
                   ) -> tuple[list[tuple[int, int, int]] | None, int | None]:
        """Which rows of a padded batch attend alone: attention reads every row's K/V up
        to the longest context, so one long request makes a batch of short ones read
        (and mask) that many positions each. Picks the j longest rows (j <= 8) that
        minimise B x (the (j+1)-th longest context) + their own contexts + a call's cost
        each; returns ([(row, slot, context)], the others' longest context) or (None,
        None) when no split pays."""
        B = len(rows)
        ctx = sorted(((r.start + len(r.token_ids), i) for i, r in enumerate(rows)), reverse=True)
        best_j, best = 0, B * kv_len
        acc = 0
        for j in range(1, min(self.MAX_LONG_ROWS, B - 1) + 1):
            acc += ctx[j - 1][0] + self.ROW_CALL_POSITIONS
            cost = B * ctx[j][0] + acc
            if cost < best:
                best_j, best = j, cost
        if best_j == 0 or best > 0.8 * B * kv_len:
            return None, None
        return ([(i, rows[i].slot, n) for n, i in ctx[:best_j]], ctx[best_j][0])

    # rows longer than this (prompt chunks) make a batch run packed: padding every row
    # to a prompt's length costs more than the per-row attention calls of a packed one
    PACK_MIN_TOKENS = 16

    # ... and so does a batch whose real tokens fill at most this share of the padded
    # B x Q (verifies of uneven draft lengths: ngram proposes 0..k tokens per row): every
    # GEMM and the LM head run over the real tokens only, and each row attends its own
    # context (no padding to the longest: a step reads the K/V it needs; a verify step is
    # bound by those bytes and the weights', not by FLOPs)
    PACK_FILL = 0.75

    def pack(self, lens: list[int]) -> bool:
        """Whether a batch with these row lengths runs packed (``run_packed``)."""
        if len(lens) < 2:
            return False
        m = max(lens)
        if m >= self.PACK_MIN_TOKENS:
            return True
        return m > 1 and sum(lens) <= self.PACK_FILL * len(lens) * m

    def flat_groups(self, pos: list[int]) -> tuple[tuple, torch.Tensor]:
        """Two groups of a flat batch's tokens by context length (``pos`` [T], T >= 2):
        the tokens whose contexts are at most a threshold, which read only that far, and
        the rest, which read to the longest. The threshold minimises the positions read,
        sum over groups of tokens x context. Each group has at least 2 entries (a token
        repeated: the same output twice; one graph for every batch).
        Returns (((idx [Ta], n_a), (idx [Tb], n_b)), back [T])."""
        T = len(pos)
        order = sorted(range(T), key=pos.__getitem__)
        n = [pos[i] + 1 for i in order]
        best, cut = T * n[-1], 1
        for j in range(1, T):
            cost = j * n[j - 1] + (T - j) * n[-1]
            if cost < best:
                best, cut = cost, j
        a, b = order[:cut], order[cut:]
        back = [0] * T
        for i, t in enumerate(a + b):
            back[t] = i
        a, b = (a * 2 if len(a) == 1 else a), (b * 2 if len(b) == 1 else b)
        back = [i + (len(a) - cut if i >= cut else 0) for i in back]
        dev = self.device
        # (contexts of at least 2: a 1 would be specialised; position 1 is masked anyway)
        return ((torch.tensor(a, dtype=torch.long, device=dev), max(2, n[cut - 1])),
                (torch.tensor(b, dtype=torch.long, device=dev), max(2, n[-1]))), \
            torch.tensor(back, dtype=torch.long, device=dev)

    @staticmethod
    def _flat_inputs(rows: list[RowInput], last_only: bool | list[bool]
                     ) -> tuple[list[bool], list[int], list[int], list[int], list[int]]:
        """A flat batch's host lists: (flags [R] last-only per row, ids [T], pos [T],
        slots [T], sel: the token indexes whose logits are wanted), T = sum(len_i)."""
        flags = last_only if isinstance(last_only, list) else [bool(last_only)] * len(rows)
        ids, pos, slots, sel = [], [], [], []
        for r, lo in zip(rows, flags):
            n = len(r.token_ids)
            sel.extend([len(ids) + n - 1] if lo else range(len(ids), len(ids) + n))
            ids.extend(r.token_ids)
            pos.extend(range(r.start, r.start + n))
            slots.extend([r.slot] * n)
        return flags, ids, pos, slots, sel

    @torch.inference_mode()
    def _run_stack(self, rows: list[RowInput], last_only: bool | list[bool] = False,
                   aux_layers: tuple[int, ...] = ()
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The route's stack call (``FORWARD_PATH_STACK``): every layer in one C call over
        this cache (``stack``); as ``run``, with ``aux_layers`` outputs per row [len_i, A * H]."""
        dev = self.device
        flags, ids, pos, slots, sel = self._flat_inputs(rows, last_only)
        self.paths.append(M.FORWARD_PATH_STACK)
        out = self.model.forward_stack(
            torch.tensor([ids], dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            torch.tensor(slots, dtype=torch.long, device=dev), self._stack,
            torch.tensor([sel], dtype=torch.long, device=dev), max(pos), aux_layers)
        aux, at = None, 0
        if aux_layers:
            aux = []
            for r in rows:
                aux.append(out.aux_hidden[0, at:at + len(r.token_ids)])
                at += len(r.token_ids)
        return self._flat_rows(out, rows, flags), aux

    def _run_flat_past_stack(self, rows: list[RowInput], last_only: bool | list[bool] = False
                             ) -> tuple[list[torch.Tensor], None] | None:
        """The route's flat forward of a batch past the stack call (compiled or eager:
        ``run_flat`` without the stack); None when the compiled graph refuses it."""
        return self.run_flat(rows, last_only, stack=False)

    @torch.inference_mode()
    def run_flat(self, rows: list[RowInput], last_only: bool | list[bool] = False,
                 strict: bool = True, stack: bool = True, aux_layers: tuple[int, ...] = ()
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None] | None:
        """As ``run`` (no aux layers) on the flat forward: the rows' ``T = sum(len_i)``
        tokens as one sequence [1, T], no padding, each token attending its own slot up
        to its own position; the LM head only where logits are wanted. At most
        ``stack_max_tokens`` tokens run in one C call (``stack``; ``stack=False``: not,
        as the compile warm-up wants), more on the compiled forward (``compile``) or
        eager. ``aux_layers`` (the stack call only): their outputs per row, [len_i, A * H],
        as ``run``'s aux. Returns None (nothing written) when the batch would need a graph the
        warm-up did not build (``strict``; the caller runs it eager)."""
        if stack and sum(len(r.token_ids) for r in rows) <= self.stack_max_tokens \
                and self.stack() is not None:
            return self._run_stack(rows, last_only, aux_layers)
        if aux_layers:
            raise ValueError("run_flat: aux layers need the stack call")
        flags, ids, pos, slots, sel = self._flat_inputs(rows, last_only)
        # one graph: T and R are never 1 (a size-1 dim would be specialised into a graph of
        # its own). A lone token is sent twice (the same K/V written twice to the same
        # place, the same attention), a lone logits row asked twice; the copies are dropped.
        compiled = self._flat is not None
        if compiled and len(ids) == 1:
            ids, pos, slots = ids * 2, pos * 2, slots * 2
        if compiled and len(sel) == 1:
            sel = sel * 2
        dev = self.device
        meta = self._flat_meta(pos, slots, compiled)
        ids_t = torch.tensor([ids], dtype=torch.long, device=dev)
        idx = torch.tensor([sel], dtype=torch.long, device=dev)
        if not compiled:             # eager_flat
            self.paths.append(M.FORWARD_PATH_OPS)
            out = self.model(ids_t, cache=self.cache, meta=meta, logits_index=idx)
            return self._flat_rows(out, rows, flags), None
        out = self._run_compiled(ids_t, meta, idx, strict)
        return None if out is None else (self._flat_rows(out, rows, flags), None)

    def _flat_meta(self, pos: list[int], slots: list[int], compiled: bool) -> BatchMeta:
        """The ``BatchMeta`` of a flat batch: tokens at ``pos`` [T] of ``slots`` [T]; the C
        attention kernel (eager, or ``flat_kernel`` in the graph) or the two context groups
        of the compiled torch attention (``flat_groups``)."""
        dev = self.device
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        slots_t = torch.tensor(slots, dtype=torch.long, device=dev)
        meta = BatchMeta(slots=slots_t, starts=pos_t, kv_len=max(pos) + 1, flat=True,
                         positions=pos_t[None])
        meta.write_rows, meta.write_pos = slots_t, pos_t
        if self.flat_kernel or not compiled:   # the kernel reads each token's own positions only
            meta.flat_kernel = True
        else:
            meta.flat_groups, meta.flat_back = self.flat_groups(pos)
        return meta

    def _run_compiled(self, ids_t: torch.Tensor, meta: BatchMeta, idx: torch.Tensor,
                      strict: bool) -> ForwardOutput | None:
        """The compiled flat forward (``FORWARD_PATH_COMPILED``) on ids [1, T] and logits
        index [1, R], every size marked dynamic; with ``strict`` a batch that would compile
        again returns None (counted in ``flat_fallbacks``, nothing written)."""
        from torch._dynamo import mark_dynamic      # (loaded by ``compile`` already)

        for t, dim in ((ids_t, 1), (meta.starts, 0), (meta.slots, 0), (idx, 1),
                       *(((meta.flat_back, 0), *((i, 0) for i, _ in meta.flat_groups))
                         if meta.flat_groups is not None else ())):
            mark_dynamic(t, dim)
        self.paths.append(M.FORWARD_PATH_COMPILED)
        if not strict:
            return self._flat(ids_t, cache=self.cache, meta=meta, logits_index=idx)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._flat(ids_t, cache=self.cache, meta=meta, logits_index=idx)
        except RuntimeError as exc:
            if "recompile" not in str(exc):
                raise
            self.flat_fallbacks += 1
            self.paths.pop()
            return None

    @staticmethod
    def _flat_rows(out: ForwardOutput, rows: list[RowInput], flags: list[bool]) -> list[torch.Tensor]:
        """A flat forward's logits [1, R, V] split per row: [1, V] (last only) or [len_i, V]."""
        logits = out.logits[0].float()                     # [len(sel), V]
        per_row, at = [], 0
        for r, lo in zip(rows, flags):
            k = 1 if lo else len(r.token_ids)
            per_row.append(logits[at:at + k])
            at += k
        return per_row

    @torch.inference_mode()
    def run_packed(self, rows: list[RowInput], last_only: bool | list[bool] = False,
                   aux_layers: tuple[int, ...] = ()
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """As ``run``, but the rows' tokens go through the model as one sequence of
        ``sum(len_i)`` tokens (no padding): every GEMM is over the real tokens only,
        and each row attends its own cache slot (``BatchMeta.segments``). What a
        batch of prompt chunks of different lengths (arrivals together) needs."""
        dev = self.device
        flags = last_only if isinstance(last_only, list) else [bool(last_only)] * len(rows)
        ids, pos, segs, masks, sel = [], [], [], [], []
        off = 0
        for r, lo in zip(rows, flags):
            n = len(r.token_ids)
            ids.extend(r.token_ids)
            pos.extend(range(r.start, r.start + n))
            segs.append((r.slot, r.start, off, n))
            if r.start == 0 or n == 1:
                masks.append(None)
            else:
                kpos = torch.arange(r.start + n, device=dev)
                qpos = torch.arange(r.start, r.start + n, device=dev)
                masks.append((kpos[None, :] <= qpos[:, None])[None, None])
            sel.extend([off + n - 1] if lo else range(off, off + n))
            off += n
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        slots_t = torch.tensor([r.slot for r in rows], dtype=torch.long, device=dev)
        meta = BatchMeta(slots=slots_t, starts=torch.tensor([r.start for r in rows],
                                                            dtype=torch.long, device=dev),
                         kv_len=max(r.start + len(r.token_ids) for r in rows),
                         segments=segs, positions=pos_t[None], seg_masks=masks)
        meta.write_pos = pos_t
        meta.write_rows = torch.repeat_interleave(
            slots_t, torch.tensor([len(r.token_ids) for r in rows], device=dev))
        # the LM head only where logits are wanted (each prompt chunk's last token)
        idx = None if not any(flags) else torch.tensor([sel], dtype=torch.long, device=dev)
        self.paths.append(M.FORWARD_PATH_OPS)
        out: ForwardOutput = self.model(torch.tensor([ids], dtype=torch.long).to(dev),
                                        cache=self.cache, meta=meta, logits_index=idx,
                                        aux_layers=aux_layers)
        logits = out.logits[0].float()                     # [len(sel), V]
        per_row, at = [], 0
        for (_, _, _, n), lo in zip(segs, flags):
            k = 1 if lo else n
            per_row.append(logits[at:at + k])
            at += k
        aux = None
        if out.aux_hidden is not None:
            aux = [out.aux_hidden[0, o:o + n] for _, _, o, n in segs]
        return per_row, aux

    @torch.inference_mode()
    def run_padded(self, rows: list[RowInput], last_only: bool = False,
                   aux_layers: tuple[int, ...] = ()
                   ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """As ``run`` but logits stay one padded tensor: [B, Q, V] float32 (Q =
        longest row; positions past a row's length are padding), or [B, 1, V]
        with ``last_only``; the batched verifier reads it in one transfer. Sets
        ``last_padded`` (the forward computed B x Q tokens, padding included)."""
        self.last_padded = True
        B = len(rows)
        # Rows whose slots are a permutation of a consecutive range run in slot order,
        # so attention reads the cache as a view (no per-layer gather of every row's
        # context); the outputs are put back in the callers' order.
        order = sorted(range(B), key=lambda i: rows[i].slot)
        lo = rows[order[0]].slot
        consecutive = all(rows[j].slot == lo + n for n, j in enumerate(order))
        if consecutive and order != list(range(B)):
            back = [0] * B
            for n, j in enumerate(order):
                back[j] = n
            logits, aux = self.run_padded([rows[j] for j in order], last_only, aux_layers)
            return logits[back], (None if aux is None else [aux[n] for n in back])
        lens = [len(r.token_ids) for r in rows]
        Q = max(lens)
        # everything the forward needs from the host, built in Python: one tensor
        # per field, no per-row copies, no device syncs inside the model
        ids = torch.tensor([r.token_ids + [self.pad_id] * (Q - n) for r, n in zip(rows, lens)],
                           dtype=torch.long)
        starts = [r.start for r in rows]
        slots = [r.slot for r in rows]
        meta = BatchMeta(slots=torch.tensor(slots, dtype=torch.long, device=self.device),
                         starts=torch.tensor(starts, dtype=torch.long, device=self.device),
                         kv_len=max(starts) + Q,
                         single=(lo, starts[0]) if B == 1 else None,
                         slot_range=(lo, lo + B) if consecutive else None)
        if B > 1:
            meta.long_rows, meta.kv_short = self.split_long(rows, meta.kv_len)
        idx = None
        if last_only and Q > 1:   # (rows of one token: their logits are the last ones)
            idx = torch.tensor([[n - 1] for n in lens], dtype=torch.long, device=self.device)
        ids = ids.to(self.device)
        self.paths.append(M.FORWARD_PATH_OPS)
        out: ForwardOutput = self.model(ids, cache=self.cache, meta=meta, logits_index=idx,
                                        aux_layers=aux_layers)
        aux = None
        if out.aux_hidden is not None:
            aux = [out.aux_hidden[i, :lens[i]] for i in range(B)]
        return out.logits.float(), aux
