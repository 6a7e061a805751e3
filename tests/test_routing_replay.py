"""Routing Replay (R3) on the tiny Qwen3-MoE: what generate records is what a full forward routes, replay forces it.

The generation side is transformers' KV-cached ``generate`` (prefill over left-padded prompts, then one token per
forward); the training side is a full forward over TRL's layout ``cat([left-padded prompt, right-padded completion])``.
Completions end at different lengths (a forced EOS) so both paddings and the never-fed last token are exercised.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from transformers import LogitsProcessor, LogitsProcessorList

from respo_trl.builtin.tiny_model import tiny_qwen3
from respo_trl.routing_replay import NO_ROUTE, ROUTES_KEY, RoutingReplay

PROMPTS = ["1+2=", "12+345=", "7=", "99+1+2+3=", "5+5=", "123="]
MAX_NEW = 9
# row -> completion step at which EOS is forced (0-based). Row 3 ends on the last step: its EOS is never fed back.
EOS_AT = {0: 2, 2: 5, 3: MAX_NEW - 1, 5: 0}


class _ForcedEos(LogitsProcessor):
    """EOS exactly at ``EOS_AT[row]``, never elsewhere: deterministic completion lengths under sampling."""

    def __init__(self, prompt_width: int, eos_id: int):
        self.prompt_width, self.eos_id = prompt_width, eos_id

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_width
        scores[:, self.eos_id] = -float("inf")
        for row, at in EOS_AT.items():
            if step == at:
                scores[row] = -float("inf")
                scores[row, self.eos_id] = 0.0
        return scores


def _generate(model, replay, tokenizer, seed=0):
    """Recorded sampling; returns per-sequence prompt and completion id lists (completions cut after EOS)."""
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)  # the tokenizer pads on the left
    width = encoded.input_ids.shape[1]
    torch.manual_seed(seed)
    with torch.no_grad(), replay.recording():
        out = model.generate(
            **encoded,
            do_sample=True,
            max_new_tokens=MAX_NEW,
            logits_processor=LogitsProcessorList([_ForcedEos(width, tokenizer.eos_token_id)]),
            pad_token_id=tokenizer.pad_token_id,
        )
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    completions = []
    for row in out[:, width:].tolist():
        cut = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        completions.append(row[:cut])
    replay.finish(prompts, completions)
    return prompts, completions


def _training_batch(prompts, completions, pad_id):
    """TRL's layout: left-padded prompts, right-padded completions, their masks."""
    prompt_ids = pad_sequence([torch.tensor(p) for p in prompts], True, pad_id, "left")
    prompt_mask = pad_sequence([torch.ones(len(p), dtype=torch.long) for p in prompts], True, 0, "left")
    completion_ids = pad_sequence([torch.tensor(c) for c in completions], True, pad_id, "right")
    completion_mask = pad_sequence([torch.ones(len(c), dtype=torch.long) for c in completions], True, 0, "right")
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    return input_ids, torch.cat([prompt_mask, completion_mask], dim=1), completion_ids.shape[1]


def _completion_logps(model, input_ids, attention_mask, keep):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -keep - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, -keep:, None]).squeeze(-1)


def blocks(model):
    return [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]


