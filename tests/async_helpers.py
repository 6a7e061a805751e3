"""What the async trainer's tests share (main suite and the real-vLLM suite): a spy on the packed micro-batches and
the loss the trainer returned for each, and the per-sequence closed form computed apart from the trainer."""

from __future__ import annotations

import math

import torch


class Spy:
    """Records each micro-batch's packed samples (from TRL's collator) and the loss the trainer returned for it."""

    def __init__(self, trainer):
        self.rows, self.losses, self.versions = [], [], []
        loader = trainer.get_train_dataloader
        compute = trainer.compute_loss

        def get_train_dataloader():
            dataloader = loader()
            base = getattr(dataloader, "base_dataloader", dataloader)
            collate = base.collate_fn

            def recording(examples):
                batch = collate(examples)
                self.rows.append([dict(s) for s in examples[0][0].samples])
                return batch

            base.collate_fn = recording
            return dataloader

        def compute_loss(model, inputs, *args, **kwargs):
            samples = self.rows.pop(0)  # the collator runs one batch ahead (accelerate's dispatcher prefetches)
            state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            loss = compute(model, inputs, *args, **kwargs)
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True, allow_unused=True)
            grads = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads)}
            self.losses.append((samples, state, loss.detach().item(), trainer.model_version, grads))
            return loss

        trainer.get_train_dataloader = get_train_dataloader
        trainer.compute_loss = compute_loss


def reference_log_probs(model_dir, state, samples):
    """Each sample's trained-token log-probabilities (differentiable) from a plain causal forward (eager attention,
    one sample at a time) of a copy of the trainer's weights, independent of tree packing and of the scatter; and that
    copy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    model.load_state_dict({k: v for k, v in state.items()}, strict=False)
    out = []
    for sample in samples:
        ids = torch.as_tensor(sample["input_ids"]).unsqueeze(0)
        logits = model(input_ids=ids).logits[0, :-1].float()
        logps = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        mask = torch.as_tensor(sample["completion_mask"])[1:].bool()
        out.append((logps[mask], torch.as_tensor(sample["old_log_probs"])[1:][mask].float()))
    return out, model


def phi_respo(w: float, a: float) -> float:
    """The paper's kernel at its constants, written out: phi+(W) = (1 + W)/2 exp(1 - W), phi-(W) = sqrt(W) exp(2 (1 -
    sqrt(W)))."""
    return (1 + w) / 2 * math.exp(1 - w) if a >= 0 else math.sqrt(w) * math.exp(2 * (1 - math.sqrt(w)))


def phi_vespo(w: float, a: float) -> float:
    """VESPO at TRL's defaults: W^k exp(lambda (1 - W)), (k, lambda) = (2, 3) for A >= 0 and (3, 2) for A < 0."""
    k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
    return w**k * math.exp(lam * (1 - w))


def closed_form_check(spy: Spy, model_dir: str, phi) -> int:
    """Every recorded micro-batch's loss and gradient equal ``-(1/N) sum_i phi(W_i) A_i sum_t log r_it`` with ``phi`` a
    number (its gradient ``phi A grad log pi``), ``log r`` from :func:`reference_log_probs`, ``N`` the micro-batch's
    trained tokens; returns how many sequences had ``|log W| > 1e-3`` (that the check ran off-policy)."""
    import pytest

    moved = 0
    for samples, state, loss, _, grads in spy.losses:
        terms, reference = reference_log_probs(model_dir, state, samples)
        n_tokens = sum(len(lp) for lp, _ in terms)
        expected = 0.0
        for (logps, old), sample in zip(terms, samples):
            log_ratio = (logps - old).sum()
            w = math.exp(max(min(log_ratio.item(), 20.0), -20.0))
            moved += abs(math.log(w)) > 1e-3
            a = float(sample["advantage"])
            expected = expected - phi(w, a) * a * log_ratio  # phi a number: the gradient is phi A grad log pi
        expected = expected / n_tokens
        assert loss == pytest.approx(expected.item(), rel=2e-3, abs=2e-5)
        reference_grads = dict(zip([n for n, _ in reference.named_parameters()],
                                   torch.autograd.grad(expected, list(reference.parameters()))))  # fmt: skip
        for name, grad in grads.items():
            assert torch.allclose(grad, reference_grads[name], rtol=1e-3, atol=1e-6), name
    return moved
