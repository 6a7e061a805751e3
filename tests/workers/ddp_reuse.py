"""Worker for tests/test_distributed.py: a few ReSPO steps with R=4 under torch.distributed (gloo, CPU).

Each rank writes its logged metrics to ``<out>/rank<r>.json`` so the test can check that the reduced diagnostics agree.
Launch: ``torchrun --nproc_per_node 2 tests/workers/ddp_reuse.py <out>``.
"""

import json
import os
import sys

# torchrun runs this file by path, so tests/ (conftest's CPU_ARGS) is not on its path; respo_trl is on PYTHONPATH
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from conftest import CPU_ARGS, crc_reward  # noqa: E402
from datasets import Dataset  # noqa: E402

from respo_trl import ReSPOConfig, ReSPOTrainer  # noqa: E402
from respo_trl.builtin.tiny_model import build_char_tokenizer, tiny_qwen3  # noqa: E402

out = sys.argv[1]
tokenizer = build_char_tokenizer()
rows = [[{"role": "user", "content": f"{i}*{i % 5}="}] for i in range(64)]
dataset = Dataset.from_dict({"prompt": rows})
args = ReSPOConfig(
    **{**CPU_ARGS, "output_dir": os.path.join(out, "run"), "num_iterations": 4, "max_steps": 5, "per_device_train_batch_size": 4}
)


class RecordingTrainer(ReSPOTrainer):
    """Records this rank's own completion lengths, before any cross-process reduction."""

    local_tokens = 0

    def _generate(self, prompts):
        output = super()._generate(prompts)
        if self.model.training:
            self.local_tokens += sum(len(ids) for ids in output[1])
        return output


trainer = RecordingTrainer(
    model=tiny_qwen3(tokenizer), reward_funcs=crc_reward, args=args, train_dataset=dataset, processing_class=tokenizer
)
trainer.train()
rank = trainer.accelerator.process_index
logs = [h for h in trainer.state.log_history if "loss" in h]
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"world_size": trainer.accelerator.num_processes, "logs": logs, "local_tokens": trainer.local_tokens,
               "generated_tokens": trainer.rollouts.generated_tokens}, f)
# Leave without interpreter teardown once every rank has written its results. On this CPU/gloo stack a rank
# occasionally aborts while destroying the process group objects at exit ("terminate called without an active
# exception", about 1 run in 10, after all work is done), which would fail the test for a reason unrelated to it.
trainer.accelerator.wait_for_everyone()
trainer.accelerator.end_training()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