def _perturb_routers(replay, scale=0.5, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in replay.gates:
            gate.weight.add_(scale * gate.weight.abs().mean() * torch.randn(gate.weight.shape, generator=generator))


@pytest.fixture
def recorded(tokenizer):
    model = tiny_qwen3(tokenizer, moe=True, num_experts=8, experts_per_token=2).eval()
    replay = RoutingReplay(model)
    prompts, completions = _generate(model, replay, tokenizer)
    input_ids, attention_mask, keep = _training_batch(prompts, completions, tokenizer.pad_token_id)
    return model, replay, prompts, completions, input_ids, attention_mask, keep, replay.layout(input_ids, keep)


def test_recorded_routing_is_the_free_routing_of_the_same_sequences(recorded):
    model, replay, prompts, completions, input_ids, attention_mask, keep, routes = recorded
    lengths = [len(c) for c in completions]
    assert lengths == [3, MAX_NEW, 6, MAX_NEW, MAX_NEW, 1]  # EOS before the end, at the end, and none
    # Recorded: every prompt token, and every completion token that was fed back, i.e. all but a last token sampled
    # at the final step (rows 1, 3 and 4). Row 5's EOS came first and was fed with the rest of the batch.
    fed = [len(p) + min(len(c), MAX_NEW - 1) for p, c in zip(prompts, completions)]
    known = routes[..., 0, 0] >= 0
    assert known.sum(1).tolist() == fed
    assert ((routes >= 0) == known[..., None, None]).all()  # a position is recorded in every layer or in none
    assert (routes[~known] == NO_ROUTE).all()
    assert not known[attention_mask == 0].any()  # padding is never "recorded"

    with torch.no_grad(), replay.capturing() as captured:
        free_logps = _completion_logps(model, input_ids, attention_mask, keep)
    (_, free_routes), = captured
    assert torch.equal(routes[known], free_routes[known])  # same experts, same order, at the sampling weights

    with torch.no_grad(), replay.replaying(input_ids, routes):
        replayed_logps = _completion_logps(model, input_ids, attention_mask, keep)
    assert torch.equal(replayed_logps, free_logps)  # unchanged weights and selection: replay changes nothing
    assert replay.last_stats.tolist() == [0, known.sum().item() * replay.num_layers, 0, known.sum().item()]


@pytest.mark.parametrize("norm_topk_prob", [False, True])  # transformers' default; every released Qwen3-MoE
def test_replay_forces_the_recorded_experts_after_the_router_moves(recorded, norm_topk_prob):
    model, replay, _, _, input_ids, attention_mask, keep, routes = recorded
    for gate in replay.gates:
        gate.norm_topk_prob = norm_topk_prob
    _perturb_routers(replay)
    known = routes[..., 0, 0] >= 0

    with torch.no_grad(), replay.capturing() as captured:
        free_logps = _completion_logps(model, input_ids, attention_mask, keep)
    (_, free_routes), = captured
    moved = (free_routes.sort(-1).values != routes.sort(-1).values).any(-1) & known[..., None]
    assert moved.float().mean() > 0.2  # the perturbation really changes the free routing

    used, logits = [], []  # per MoE layer: the expert indices the experts module receives; the router's logits
    hooks = [block.experts.register_forward_pre_hook(lambda m, a: used.append(a[1].clone())) for block in blocks(model)]
    hooks += [gate.register_forward_hook(lambda m, a, out: logits.append(out[0].clone())) for gate in replay.gates]
    with torch.no_grad(), replay.replaying(input_ids, routes):
        replayed_logps = _completion_logps(model, input_ids, attention_mask, keep)
    for hook in hooks:
        hook.remove()
    used = torch.stack([u.view(*input_ids.shape, -1) for u in used], dim=2)
    assert torch.equal(used[known], routes[known].long())  # the sampler's experts, in every layer
    # Unrecorded positions route freely; past layer 0 their hidden states already depend on replayed tokens.
    assert torch.equal(used[~known][:, 0], free_routes[~known][:, 0].long())
    # Drift: slots where the current router, on the hidden state it gets in the replayed forward, would pick another
    # expert set than the replayed one; at layer 0 that is exactly the free forward's disagreement.
    would = torch.stack([lg.topk(replay.top_k, -1).indices.view(*input_ids.shape, -1) for lg in logits], dim=2)
    drift = (would.sort(-1).values != routes.sort(-1).values).any(-1) & known[..., None]
    assert torch.equal(drift[..., 0], moved[..., 0])
    assert replay.last_stats.tolist() == [
        drift.sum().item(), known.sum().item() * replay.num_layers, drift.any(-1).sum().item(), known.sum().item()
    ]

    # An independent forced-routing forward: each gate replaced by "logits of the current router, the recorded
    # experts, softmax weights on them, renormalised over them (R3's formula) iff norm_topk_prob".
    originals = {}
    for layer, gate in enumerate(replay.gates):
        target = routes[:, :, layer].reshape(-1, replay.top_k).long()

        def forced(hidden, gate=gate, target=target):
            logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits.float(), -1)
            index = torch.where(target[:, :1] >= 0, target, probs.topk(gate.top_k, -1).indices)
            weights = probs.gather(1, index)
            if norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), index

        originals[gate] = gate.forward
        gate.forward = forced
    try:
        with torch.no_grad():
            forced_logps = _completion_logps(model, input_ids, attention_mask, keep)
    finally:
        for gate, forward in originals.items():
            gate.forward = forward
    assert torch.equal(replayed_logps, forced_logps)
    completion = attention_mask[:, -keep:].bool()
    assert (replayed_logps - free_logps)[completion].abs().max() > 1e-3


