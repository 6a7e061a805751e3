"""Routing Replay (R3) for Qwen3-MoE in transformers: record the experts the sampler chose, replay them in training.

Why. In a Mixture-of-Experts policy every token of every MoE layer goes to the ``k`` experts with the largest router
probability. That top-k choice is a discontinuous function of the hidden state: a tiny numerical difference (a kernel,
a batch shape, a KV cache against a full forward) or a small weight update between sampling and training flips a
near-tied choice, and the token is then scored through different experts than the ones that generated it. The
training log-prob is then not the sampler's, the importance weight ``w = pi_theta / mu`` picks up noise that has
nothing to do with the policy update, and a loss that trusts ``w`` (ReSPO, GSPO, clipped PPO) trains on that noise.
Rollout Routing Replay (R3, Ma et al. 2025, arXiv:2510.11370) records, at rollout time, the top-k expert indices each
MoE layer chose for each token, and replays them in the training forward passes: the *selection* is the sampler's,
the *gating weights* are recomputed from the current router logits, so the router keeps receiving gradient.

What is replayed. With router logits ``s`` (current weights) and the recorded expert set ``I`` of a token, R3 defines

    g_e = 1[e in I] * exp(s_e) / sum_{j in I} exp(s_j),

which is exactly what Qwen3-MoE computes for its own top-k when ``norm_topk_prob=True`` (every released Qwen3-MoE
checkpoint): ``softmax(s)`` gathered on the selected experts and renormalised. We apply the *router's own* weighting
to the replayed set: ``g_e = softmax(s)_e`` for ``e in I``, renormalised over ``I`` iff ``norm_topk_prob``. That is
R3's formula for ``norm_topk_prob=True`` and the architecture's un-normalised gate otherwise, and with unchanged
weights and unchanged selection it is bit-for-bit the free forward. The router logits returned to the model (the
MoE load-balancing auxiliary loss) are the current, free ones, as in Megatron-LM/verl's replay.

Where routing comes from. transformers' ``generate`` (KV-cached): the first forward of a ``generate`` call (prefill)
covers the left-padded prompts, every later forward one new token per sequence. Forward hooks on each
``Qwen3MoeTopKRouter`` record its indices; :meth:`RoutingReplay.finish` turns the recording into one
``(prompt_len + completion_len, num_moe_layers, top_k)`` tensor per sequence, aligned with the sequence's own tokens
(checked token by token against the ids the model was fed). The last completion token is never fed to the model
(nothing is sampled after it), so its routing is unknown: it gets ``NO_ROUTE`` and routes freely, which changes no
scored log-prob (a token's own experts only shape the predictions of the tokens after it).

Where it is replayed. :meth:`RoutingReplay.layout` places those per-sequence routes into the training layout (TRL's
``cat([left-padded prompt_ids, right-padded completion_ids])``), ``NO_ROUTE`` on padding. :meth:`replaying` makes
every forward of the model inside it use them; the forward may be chunked (TRL's ``batch_size``), each chunk's rows
are matched to the layout in order and checked to be the same token ids. Activation checkpointing recomputes the
MoE layers during backward, outside any context: each router keeps the routes its replayed forwards used and its
recomputations pop them (last in, first out, the order autograd recomputes chunks in), as Megatron's
``replay_backward`` does.

Limits (see docs/moe.md): Qwen3-MoE routers only (``Qwen3MoeTopKRouter``); transformers ``generate`` only (TRL 1.16's
vLLM path drops the routing vLLM can return; continuous batching and multi-turn tool loops are not recorded).
Pure torch; no TRL import: ``ReSPOTrainer`` (:mod:`respo_trl.trainer`, the seam into TRL) drives it from its
``_generate`` (recording), ``_generate_and_score_completions`` (the batch's routes, kept as :data:`ROUTES_KEY` so they
follow the rows through shuffling, the rollout buffer and its checkpoints), every log-prob forward (replay) and
``_compute_loss`` (the micro-batch's routes, and the drift it logs).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

NO_ROUTE = -1  # "no recorded routing here": padding, and the last completion token (never fed to the model)
ROUTES_KEY = "routed_experts"  # the batch-dict field: (B, P + C, num_moe_layers, top_k) int16, NO_ROUTE where unknown
SUPPORTED_ROUTERS = ("Qwen3MoeTopKRouter",)
# The gate's forward returns (router_logits, top-k weights, top-k indices) and the block feeds weights and indices to
# its experts; the replayed weights follow Qwen3MoeTopKRouter.forward (softmax over all experts in float32, gather,
# optional renormalisation, cast back to the logits' dtype).


def _in_backward() -> bool:
    """True while autograd runs a backward pass (activation checkpointing recomputes layers there)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class _Recording:
    input_ids: list = field(default_factory=list)  # one (B, S) tensor per forward: the ids the model was fed
    routes: list = field(default_factory=list)  # per forward, per MoE layer: (B, S, k) int16


