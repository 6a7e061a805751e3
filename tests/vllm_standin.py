"""An in-process stand-in for TRL's vLLM generation backend (vLLM does not install on a CPU-only machine).

``FakeVLLMGeneration`` replaces ``trl.trainer.grpo_trainer.VLLMGeneration`` (see :func:`use_fake_vllm`). Like vLLM in
colocate mode it receives the process's prompts (already repeated ``num_generations`` times), samples one completion
per prompt at the trainer's temperature, and returns the sampled tokens' log-probabilities. It samples from its own
copy of the policy, refreshed by ``sync_weights()`` (TRL calls it whenever the optimizer step changes) and then
perturbed with fixed-seed noise, the way vLLM's different kernels and precision make its log-probs differ from the
trainer's: so the sampler ratio ``pi_old / pi_vllm`` is not 1, which is what the tests need.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from types import SimpleNamespace

import torch


class FakeVLLMGeneration:
    noise_std = 0.05  # weight perturbation of the "vLLM" copy: sampler log-ratios of a few tenths per sequence

    def __init__(self, model, accelerator, processing_class, **kwargs):
        self.model = model
        self.accelerator = accelerator
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.temperature = kwargs.get("temperature", 1.0)
        self.max_completion_length = kwargs["max_completion_length"]
        self.mode = kwargs.get("mode", "colocate")
        self.sampler = None
        self.syncs = 0
        self.generator = torch.Generator().manual_seed(1234)
        self.vllm_client = _FakeClient()  # server mode: TRL asks the server how it computes log-probs

    @property
    def llm(self):
        """TRL's engine handle as far as ReSPOTrainer's colocate check reads it (``llm.llm_engine.model_executor.
        driver_worker.model_runner.model``): the stand-in's model, every weight in place, so the check passes."""
        model = self.sampler if self.sampler is not None else self.accelerator.unwrap_model(self.model)
        runner = SimpleNamespace(model_runner=SimpleNamespace(model=model))
        return SimpleNamespace(llm_engine=SimpleNamespace(model_executor=SimpleNamespace(driver_worker=runner)))

    def sync_weights(self):
        model = self.accelerator.unwrap_model(self.model)
        # A fresh module with the policy's weights (not a deepcopy: TRL patches `forward` on the instance, and a copied
        # patch would keep calling the policy's own layers).
        self.sampler = type(model)(copy.deepcopy(model.config)).eval()
        self.sampler.load_state_dict(model.state_dict())
        noise = torch.Generator().manual_seed(100 + self.syncs)
        with torch.no_grad():
            for p in self.sampler.parameters():
                p.add_(torch.randn(p.shape, generator=noise) * self.noise_std)
        self.syncs += 1

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler=None):
        if self.sampler is None:
            self.sync_weights()
        eos = self.tokenizer.eos_token_id
        completions, logprobs = [], []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            tokens, lps = [], []
            past = None
            step_input = ids
            for _ in range(self.max_completion_length):
                out = self.sampler(input_ids=step_input, past_key_values=past, use_cache=True)
                past = out.past_key_values
                log_probs = torch.log_softmax(out.logits[0, -1].float() / self.temperature, -1)
                token = torch.multinomial(log_probs.exp(), 1, generator=self.generator).item()
                tokens.append(token)
                lps.append([log_probs[token].item()])
                if token == eos:
                    break
                step_input = torch.tensor([[token]])
            completions.append(tokens)
            logprobs.append(lps)
        return prompts, completions, logprobs, None


class _FakeClient:
    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}


@contextmanager
def use_fake_vllm():
    """Patch TRL's trainer module so ``use_vllm=True`` builds :class:`FakeVLLMGeneration`."""
    import trl.trainer.grpo_trainer as grpo

    original = grpo.VLLMGeneration
    grpo.VLLMGeneration = FakeVLLMGeneration
    try:
        yield
    finally:
        grpo.VLLMGeneration = original