def test_chunked_forwards_match_rows_in_order_and_misaligned_rows_fail(recorded):
    model, replay, _, _, input_ids, attention_mask, keep, routes = recorded
    _perturb_routers(replay)
    with torch.no_grad(), replay.replaying(input_ids, routes):
        whole = _completion_logps(model, input_ids, attention_mask, keep)
    with torch.no_grad(), replay.replaying(input_ids, routes):  # TRL's batch_size chunking: consecutive row slices
        chunked = torch.cat([_completion_logps(model, input_ids[i : i + 2], attention_mask[i : i + 2], keep) for i in (0, 2, 4)])
    assert torch.allclose(whole, chunked, atol=1e-5)
    order = torch.tensor([1, 0, 2, 3, 4, 5])
    with pytest.raises(RuntimeError, match="does not match rows"), torch.no_grad(), replay.replaying(input_ids, routes):
        _completion_logps(model, input_ids[order], attention_mask[order], keep)
    # The layout refuses a forward whose rows are not the recorded sequences (here: completions shifted by one).
    shifted = torch.cat([input_ids[:, :1], input_ids[:, :-1]], dim=1)
    with pytest.raises(RuntimeError, match="does not hold recorded sequence"):
        replay.layout(shifted, keep)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recomputes_with_the_replayed_routes(recorded, use_reentrant):
    model, replay, _, _, input_ids, attention_mask, keep, routes = recorded
    _perturb_routers(replay)
    model.train()
    completion = attention_mask[:, -keep:].float()

    def grads():
        model.zero_grad()
        with replay.replaying(input_ids, routes):
            loss = -(_completion_logps(model, input_ids, attention_mask, keep) * completion).sum()
        other = torch.where(routes >= 0, (routes + 1) % replay.num_experts, routes)  # other experts, same rows
        with torch.no_grad(), replay.replaying(input_ids, other):  # a no-grad replayed forward before the backward
            model(input_ids=input_ids, attention_mask=attention_mask)
        loss.backward()  # outside the context, as in TRL (the loss is returned, then backpropagated)
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = grads()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    if use_reentrant:
        model.enable_input_require_grads()
    checkpointed = grads()
    assert len(plain) == len(checkpointed)
    for a, b in zip(plain, checkpointed):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    assert all(not saved for saved in replay._saved)  # every recomputation consumed its forward's routes
    assert all(gate.weight.grad.abs().sum() > 0 for gate in replay.gates)  # the router still learns


def test_training_with_routing_replay_logs_drift_and_keeps_routes_with_the_rows(make_trainer):
    # respo_min_ess=1.0: every ESS check (a replayed forward: before the second mini-batch of each pass, which is one
    # update stale, and before the reuse pass) runs and, the weights having moved, refreshes the batch: three more
    # recorded generations, whose routes must follow their rows as the first batch's do.
    refreshed = make_trainer(
        moe=True, respo_routing_replay=True, num_iterations=2, steps_per_generation=2, max_steps=4, respo_min_ess=1.0
    )
    refreshed.train()
    assert refreshed.rollouts.refreshes == 3
    assert all(h["routing/drift"] == 0.0 for h in refreshed.state.log_history if "routing/drift" in h)  # all fresh
    trainer = make_trainer(moe=True, respo_routing_replay=True, num_iterations=2, steps_per_generation=2, max_steps=4)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "routing/drift" in h]
    assert len(logs) == 4
    # Step 1 trains on rollouts of the current weights: the recorded routing is the free routing (end-to-end check
    # that generation records and the loss forward replays the same token positions). Later steps have drifted.
    assert logs[0]["routing/drift"] == 0.0
    assert max(h["routing/drift"] for h in logs[1:]) > 0.0
    for batch in (refreshed.rollouts.batch, trainer.rollouts.batch):  # a refreshed batch keeps its routes too
        routes = batch[ROUTES_KEY]
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1).bool()
        assert not (routes[..., 0, 0] >= 0)[~mask].any() and (routes[..., 0, 0] >= 0).sum() > 0.8 * mask.sum()
    batch = trainer.rollouts.batch
    routes = batch[ROUTES_KEY]
    width = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    assert routes.shape == (batch["prompt_ids"].shape[0], width, trainer.routing_replay.num_layers, 2)
    known = routes[..., 0, 0] >= 0
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1).bool()
    assert not known[~mask].any() and known.sum() > 0.8 * mask.sum()
    # The buffered (stale) rows: their stored routes differ from what the trained router would pick now.
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    with torch.no_grad(), trainer.routing_replay.replaying(input_ids, routes):
        trainer.model(input_ids=input_ids, attention_mask=mask.long())
    assert trainer.routing_replay.last_stats[0] > 0


def test_routing_replay_refuses_setups_where_routing_is_not_recorded(make_trainer):
    from respo_trl import ReSPOConfig

    with pytest.raises(ValueError, match="use_vllm"):
        ReSPOConfig(output_dir="unused", use_cpu=True, bf16=False, respo_routing_replay=True, use_vllm=True)
    with pytest.raises(ValueError, match="respo_routing_replay=False"):
        make_trainer(moe=False, respo_routing_replay=True)