@dataclass
class _Replay:
    input_ids: torch.Tensor  # (N, S): the rows the routes belong to
    routes: torch.Tensor  # (N, S, L, k)
    cursor: int = 0
    chunk: torch.Tensor | None = None  # (b, S, L, k): routes of the forward in flight
    token_drift: torch.Tensor | None = None  # (b*S,) bool: token whose free top-k differs in at least one layer
    save: bool = True  # keep each layer's routes for a recomputation in backward (activation checkpointing)
    stats: torch.Tensor | None = None  # [slot_drift, slots, token_drift, tokens]


class RoutingReplay:
    """Records the experts a Qwen3-MoE model routes to during ``generate`` and replays them in later forwards.

    One instance per model; it registers forward hooks on the model's routers and its base model once and is inactive
    (the hooks return immediately) outside :meth:`recording`, :meth:`capturing` and :meth:`replaying`.
    ``close()`` removes the hooks.
    """

    def __init__(self, model: torch.nn.Module):
        gates = [m for m in model.modules() if type(m).__name__ in SUPPORTED_ROUTERS]
        if not gates:
            moe_like = sorted({type(m).__name__ for m in model.modules() if "router" in type(m).__name__.lower()})
            detail = f" It has router modules {moe_like}, which are not supported." if moe_like else ""
            raise ValueError(
                f"Routing Replay needs a Qwen3-MoE model (routers of type {SUPPORTED_ROUTERS}); "
                f"{type(model).__name__} has none.{detail} Routing Replay only applies to Mixture-of-Experts models: "
                "for a dense model set respo_routing_replay=False."
            )
        self.gates = gates
        self.num_layers = len(gates)
        self.top_k = int(gates[0].top_k)
        self.num_experts = int(gates[0].num_experts)
        if any(int(g.top_k) != self.top_k or int(g.num_experts) != self.num_experts for g in gates):
            raise ValueError("Routing Replay needs the same top_k and number of experts in every MoE layer")
        if self.num_experts > torch.iinfo(torch.int16).max:
            raise ValueError(f"{self.num_experts} experts do not fit the int16 routing record")
        bases = [m for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)]
        bases = [m for m in bases if any(g in set(m.modules()) for g in gates[:1])]
        if not bases:
            raise ValueError(f"cannot find the decoder stack (a module with .layers) of {type(model).__name__}")
        self.base = bases[-1]  # innermost module holding the decoder layers (Qwen3MoeModel): it sees input_ids
        self._mode: str | None = None
        self._shape: tuple[int, int] | None = None  # (B, S) of the forward in flight
        self._recording: _Recording | None = None
        self._replay: _Replay | None = None
        self._saved: list[list[torch.Tensor]] = [[] for _ in gates]  # per layer: routes for backward recomputation
        self.pending: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None  # (tokens, routes, prompt_len)
        self._batch_routes: torch.Tensor | None = None
        self.last_stats: torch.Tensor | None = None
        self._handles = [self.base.register_forward_pre_hook(self._base_pre_hook, with_kwargs=True)]
        for layer, gate in enumerate(gates):
            self._handles.append(gate.register_forward_hook(self._gate_hook_for(layer)))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- hooks -----------------------------------------------------------------------------------------------------

    def _base_pre_hook(self, module, args, kwargs):
        if self._mode is None:
            return None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise ValueError("Routing Replay needs input_ids in the forward (inputs_embeds-only forwards are not supported)")
        self._shape = tuple(input_ids.shape)
        if self._mode in ("record", "capture"):
            self._recording.input_ids.append(input_ids.detach())
            self._recording.routes.append([None] * self.num_layers)
        elif self._mode == "replay":
            self._next_chunk(input_ids)
        return None

    def _gate_hook_for(self, layer: int):
        def hook(module, args, output):
            if _in_backward() and self._saved[layer]:
                # Activation checkpointing: the backward recomputes this layer with the routes its forward used.
                routes = self._saved[layer].pop()
                if routes.shape[0] != output[0].shape[0]:
                    raise RuntimeError(
                        f"Routing Replay: layer {layer} recomputes {output[0].shape[0]} rows in backward but its saved "
                        f"routes cover {routes.shape[0]}"
                    )
                return self._replayed(module, output, routes, layer=None)
            if self._mode is None:
                return None
            batch, seq = self._shape
            if self._mode in ("record", "capture"):
                indices = output[2].detach().view(batch, seq, self.top_k).to(torch.int16)
                self._recording.routes[-1][layer] = indices
                return None
            routes = self._replay.chunk[:, :, layer].reshape(batch * seq, self.top_k)
            if self._replay.save:
                self._saved[layer].append(routes)
            return self._replayed(module, output, routes, layer=layer)

        return hook

    def _replayed(self, gate, output, routes: torch.Tensor, layer: int | None):
        """The gate output with the recorded experts where there are some (``routes >= 0``), free routing elsewhere."""
        router_logits, _, free_indices = output
        routes = routes.to(device=free_indices.device, dtype=free_indices.dtype)
        known = routes[:, :1] >= 0  # a position is recorded in full or not at all
        indices = torch.where(known, routes, free_indices)
        # Qwen3MoeTopKRouter's weighting on the replayed set: softmax over all experts (float32), gathered, and
        # renormalised over the k chosen ones iff norm_topk_prob (R3's g_e = exp(s_e) / sum_{j in I} exp(s_j)).
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        weights = probs.gather(1, indices)
        if gate.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(router_logits.dtype)
        if layer is not None and self._replay is not None:
            with torch.no_grad():
                # Unrecorded rows use free_indices, so they never count as drift.
                differs = (free_indices.sort(dim=-1).values != indices.sort(dim=-1).values).any(dim=-1)
                self._replay.token_drift |= differs
                self._replay.stats[0] += differs.sum()
                self._replay.stats[1] += known.sum()
        return router_logits, weights, indices

    # -- recording during generate -----------------------------------------------------------------------------------

    @contextmanager
    def recording(self):
        """Record the routing of one ``model.generate`` call (prefill, then one token per forward)."""
        self._enter("record")
        self._recording = _Recording()
        try:
            yield self
        finally:
            self._mode = None

    def finish(self, prompt_ids: list, completion_ids: list) -> list[torch.Tensor]:
        """Per-sequence routes ``(p_i + c_i, L, k)`` from the last recording, aligned with ``prompt + completion``.

        ``prompt_ids``/``completion_ids`` are the per-sequence token lists the generation returned (TRL's
        ``_generate`` output: prompts without padding, completions cut after the first EOS). Keeps the result as
        :attr:`pending` for :meth:`layout` and returns it.
        """
        recording, self._recording = self._recording, None
        if recording is None or not recording.input_ids:
            raise RuntimeError("Routing Replay: nothing was recorded (was the generation run inside recording()?)")
        batch, prefill = recording.input_ids[0].shape
        if batch != len(prompt_ids) or len(prompt_ids) != len(completion_ids):
            raise RuntimeError(
                f"Routing Replay: the recorded generate call had {batch} sequences but {len(prompt_ids)} prompts and "
                f"{len(completion_ids)} completions came back (one generate call per batch is supported)"
            )
        for step, ids in enumerate(recording.input_ids[1:], start=1):
            if ids.shape != (batch, 1):
                raise RuntimeError(
                    f"Routing Replay: forward {step} of the recorded generation fed {tuple(ids.shape)} tokens; only "
                    "KV-cached decoding (prefill, then one token per sequence per forward) can be recorded"
                )
        if any(r is None for step in recording.routes for r in step):
            raise RuntimeError("Routing Replay: a recorded forward did not run every MoE layer")
        fed = torch.cat(recording.input_ids, dim=1).cpu()  # (B, prefill + steps)
        routes = torch.stack([torch.cat([r[layer] for r in recording.routes], dim=1) for layer in range(self.num_layers)], dim=2).cpu()
        decoded = fed.shape[1] - prefill  # completion tokens that were fed back (all but the last sampled one)
        pending = []
        for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
            prompt = torch.as_tensor(list(prompt), dtype=torch.long)
            completion = torch.as_tensor(list(completion), dtype=torch.long)
            p, c = len(prompt), len(completion)
            if p == 0 or p > prefill:
                raise RuntimeError(f"Routing Replay: prompt {i} has {p} tokens, the recorded prefill {prefill}")
            n_fed = min(c, decoded)
            # Prompts are left-padded: prompt token j sits in prefill column prefill - p + j. Completion token j is
            # fed by decode forward j + 1, i.e. column prefill + j.
            seen = torch.cat([fed[i, prefill - p : prefill], fed[i, prefill : prefill + n_fed]])
            if not torch.equal(seen, torch.cat([prompt, completion[:n_fed]])):
                raise RuntimeError(
                    f"Routing Replay: sequence {i}'s recorded input ids do not match its prompt + completion; the "
                    "recording is not aligned with the generation output"
                )
            seq_routes = torch.full((p + c, self.num_layers, self.top_k), NO_ROUTE, dtype=torch.int16)
            seq_routes[:p] = routes[i, prefill - p : prefill]
            seq_routes[p : p + n_fed] = routes[i, prefill : prefill + n_fed]
            pending.append((torch.cat([prompt, completion]), seq_routes, p))
        self.pending = pending
        return [r for _, r, _ in pending]

    @contextmanager
    def capturing(self):
        """Free routing of plain forwards (no replay): yields a list that receives ``(input_ids, routes)`` per forward,
        ``routes`` of shape ``(B, S, L, k)``. For tests and diagnostics."""
        self._enter("capture")
        self._recording = _Recording()
        captured: list = []
        try:
            yield captured
        finally:
            recording, self._recording, self._mode = self._recording, None, None
            for ids, routes in zip(recording.input_ids, recording.routes):
                captured.append((ids, torch.stack(routes, dim=2)))

    # -- layout and replay -------------------------------------------------------------------------------------------

    def layout(self, input_ids: torch.Tensor, logits_to_keep: int, pending=None) -> torch.Tensor:
        """Place per-sequence routes into the ``(N, P + C, L, k)`` layout of ``input_ids = cat([prompt, completion])``.

        ``P = input_ids.size(1) - logits_to_keep`` is the left-padded prompt width, so sequence ``i`` (prompt length
        ``p``, completion length ``c``) occupies columns ``P - p .. P + c - 1``; every other column is ``NO_ROUTE``.
        Raises if the tokens there are not the recorded sequence's.
        """
        pending = self.pending if pending is None else pending
        if pending is None:
            raise RuntimeError("Routing Replay: no recorded routing to lay out (generation was not recorded)")
        rows, width = input_ids.shape
        if rows != len(pending):
            raise RuntimeError(f"Routing Replay: {rows} rows to replay but {len(pending)} recorded sequences")
        prompt_width = width - logits_to_keep
        out = torch.full((rows, width, self.num_layers, self.top_k), NO_ROUTE, dtype=torch.int16)
        host_ids = input_ids.detach().cpu()
        for i, (tokens, routes, p) in enumerate(pending):
            start, end = prompt_width - p, prompt_width + len(tokens) - p
            if start < 0 or end > width or not torch.equal(host_ids[i, start:end], tokens):
                raise RuntimeError(
                    f"Routing Replay: row {i} of the forward does not hold recorded sequence {i} at columns "
                    f"{start}..{end - 1} (prompt width {prompt_width})"
                )
            out[i, start:end] = routes
        return out.to(input_ids.device)

    @contextmanager
    def replaying(self, input_ids: torch.Tensor, routes: torch.Tensor, save_for_backward: bool | None = None):
        """Every forward of the model inside this context routes its tokens to ``routes`` (``(N, S, L, k)``, aligned
        with ``input_ids``; ``NO_ROUTE`` positions route freely). Chunked forwards are matched to rows in order.

        ``save_for_backward`` (default: whether grad is enabled when the context is entered) keeps the routes for
        the recomputations of activation checkpointing in the coming backward, and forgets those of any earlier
        forward. Decided here, outside the model: a reentrant checkpoint runs its forward under ``no_grad``.

        On exit :attr:`last_stats` holds ``[slots whose free top-k differs, replayed slots, tokens that differ in at
        least one layer, replayed tokens]`` (a slot is one token in one MoE layer), summed over the forwards.
        """
        if routes.shape[:2] != input_ids.shape or routes.shape[2:] != (self.num_layers, self.top_k):
            raise ValueError(
                f"Routing Replay: routes {tuple(routes.shape)} do not fit input_ids {tuple(input_ids.shape)} and "
                f"{self.num_layers} MoE layers x top-{self.top_k}"
            )
        self._enter("replay")
        save = torch.is_grad_enabled() if save_for_backward is None else save_for_backward
        if save:
            for saved in self._saved:
                saved.clear()  # a new differentiable forward: the previous one's backward (if any) has run
        stats = torch.zeros(4, dtype=torch.long, device=routes.device)
        self._replay = _Replay(input_ids=input_ids, routes=routes, stats=stats, save=save)
        try:
            yield self
        finally:
            self._close_chunk()
            self._mode, self._replay, self.last_stats = None, None, stats

    def _next_chunk(self, chunk_ids: torch.Tensor) -> None:
        replay = self._replay
        self._close_chunk()
        rows = chunk_ids.shape[0]
        if replay.cursor + rows > replay.input_ids.shape[0]:
            replay.cursor = 0  # a second pass over the same rows (e.g. a reference forward through the same modules)
        expected = replay.input_ids[replay.cursor : replay.cursor + rows]
        if expected.shape != chunk_ids.shape or not torch.equal(expected, chunk_ids.to(expected.device)):
            raise RuntimeError(
                f"Routing Replay: a forward of {tuple(chunk_ids.shape)} tokens does not match rows "
                f"{replay.cursor}..{replay.cursor + rows - 1} of the batch being replayed"
            )
        replay.chunk = replay.routes[replay.cursor : replay.cursor + rows]
        replay.cursor += rows
        replay.token_drift = torch.zeros(chunk_ids.numel(), dtype=torch.bool, device=replay.routes.device)

    def _close_chunk(self) -> None:
        replay = self._replay
        if replay is None or replay.chunk is None:
            return
        known = (replay.chunk[:, :, 0, 0] >= 0).reshape(-1)
        replay.stats[2] += replay.token_drift.to(replay.stats.device).sum()
        replay.stats[3] += known.sum()
        replay.chunk = None

    def _enter(self, mode: str) -> None:
        if self._mode is not None:
            raise RuntimeError(f"Routing Replay: cannot start {mode!r} inside {self._mode!r}")
        self._mode = mode

    # -- serving routes to the trainer's forwards ----------------------------------------------------------------------

    @contextmanager
    def batch(self, inputs: dict):
        """Inside, :meth:`forward_routes` serves the routes stored in the batch dict ``inputs`` (``ROUTES_KEY``)."""
        routes = inputs.get(ROUTES_KEY)
        if routes is None:
            raise RuntimeError(
                f"Routing Replay is on but the batch has no {ROUTES_KEY!r} field (was it generated with the flag off?)"
            )
        previous, self._batch_routes = self._batch_routes, routes
        try:
            yield
        finally:
            self._batch_routes = previous

    def forward_routes(self, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """Routes for a forward over ``input_ids``: the current batch's (:meth:`batch`) or the just-generated ones."""
        if self._batch_routes is not None:
            return self._batch_routes
        return self.layout(input_ids, logits_to_keep)

    def take_layout(self, prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> torch.Tensor:
        """The layout of the just-generated batch for its batch dict; forgets the pending per-sequence routes."""
        routes = self.layout(torch.cat([prompt_ids, completion_ids], dim=1), completion_ids.size(1))
        self.pending = None
        return routes


# ---------------------------------------------------------------------------------------------------------------------
# What the trainer needs to attach it
# ---------------------------------------------------------------------------------------------------------------------


def drift_metrics(stats: torch.Tensor) -> dict[str, float]:
    """From :attr:`RoutingReplay.last_stats` summed over processes: ``routing/drift``, the share of replayed
    token-layer slots whose free top-k would differ from the replayed one, and ``routing/drift_tokens``, the share of
    tokens that differ in at least one MoE layer."""
    return {"routing/drift": (stats[0] / stats[1].clamp(min=1)).item(),
            "routing/drift_tokens": (stats[2] / stats[3].clamp(min=1)).item()}  # fmt: skip


def config_problems(args) -> list[str]:
    """Why the generation configured by ``args`` (a TRL ``GRPOConfig``) cannot be recorded; empty if it can."""
    problems = []
    if getattr(args, "use_vllm", False):
        problems.append(
            "use_vllm=True: TRL 1.16 starts vLLM without enable_return_routed_experts and keeps only token ids and "
            "logprobs of its outputs, so the sampler's routing never reaches the trainer. Set use_vllm=False "
            "(transformers generate is recorded) or respo_routing_replay=False; docs/moe.md lists what TRL would need"
        )
    if getattr(args, "use_transformers_continuous_batching", False) or getattr(args, "use_transformers_paged", False):
        problems.append(
            "use_transformers_continuous_batching=True: generate_batch schedules requests itself and is not recorded; "
            "set it to False"
        )
    return problems


def attach_routing_replay(trainer) -> RoutingReplay:
    """Validate a ``GRPOTrainer``'s generation set-up and return a :class:`RoutingReplay` on its model; one
    ``ValueError`` naming every reason the sampler's routing could not be recorded."""
    problems = config_problems(trainer.args)
    if getattr(trainer, "tools", None):
        problems.append("tools: the multi-turn tool loop calls generate several times per batch; not recorded")
    if getattr(trainer, "rollout_func", None) is not None:
        problems.append("rollout_func: a custom rollout does not go through the recorded generate call")
    if problems:
        raise ValueError("respo_routing_replay=True cannot record the sampler's routing: " + "; ".join(problems))
    return RoutingReplay(trainer.accelerator.unwrap_model(trainer.model))
